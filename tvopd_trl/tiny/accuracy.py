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
"""The embedded tasks as benchmarks of the evaluation module, and a model's accuracy on a split of one."""

from ..eval import Benchmark, Problem, evaluate, mean_at_k
from .task import max_new_tokens as skill_max_new_tokens
from .task import problems, symbol


def tiny_benchmark(split="test", skill="addition"):
    """The embedded tiny task's `split` of `skill` as a benchmark (addition's held-out `"test"` split is registered as
    `"tiny"`; the others are named `tiny[-<skill>][-split]`, e.g. `tiny-subtraction`, `tiny-long-addition-dev`)."""

    def load():
        return [
            Problem(f"{p['a']}{symbol(skill)}{p['b']}", p["question"], p["answer"]) for p in problems(split, skill)
        ]

    # The tiny models were trained on the bare question, so its prompt carries no instruction.
    name = "tiny" if skill == "addition" else f"tiny-{skill.replace('_', '-')}"
    if split != "test":
        name += f"-{split}"
    return Benchmark(name, name.capitalize(), prompt_template="{problem}", loader=load)


def evaluate_accuracy(
    model, tokenizer, split="test", k=4, greedy=False, seed=0, max_new_tokens=None, batch_size=512, skill="addition"
):
    """mean@k on `skill`'s `split` at the paper's sampling settings (T=0.6, top-p 0.95, top-k 20), or greedy
    accuracy. `max_new_tokens` defaults to the skill's budget (`task.max_new_tokens`)."""
    from ..eval import SamplingSettings, TransformersGenerator

    max_new_tokens = max_new_tokens or skill_max_new_tokens(skill)
    if greedy:
        settings = SamplingSettings(k=1, temperature=0, max_new_tokens=max_new_tokens)
    else:
        settings = SamplingSettings(k=k, max_new_tokens=max_new_tokens, seed=seed)
    benchmark = tiny_benchmark(split, skill)
    results = evaluate(TransformersGenerator(model, tokenizer, batch_size), [benchmark], settings)
    return mean_at_k(results["benchmarks"][benchmark.name])


def tiny_subtraction_benchmark():
    """The subtraction skill's held-out split, registered as `"tiny-subtraction"` (the multi-teacher family's)."""
    return tiny_benchmark("test", "subtraction")


def tiny_long_addition_benchmark():
    """The long-completion skill's held-out split, registered as `"tiny-long-addition"`: three-digit addition worked
    out column by column (`tvopd_trl.tiny.task`); generate with `max_new_tokens` 64."""
    return tiny_benchmark("test", "long_addition")
