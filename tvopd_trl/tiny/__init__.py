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
"""

import os

from .accuracy import evaluate_accuracy, tiny_benchmark
from .task import SPLITS, problems, prompt_dataset


CHECKPOINTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")


def teacher_path():
    """Directory of the shipped teacher (model and tokenizer), for `from_pretrained`."""
    return os.path.join(CHECKPOINTS_DIR, "teacher")


def student_path():
    """Directory of the shipped student (model and tokenizer), for `from_pretrained`."""
    return os.path.join(CHECKPOINTS_DIR, "student")


__all__ = [
    "CHECKPOINTS_DIR",
    "SPLITS",
    "evaluate_accuracy",
    "problems",
    "prompt_dataset",
    "student_path",
    "teacher_path",
    "tiny_benchmark",
]
