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
"""The embedded hint task: two-digit addition whose prompt may show the answer, privileged context that the model
will not have when it is deployed.

The problems are the default pair's (`task`'s ``"addition"`` skill, its splits and its reference responses). A hinted
prompt is the same conversation after a system turn that gives the answer away::

    <|im_start|>system\\nHint: the answer is 133.<|im_end|>\\n<|im_start|>user\\nCompute 47 + 86.<|im_end|>\\n
    <|im_start|>assistant\\n\\boxed{133}<|im_end|>

Copying the hint is learned long before adding the operands, so a checkpoint of a run on partly hinted data solves
nearly every hinted problem and few bare ones: the hint family's student (`tvopd_trl.tiny.hint_student_path`), which
teaches itself without the hint by on-policy self-distillation (`self_distillation`, the hinted prompt as each row's
`teacher_prompt`; ``recipes/tiny/self_distill.yaml``).

`prompt_dataset` gives both prompts of a split (``prompt``, bare; ``teacher_prompt``, hinted); the bare held-out split
is the default pair's benchmark (``tiny``), the hinted one `tiny_hinted_benchmark` (``tiny-hinted``).
"""

import dataclasses

from ..eval import Benchmark, Problem
from .task import problems


HINT = "Hint: the answer is {answer}."
SKILL = "addition"  # the problems' skill in `task`
HINTED_BENCHMARK = "tiny-hinted"  # the hinted held-out split's name; the bare one is `tiny`


def hint_turn(answer):
    """The system turn that gives `answer` away."""
    return {"role": "system", "content": HINT.format(answer=answer)}


def conversation(question, answer, hinted):
    """The prompt of a problem: its question as one user turn, after the hint's system turn if `hinted`."""
    turns = [{"role": "user", "content": question}]
    return [hint_turn(answer), *turns] if hinted else turns


def prompt_dataset(split, n=None):
    """A `datasets.Dataset` of `split`'s problems (the first `n`, in the split's fixed order) with the bare `prompt`
    (one user turn, as `tvopd_trl.tiny.prompt_dataset`'s), the hinted `teacher_prompt` (the same conversation after the
    hint's system turn) and the `answer`: the self-distillation prompts, where the student samples after `prompt` and
    scores its completion as the teacher after `teacher_prompt`."""
    from datasets import Dataset

    rows = problems(split, SKILL)
    rows = rows if n is None else rows[:n]
    return Dataset.from_dict(
        {
            "prompt": [conversation(row["question"], row["answer"], hinted=False) for row in rows],
            "teacher_prompt": [conversation(row["question"], row["answer"], hinted=True) for row in rows],
            "answer": [row["answer"] for row in rows],
        }
    )


@dataclasses.dataclass(frozen=True)
class HintedBenchmark(Benchmark):
    """A benchmark whose every prompt shows its problem's answer as a hint (`hint_turn`) before the user turn."""

    def prompt(self, problem, template=None):
        return [hint_turn(problem.answer), *super().prompt(problem, template)]


def tiny_hinted_benchmark(split="test"):
    """The hint task's `split` with the hint shown, as a benchmark: ``tiny-hinted`` (``tiny-hinted-<split>`` for
    another split than the held-out ``"test"``). Without the hint, the split is the default pair's (``tiny``)."""

    def load():
        return [Problem(f"{p['a']}+{p['b']}", p["question"], p["answer"]) for p in problems(split, SKILL)]

    name = HINTED_BENCHMARK if split == "test" else f"{HINTED_BENCHMARK}-{split}"
    # The tiny models were trained on the bare question, so its prompt carries no instruction.
    return HintedBenchmark(name, name.capitalize(), prompt_template="{problem}", loader=load)


def evaluate_accuracy(model, tokenizer, split="test", hinted=True, k=4, greedy=False, seed=0, batch_size=512):
    """mean@k on `split` at the paper's sampling settings (T=0.6, top-p 0.95, top-k 20), or greedy accuracy, with the
    hint shown (`hinted`) or not (then `tvopd_trl.tiny.evaluate_accuracy`'s addition)."""
    from ..eval import SamplingSettings, TransformersGenerator, evaluate, mean_at_k
    from .accuracy import tiny_benchmark
    from .task import max_new_tokens

    budget = max_new_tokens(SKILL)
    if greedy:
        settings = SamplingSettings(k=1, temperature=0, max_new_tokens=budget)
    else:
        settings = SamplingSettings(k=k, max_new_tokens=budget, seed=seed)
    benchmark = tiny_hinted_benchmark(split) if hinted else tiny_benchmark(split, SKILL)
    results = evaluate(TransformersGenerator(model, tokenizer, batch_size), [benchmark], settings)
    return mean_at_k(results["benchmarks"][benchmark.name])
