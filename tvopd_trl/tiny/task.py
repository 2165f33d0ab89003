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
"""The embedded tasks: two-digit addition and subtraction, and three-digit addition worked out column by column, graded
on the last ``\\boxed{}`` of the response.

Three skills, each a fixed set of problems that a seeded permutation deals into four disjoint splits:

- ``"addition"`` (the default pair's task): ``"Compute a + b."`` with ``a, b`` in 10..99, 8,100 problems;
- ``"subtraction"`` (the multi-teacher family's second skill): ``"Compute a - b."`` with ``a, b`` in 10..99 and
  ``a > b``, 4,005 problems. Answers stay non-negative (1..89), so the reference response has the same shape as
  addition's and both skills share the default tokenizer unchanged;
- ``"long_addition"`` (the long-completion pair's task): ``"Compute a + b."`` with ``a, b`` in 100..999, 810,000
  problems, whose reference response works the sum out column by column (``2+3+0=5, 7+6+0=13, 4+8+1=13. The answer is
  \\boxed{1335}``, 45-49 tokens with the EOS; `max_new_tokens` gives each skill's generation budget).

The splits of each skill:

- ``"test"`` (500): the held-out evaluation split; no model is ever trained on it;
- ``"dev"`` (500): used only to pick the student checkpoint (see `build`);
- ``"opd"`` (addition 1,600, subtraction 1,000, long_addition 2,000): prompts of the on-policy distillation demo; no
  supervised training sees them;
- ``"sft"`` (the rest: addition 5,500, subtraction 2,005; long_addition 50,000 of the rest): the supervised training
  data of the teachers (a student is an earlier checkpoint of the same run).

The short skills' reference response is ``\\boxed{answer}`` and nothing else: the answer digits are the only tokens
that carry information, so teacher and student differ exactly there. The column traces add many routine tokens
around a few decisive ones, as reasoning traces do.
"""

import operator
import random
from collections.abc import Callable
from dataclasses import dataclass


SPLIT_SEED = 1234
SPLIT_SIZES = {"test": 500, "dev": 500, "opd": 1600}  # addition's; "sft" takes the rest
SPLITS = ("test", "dev", "opd", "sft")
SKILLS = ("addition", "subtraction")
MIX_SEED = 0


def _boxed(value):
    return f"\\boxed{{{value}}}"


def _column_trace(a, b):
    """Column addition from the units up, one ``digit+digit+carry=sum`` step per column, then the boxed sum."""
    steps, carry = [], 0
    for x, y in zip(str(a)[::-1], str(b)[::-1], strict=True):
        total = int(x) + int(y) + carry
        steps.append(f"{x}+{y}+{carry}={total}")
        carry = total // 10
    return f"{', '.join(steps)}. The answer is {_boxed(a + b)}"


@dataclass(frozen=True)
class _Skill:
    symbol: str
    compute: Callable[[int, int], int]
    allowed: Callable[[int, int], bool]  # which operand pairs are problems of the skill
    split_sizes: dict  # "sft", when present, caps the rest
    seed: int
    operands: range = range(10, 100)
    respond: Callable[[int, int], str] | None = None  # the reference response; `\boxed{answer}` by default
    max_new_tokens: int = 16  # a generation budget that holds every reference response and its EOS


_SKILLS = {
    "addition": _Skill("+", operator.add, lambda a, b: True, SPLIT_SIZES, SPLIT_SEED),
    # Half the problems of addition, so a smaller "opd" split leaves the teacher a comparable share (half) to learn from.
    "subtraction": _Skill("-", operator.sub, operator.gt, {"test": 500, "dev": 500, "opd": 1000}, SPLIT_SEED + 1),
    # 810,000 problems: 50,000 are plenty to learn the columns from, and encoding them all would take minutes.
    "long_addition": _Skill(
        "+",
        operator.add,
        lambda a, b: True,
        {"test": 500, "dev": 500, "opd": 2000, "sft": 50_000},
        SPLIT_SEED + 2,
        operands=range(100, 1000),
        respond=_column_trace,
        max_new_tokens=64,  # 45-49 tokens and the EOS
    ),
}


def _skill(name):
    if name not in _SKILLS:
        raise ValueError(f"Unknown skill {name!r}; choose one of {', '.join(_SKILLS)}.")
    return _SKILLS[name]


def _split_pairs(split, skill="addition"):
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; choose one of {SPLITS}.")
    spec = _skill(skill)
    pairs = [(a, b) for a in spec.operands for b in spec.operands if spec.allowed(a, b)]
    random.Random(spec.seed).shuffle(pairs)
    bounds, start = {}, 0
    for name in ("test", "dev", "opd"):
        bounds[name] = (start, start + spec.split_sizes[name])
        start += spec.split_sizes[name]
    bounds["sft"] = (start, len(pairs) if "sft" not in spec.split_sizes else start + spec.split_sizes["sft"])
    first, last = bounds[split]
    return pairs[first:last]


def symbol(skill="addition"):
    """The operator of `skill` as it appears in its questions (`"+"` or `"-"`)."""
    return _skill(skill).symbol


def max_new_tokens(skill="addition"):
    """The generation budget of `skill`'s responses: 16 tokens, or 64 for the column traces of `"long_addition"`."""
    return _skill(skill).max_new_tokens


def question(a, b, skill="addition"):
    return f"Compute {a} {symbol(skill)} {b}."


def response(a, b, skill="addition"):
    """The reference (teacher-training) response."""
    spec = _skill(skill)
    return _boxed(spec.compute(a, b)) if spec.respond is None else spec.respond(a, b)


def problems(split, skill="addition"):
    """The problems of `skill`'s `split` as dicts with keys `a`, `b`, `question`, `answer` and `response`, in a fixed
    order."""
    answer = _skill(skill).compute
    return [
        {
            "a": a,
            "b": b,
            "question": question(a, b, skill),
            "answer": str(answer(a, b)),
            "response": response(a, b, skill),
        }
        for a, b in _split_pairs(split, skill)
    ]


def _rows(split, n, skill):
    rows = problems(split, skill)
    return rows if n is None else rows[:n]


def _prompt_columns(rows):
    return {
        "prompt": [[{"role": "user", "content": row["question"]}] for row in rows],
        "answer": [row["answer"] for row in rows],
    }


def prompt_dataset(split, n=None, skill="addition"):
    """A `datasets.Dataset` with a conversational `prompt` column (one user turn) and an `answer` column.

    `n` keeps the first `n` problems of the split (its order is fixed)."""
    from datasets import Dataset

    return Dataset.from_dict(_prompt_columns(_rows(split, n, skill)))


def multi_skill_prompt_dataset(split, n=None, skills=SKILLS, seed=MIX_SEED):
    """The prompts of several skills, shuffled together with a fixed seed: `prompt_dataset`'s columns, plus `skill`
    and `teacher_id`, the name of the teacher that supervises the row (the multi-teacher family names each teacher
    after its skill, see `tvopd_trl.tiny.multi_teacher_paths`).

    `n` keeps the first `n` problems of each skill's split before the shuffle."""
    from datasets import Dataset

    rows = [(skill, row) for skill in skills for row in _rows(split, n, skill)]
    random.Random(seed).shuffle(rows)
    columns = _prompt_columns([row for _, row in rows])
    columns["skill"] = [skill for skill, _ in rows]
    columns["teacher_id"] = list(columns["skill"])
    return Dataset.from_dict(columns)
