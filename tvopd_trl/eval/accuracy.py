# Copyright 2026 The tvopd-trl Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Accuracy over k samples per problem: mean@k (the paper's number), its standard error, and unbiased pass@k."""

import math


def pass_at_k(n, c, k):
    """The unbiased pass@k estimate from `n` samples of which `c` are correct: 1 - C(n-c, k) / C(n, k).

    (Chen et al., 2021, "Evaluating Large Language Models Trained on Code".)"""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k}).")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(correct):
    """Scores of a benchmark from `correct[i][j]`, whether sample j of problem i is correct (k samples each).

    `mean@k` is the mean over problems of each problem's share of correct samples; `stderr` is its standard error
    across problems (sample standard deviation / sqrt(problems); `None` for one problem). `pass@m` is the mean over
    problems of the unbiased estimate, for m = 1, 2, 4, ... up to k and for k itself."""
    if not correct:
        raise ValueError("No problems to summarize.")
    k = len(correct[0])
    if k == 0 or any(len(samples) != k for samples in correct):
        raise ValueError("Every problem needs the same positive number of samples.")
    per_problem = [sum(samples) / k for samples in correct]
    n = len(per_problem)
    mean = sum(per_problem) / n
    stderr = None
    if n > 1:
        stderr = math.sqrt(sum((p - mean) ** 2 for p in per_problem) / (n - 1) / n)
    summary = {"k": k, "problems": n, f"mean@{k}": mean, "stderr": stderr}
    m = 1
    while m < k:
        summary[f"pass@{m}"] = sum(pass_at_k(k, sum(samples), m) for samples in correct) / n
        m *= 2
    summary[f"pass@{k}"] = sum(any(samples) for samples in correct) / n
    return summary


def mean_at_k(scores):
    """The mean@k entry of a benchmark's scores, whatever k was."""
    return scores[f"mean@{scores['k']}"]
