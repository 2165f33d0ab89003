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
"""Tiny untrained Qwen2 models on the embedded task's tokenizer: for tests and smoke runs without the Hub."""

from .config import TVOPDConfig
from .tiny.build import build_model as _build_model
from .tiny.build import build_tokenizer  # noqa: F401  (trains the embedded task's tokenizer, a few seconds)


def build_model(tokenizer, seed, hidden_size=32, num_layers=2):
    """A randomly initialised Qwen2 model on `tokenizer`'s vocabulary."""
    return _build_model(tokenizer, hidden_size=hidden_size, num_layers=num_layers, num_heads=4, seed=seed)


def tiny_config(output_dir, **overrides):
    """A `TVOPDConfig` for fast single-process CPU runs of the tiny models; `overrides` win."""
    defaults = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        max_steps=3,
        max_completion_length=8,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    defaults.update(overrides)
    return TVOPDConfig(**defaults)


def tiny_pair_trainer(args, prompts=64, trainer_class=None, **kwargs):
    """A trainer (`TVOPDTrainer` or `trainer_class`) on the shipped tiny pair and the first `prompts` prompts of its
    OPD split; `kwargs` go to the trainer, and a `model`, `teacher_model`, `train_dataset` or `processing_class` among
    them replaces the shipped one."""
    from transformers import AutoTokenizer

    from .tiny import prompt_dataset, student_path, teacher_path
    from .trainer import TVOPDTrainer

    kwargs.setdefault("model", student_path())
    kwargs.setdefault("teacher_model", teacher_path())
    if "train_dataset" not in kwargs:
        kwargs["train_dataset"] = prompt_dataset("opd", prompts)
    if "processing_class" not in kwargs:
        kwargs["processing_class"] = AutoTokenizer.from_pretrained(student_path(), padding_side="left")
    return (trainer_class or TVOPDTrainer)(args=args, **kwargs)
