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
"""The embedded default teacher/student pair: a CPU-sized on-policy distillation demo that ships with the package.

Two-digit addition (``"Compute 47 + 86."`` -> ``\\boxed{133}``), a Qwen2-style byte-level BPE tokenizer with one token
per digit, and two Qwen2 checkpoints (hidden 64, 2 layers, 0.6 MB each) of one supervised training run
(``tvopd_trl.tiny.build``): the final model is the teacher, and a checkpoint taken just before the run's sharp accuracy
transition is the student. Held-out accuracy (k=4 samples at temperature 0.6, top-p 0.95, top-k 20): teacher 1.00,
student 0.33. The main job distills the student on CPU (``tvopd-trl train --config recipes/tiny/tvopd.yaml``: 300
TV-OPD steps, about 100 s of training) and closes most of that gap; ``python -m tvopd_trl.tiny.build`` rebuilds the
pair (about 4 minutes, bit-identical).

```python
>>> from transformers import AutoModelForCausalLM, AutoTokenizer
>>> from tvopd_trl.tiny import evaluate_accuracy, student_path, teacher_path

>>> tokenizer = AutoTokenizer.from_pretrained(student_path())
>>> student = AutoModelForCausalLM.from_pretrained(student_path())
>>> evaluate_accuracy(student, tokenizer, "test")  # mean@4 at temperature 0.6, top-p 0.95, top-k 20
```

The weak teacher (``checkpoints/weak_teacher``, ``weak_teacher_path()``) is an imperfect teacher of the same task,
tokenizer and architecture: a checkpoint of the seeded build taken in its accuracy transition, that solves 65% of the
held-out split (k=4: 0.649; greedy 0.722). ``embedded_teacher: weak`` distills the student from it (with ``embedded_task: addition``);
``python -m tvopd_trl.tiny.build`` rebuilds it beside the pair.

The multi-teacher family (``checkpoints/multi_teacher``) adds a second skill, two-digit subtraction
(``"Compute 86 - 47."`` -> ``\\boxed{39}``, ``a > b``), with the same tokenizer: a student weak at both skills and
one teacher per skill that masters only its own, named by its skill (the `teacher_id` of the rows it supervises).
Held-out accuracy (k=4, as above) on addition / subtraction: student 0.25 / 0.20, teacher ``"addition"`` 1.00 / 0.01,
teacher ``"subtraction"`` 0.00 / 1.00. The student is a checkpoint of one run trained on both skills (45% / 55% of
every batch), taken just before both skills' accuracy transitions.
``python -m tvopd_trl.tiny.build --family multi-teacher`` rebuilds it (about 3 minutes, bit-identical; the default pair
is unchanged).

```python
>>> from tvopd_trl.tiny import multi_skill_prompt_dataset, multi_teacher_paths

>>> paths = multi_teacher_paths()  # {"student": ..., "teachers": {"addition": ..., "subtraction": ...}}
>>> prompts = multi_skill_prompt_dataset("opd")  # columns prompt, answer, skill, teacher_id; both skills shuffled
>>> student = AutoModelForCausalLM.from_pretrained(paths["student"])
>>> evaluate_accuracy(student, tokenizer, "test", skill="subtraction")
```

The long-completion pair (``checkpoints/long_addition``, ``long_addition_paths()``) has the same tokenizer and
architecture with 128 positions, on a skill whose responses are reasoning-trace-like: three-digit addition worked out
column by column (``"Compute 472 + 863."`` -> ``2+3+0=5, 7+6+0=13, 4+8+1=13. The answer is \\boxed{1335}``, 45-49
tokens with the EOS, where a few digit tokens decide the answer among many routine ones). Held-out accuracy (k=4):
teacher 1.00, student 0.20. ``embedded_task: long_addition`` trains on it (``recipes/tiny/long_*.yaml``; benchmark
``tiny-long-addition``); ``python -m tvopd_trl.tiny.build --family long-addition`` rebuilds it (about 4.5 minutes).

The vLLM-ready pair (``checkpoints/vllm``, ``vllm_paths()``) is the default pair's task, tokenizer and recipe with 2
attention heads of 32 instead of 4 of 16: vLLM's CPU attention has kernels for heads of 32 and more only. Held-out
accuracy (k=4): teacher 1.00, student 0.31. ``embedded_task: addition_vllm`` trains on it (``recipes/tiny/vllm_*.yaml``);
``python -m tvopd_trl.tiny.build --family vllm`` rebuilds it (about 3 minutes, bit-identical).

The cross-tokenizer teachers (``checkpoints/cross_tokenizer``, ``cross_tokenizer_paths()``) are teachers of the
default pair's task for its student from another model family, each with a tokenizer of its own: Llama models (hidden
64, 2 layers, 2 heads of 32, so that vLLM's CPU build serves them too) with Llama-3-like byte-level BPE tokenizers
(``<|begin_of_text|>`` BOS rendered by the chat template, ``<|start_header_id|>role<|end_header_id|>`` turns ended by
``<|eot_id|>``, the EOS; no normalizer), trained on other text than the student's, so that words, spaces and
punctuation are cut otherwise (``" The answer"``: ``ĠThe``, ``Ġanswer`` against the student's ``Ġ``, ``The``, ``Ġ``,
``an``, ``sw``, ``er``). ``"digits"`` (400 ids) cuts numbers into digits as the student does: held-out k=4 1.00
(1,500 steps, about 3 minutes on one core). ``"triplets"`` (600 ids) cuts them into groups of up to three digits, as
Llama 3 does: every operand and every answer is one token (``133``; ``1234`` is ``123``, ``4``), one that covers the
student's two or three answer digits, so it has each sum to learn as a whole: held-out k=4 0.98 (greedy 0.99) after
7,000 steps (about 13 minutes on one core). ``python -m tvopd_trl.tiny.build --family cross-tokenizer`` rebuilds both.

The tool-using pair (``checkpoints/tools``, ``tools_paths()``) does four-digit addition with a Python tool, ``add``
(``tvopd_trl.tiny.tool_task``): the teacher calls ``add`` with the question's operands, reads the result and boxes it;
the student, an earlier checkpoint of its run, copies operands wrongly, boxes another number than the result, or
writes a call that does not parse. Their chat template renders tool calls (``<tool_call>{"name": "add", "arguments":
...}</tool_call>``) and ``tool`` turns, and their tokenizers carry the response template TRL's tool loop parses the
calls with; 2 heads of 32 and 128 positions, for vLLM. Held-out accuracy with the tool (k=4 / greedy): teacher 1.00 /
1.00, student 0.33 / 0.59. Train with ``tools=[add]`` on ``tool_prompt_dataset("opd")`` (columns ``prompt`` and
``solution``); ``python -m tvopd_trl.tiny.build --family tools`` rebuilds the pair (about 4.5 minutes, bit-identical).

The hint family (``checkpoints/hint``, ``hint_student_path()``) is one model: a student of the default pair's task,
with its tokenizer and architecture, trained on prompts that sometimes show the answer (``tvopd_trl.tiny.hint_task``:
a system turn ``"Hint: the answer is 133."`` before the question, in three quarters of every batch), and taken after
it learned to copy the hint, before it learned to add. Held-out accuracy (k=4 / greedy): with the hint 0.99 / 0.99
(``tiny-hinted``), without it 0.25 / 0.30 (``tiny``). It teaches itself without the hint by on-policy
self-distillation, each row's hinted prompt as its ``teacher_prompt`` (``embedded_task: hint`` with
``self_distillation``, ``recipes/tiny/self_distill.yaml``); ``python -m tvopd_trl.tiny.build --family hint`` rebuilds
it (about 3 minutes, bit-identical).

```python
>>> from tvopd_trl.tiny import hint_student_path
>>> from tvopd_trl.tiny.hint_task import evaluate_accuracy as hinted_accuracy, prompt_dataset as hint_prompts

>>> prompts = hint_prompts("opd")  # columns prompt (bare), teacher_prompt (hinted), answer
>>> student = AutoModelForCausalLM.from_pretrained(hint_student_path())
>>> hinted_accuracy(student, tokenizer, "test", hinted=True)  # mean@4 with the hint shown
```
"""

