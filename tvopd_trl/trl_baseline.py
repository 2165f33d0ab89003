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
"""TRL's own `DistillationTrainer` on the main job's rollouts, the comparison the studies run (`trl_baseline`).

It trains with TRL's full-vocabulary divergence (the generalized JSD at `beta`; 1.0, the reverse KL, its default and
the only value `TVOPDConfig` accepts) on the student's own samples, with the job's batch, temperature, lengths and
optimizer: every `DistillationConfig` field is the job's. TRL's trainer scores the teacher on the student's prompt;
where the prompts carry a `teacher_prompt` (context distillation), `TeacherPromptDistillationTrainer` gives the teacher
that prompt in front of each completion instead, and leaves TRL's loss as it is.
"""

import dataclasses

import torch
from trl import DistillationConfig, DistillationTrainer

from .teachers import SINGLE_TEACHER, TEACHER_PROMPT_COLUMN, Teacher
from .trainer import TVOPDTrainer


class TeacherPromptDistillationTrainer(DistillationTrainer):
    """TRL's `DistillationTrainer`, whose teacher reads each completion after the row's `teacher_prompt` (chat
    messages, rendered as the student's prompts are) instead of after the student's prompt.

    `teachers`, `alignments` and `record_metric` are what `TVOPDTrainer` offers the main job's evaluation."""

    record_metric = TVOPDTrainer.record_metric

    def __init__(self, *args, teacher_prompts=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.teachers = {SINGLE_TEACHER: Teacher(SINGLE_TEACHER, model=self.teacher_model)}
        self.alignments = {}
        # The student's prompt ids, as TRL tokenizes them for generation -> the teacher's
        self.teacher_prompt_ids = {}
        if teacher_prompts:
            prompts, teacher = zip(*teacher_prompts, strict=True)
            keys, values = self._tokenize_prompts(list(prompts))[0], self._tokenize_prompts(list(teacher))[0]
            self.teacher_prompt_ids = {tuple(key): value for key, value in zip(keys, values, strict=True)}

    def _get_last_hidden_state(self, unwrapped_model, input_ids, attention_mask, logits_to_keep, **kwargs):
        if self.teacher_prompt_ids and unwrapped_model is self.accelerator.unwrap_model(self.teacher_model):
            input_ids, attention_mask = self.after_teacher_prompts(input_ids, attention_mask, logits_to_keep)
        return super()._get_last_hidden_state(unwrapped_model, input_ids, attention_mask, logits_to_keep, **kwargs)

    def after_teacher_prompts(self, input_ids, attention_mask, completion_length):
        """`input_ids` (left-padded prompts, then `completion_length` completion positions) with each prompt replaced
        by its teacher prompt, left-padded again, and the matching attention mask: the completions keep their place
        at the end, where TRL reads the teacher's distributions."""
        prompt_length = input_ids.size(1) - completion_length
        prompts = []
        for ids, mask in zip(input_ids[:, :prompt_length], attention_mask[:, :prompt_length], strict=True):
            key = tuple(ids[mask.bool()].tolist())
            if key not in self.teacher_prompt_ids:
                raise KeyError("A prompt without a teacher prompt: the trainer was built with another dataset.")
            prompts.append(self.teacher_prompt_ids[key])
        width = max(map(len, prompts))
        teacher_ids = input_ids.new_full((len(prompts), width), self.processing_class.pad_token_id)
        teacher_mask = attention_mask.new_zeros((len(prompts), width))
        for row, prompt in enumerate(prompts):
            teacher_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=input_ids.dtype)
            teacher_mask[row, width - len(prompt) :] = 1
        return (
            torch.cat([teacher_ids, input_ids[:, prompt_length:]], dim=1),
            torch.cat([teacher_mask, attention_mask[:, prompt_length:]], dim=1),
        )


def check_trl_baseline(training_args):
    """What TRL's trainer cannot run on the main job, refused before any model loads: a live self-teacher (its teacher
    is a frozen model), several or served teachers."""
    if training_args.self_distillation == "live":
        raise ValueError(
            "`trl_baseline` trains with TRL's DistillationTrainer, whose teacher is a frozen model: set "
            "`self_distillation: frozen`."
        )
    if (
        isinstance(training_args.teacher_model_name_or_path, dict)
        or training_args.teacher_model_server_url is not None
    ):
        raise ValueError("`trl_baseline` takes one local teacher: TRL's DistillationTrainer has no teacher server.")


def trl_baseline_trainer(student_path, teacher_path, training_args, train_dataset, tokenizer, **model_options):
    """TRL's `DistillationTrainer` (`TeacherPromptDistillationTrainer` where the dataset has a `teacher_prompt`
    column) on the job's student, teacher (the student's checkpoint for `self_distillation: frozen`), prompts and
    config."""
    config = DistillationConfig(
        **{
            field.name: getattr(training_args, field.name)
            for field in dataclasses.fields(DistillationConfig)
            if field.init
        }
    )
    if training_args.self_distillation == "frozen":  # loaded as the student is
        config.teacher_model_init_kwargs = training_args.model_init_kwargs
    pairs = ()
    if TEACHER_PROMPT_COLUMN in train_dataset.column_names:
        # A row without a teacher prompt of its own is scored after its prompt, as `TVOPDTrainer` scores it
        teacher_prompts = train_dataset[TEACHER_PROMPT_COLUMN]
        pairs = [(p, t or p) for p, t in zip(train_dataset["prompt"], teacher_prompts, strict=True)]
        train_dataset = train_dataset.remove_columns(TEACHER_PROMPT_COLUMN)
    return TeacherPromptDistillationTrainer(
        model=student_path,
        teacher_model=teacher_path or student_path,
        args=config,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        teacher_prompts=pairs,
        **model_options,
    )
