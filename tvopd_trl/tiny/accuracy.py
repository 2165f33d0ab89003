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
"""Accuracy of a model on a split of the embedded task, through the evaluation module."""


def evaluate_accuracy(model, tokenizer, split="test", k=4, greedy=False, seed=0, max_new_tokens=16, batch_size=512):
    """mean@k on `split` at the paper's sampling settings (T=0.6, top-p 0.95, top-k 20), or greedy accuracy."""
    from ..eval import SamplingSettings, TransformersGenerator, evaluate, mean_at_k, tiny_benchmark

    if greedy:
        settings = SamplingSettings(k=1, temperature=0, max_new_tokens=max_new_tokens)
    else:
        settings = SamplingSettings(k=k, max_new_tokens=max_new_tokens, seed=seed)
    benchmark = tiny_benchmark(split)
    results = evaluate(TransformersGenerator(model, tokenizer, batch_size), [benchmark], settings)
    return mean_at_k(results["benchmarks"][benchmark.name])