import os

from .accuracy import evaluate_accuracy, tiny_benchmark
from .task import SKILLS, SPLITS, multi_skill_prompt_dataset, problems, prompt_dataset
from .tool_task import prompt_dataset as tool_prompt_dataset


CHECKPOINTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")
MULTI_TEACHER_DIR = os.path.join(CHECKPOINTS_DIR, "multi_teacher")
LONG_ADDITION_DIR = os.path.join(CHECKPOINTS_DIR, "long_addition")
VLLM_DIR = os.path.join(CHECKPOINTS_DIR, "vllm")
CROSS_TOKENIZER_DIR = os.path.join(CHECKPOINTS_DIR, "cross_tokenizer")
TOOLS_DIR = os.path.join(CHECKPOINTS_DIR, "tools")
HINT_DIR = os.path.join(CHECKPOINTS_DIR, "hint")


def teacher_path():
    """Directory of the shipped teacher (model and tokenizer), for `from_pretrained`."""
    return os.path.join(CHECKPOINTS_DIR, "teacher")


def student_path():
    """Directory of the shipped student (model and tokenizer), for `from_pretrained`."""
    return os.path.join(CHECKPOINTS_DIR, "student")


def weak_teacher_path():
    """Directory of the shipped weak teacher: an imperfect teacher of the default pair's task, a checkpoint of the
    seeded build taken in its accuracy transition, that solves 60-75% of the held-out split."""
    return os.path.join(CHECKPOINTS_DIR, "weak_teacher")


