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
"""The embedded default task: two-digit addition, graded on the last ``\\boxed{}`` of the response.

Every problem ``"Compute a + b."`` with ``a, b`` in 10..99 (8,100 problems) falls in exactly one split, drawn by a
fixed seeded permutation:

- ``"test"`` (500): the held-out evaluation split; no model is ever trained on it;
- ``"dev"`` (500): used only to pick the student checkpoint (see `build`);
- ``"opd"`` (1,600): prompts of the on-policy distillation demo; the teacher's supervised training never sees them;
- ``"sft"`` (5,500): the teacher's supervised training data (the student is an earlier checkpoint of that run).

The reference response is ``\\boxed{a+b}`` and nothing else: the answer digits are the only tokens that carry
information, so teacher and student differ exactly there.
"""

import random

from datasets import Dataset


SPLIT_SEED = 1234
SPLIT_SIZES = {"test": 500, "dev": 500, "opd": 1600}  # "sft" takes the rest
SPLITS = ("test", "dev", "opd", "sft")


def _all_problems():
    return [(a, b) for a in range(10, 100) for b in range(10, 100)]


def _split_pairs(split):
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; choose one of {SPLITS}.")
    pairs = _all_problems()
    random.Random(SPLIT_SEED).shuffle(pairs)
    bounds, start = {}, 0
    for name in ("test", "dev", "opd"):
        bounds[name] = (start, start + SPLIT_SIZES[name])
        start += SPLIT_SIZES[name]
    bounds["sft"] = (start, len(pairs))
    first, last = bounds[split]
    return pairs[first:last]


def question(a, b):
    return f"Compute {a} + {b}."


def response(a, b):
    """The reference (teacher-training) response."""
    return f"\\boxed{{{a + b}}}"


def problems(split):
    """The problems of `split` as dicts with keys `a`, `b`, `question`, `answer` and `response`, in a fixed order."""
    return [
        {"a": a, "b": b, "question": question(a, b), "answer": str(a + b), "response": response(a, b)}
        for a, b in _split_pairs(split)
    ]


def prompt_dataset(split, n=None):
    """A `datasets.Dataset` with a conversational `prompt` column (one user turn) and an `answer` column.

    `n` keeps the first `n` problems of the split (its order is fixed)."""
    rows = problems(split)
    if n is not None:
        rows = rows[:n]
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": row["question"]}] for row in rows],
            "answer": [row["answer"] for row in rows],
        }
    )