def multi_teacher_paths():
    """Directories of the shipped multi-teacher family: `{"student": path, "teachers": {teacher_id: path}}`, one
    teacher per skill of `SKILLS`, keyed like TRL's `teacher_server_urls` (by the `teacher_id` of its rows)."""
    return {
        "student": os.path.join(MULTI_TEACHER_DIR, "student"),
        "teachers": {skill: os.path.join(MULTI_TEACHER_DIR, skill) for skill in SKILLS},
    }


def long_addition_paths():
    """Directories of the shipped long-completion pair: `{"student": path, "teacher": path}`."""
    return {member: os.path.join(LONG_ADDITION_DIR, member) for member in ("student", "teacher")}


def vllm_paths():
    """Directories of the shipped vLLM-ready pair (the default pair's task with 2 attention heads of 32, which vLLM's
    CPU attention serves): `{"student": path, "teacher": path}`."""
    return {member: os.path.join(VLLM_DIR, member) for member in ("student", "teacher")}


def cross_tokenizer_paths():
    """Directories of the shipped cross-tokenizer teachers of the default student (`student_path()`), Llama models
    with Llama-3-like tokenizers of their own, named by how they cut numbers: `{"digits": path, "triplets": path}`
    (into digits, as the student does, or into groups of up to three digits, as Llama 3 does)."""
    return {teacher: os.path.join(CROSS_TOKENIZER_DIR, teacher) for teacher in ("digits", "triplets")}


def tools_paths():
    """Directories of the shipped tool-using pair (four-digit addition with an `add` tool, `tool_task`; heads of 32,
    for vLLM's CPU attention; tokenizers that carry the response template of their tool calls):
    `{"student": path, "teacher": path}`."""
    return {member: os.path.join(TOOLS_DIR, member) for member in ("student", "teacher")}


def hint_student_path():
    """Directory of the shipped hint family's one model (`hint_task`): a student of the default pair's task that solves
    it when its prompt shows the answer as a hint and seldom otherwise, its own teacher with the hint."""
    return os.path.join(HINT_DIR, "student")


__all__ = [
    "CHECKPOINTS_DIR",
    "CROSS_TOKENIZER_DIR",
    "LONG_ADDITION_DIR",
    "MULTI_TEACHER_DIR",
    "SKILLS",
    "SPLITS",
    "cross_tokenizer_paths",
    "evaluate_accuracy",
    "HINT_DIR",
    "hint_student_path",
    "long_addition_paths",
    "multi_skill_prompt_dataset",
    "multi_teacher_paths",
    "problems",
    "prompt_dataset",
    "student_path",
    "teacher_path",
    "tiny_benchmark",
    "tool_prompt_dataset",
    "TOOLS_DIR",
    "tools_paths",
    "VLLM_DIR",
    "vllm_paths",
    "weak_teacher_path",
]
