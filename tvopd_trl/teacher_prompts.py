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
"""What each teacher scores a completion after: its own rendering of the row's prompt.

A dataset row may carry a `teacher_prompt` beside its `prompt`: text or a conversation, like `prompt`, which the
teachers see instead of the student's prompt (privileged context: a reference solution, a hint, a system prompt the
deployed model will not have). The student samples after `prompt`; every teacher scores the same completion after
`teacher_prompt`, rendered as the student's prompt is (TRL's `_tokenize_prompts`: the training chat template, tools and
`chat_template_kwargs`), or, for a teacher with another tokenizer, by that tokenizer's own chat template. A missing,
`None` or empty `teacher_prompt`, or one that renders to the student's prompt, is the student's prompt
(docs/self-distillation.md).

[`teacher_prompt_batch`] renders them into the batch's `teacher_prompt_ids` / `teacher_prompt_mask`, which a teacher
with another tokenizer scores after too (`tvopd_trl.cross_tokenizer`); [`teacher_inputs`] gives a teacher of the
student's tokenizer its rows' inputs.
"""

import copy

import torch
from torch.nn.utils.rnn import pad_sequence
from trl import DistillationTrainer

from .prompts import is_message
from .teachers import TEACHER_PROMPT_COLUMN


def own_teacher_prompt(row):
    """The row's teacher prompt, or `None` where it has none (missing, `None`, empty text or conversation). Raises a
    `ValueError` naming the fix for a value that is neither text nor a conversation."""
    prompt = row.get(TEACHER_PROMPT_COLUMN)
    if prompt is None or (isinstance(prompt, (str, list)) and not prompt):
        return None
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(is_message(message) for message in prompt)):
        return prompt
    raise ValueError(
        f"The `{TEACHER_PROMPT_COLUMN}` column holds text or a conversation (a list of messages with 'role' and "
        f"'content'), like `prompt`, or nothing (the student's prompt); got {type(prompt).__name__} "
        f"{str(prompt)[:80]!r}. Map it to one of those."
    )


def check_teacher_prompts(dataset):
    """Every `teacher_prompt` of a map-style `dataset` (an iterable one is checked as its rows are drawn), before any
    model loads."""
    if TEACHER_PROMPT_COLUMN not in (getattr(dataset, "column_names", None) or ()) or not hasattr(dataset, "__len__"):
        return
    for index, prompt in enumerate(dataset[TEACHER_PROMPT_COLUMN]):
        try:
            own_teacher_prompt({TEACHER_PROMPT_COLUMN: prompt})
        except ValueError as error:
            raise ValueError(f"Row {index}: {error}") from None


def has_teacher_prompts(rows) -> bool:
    """Whether the dataset `rows` come from a dataset with a `teacher_prompt` column (every process's rows do alike)."""
    return any(TEACHER_PROMPT_COLUMN in row for row in rows)


def render_prompt_ids(tokenizer, prompt, **chat_template_kwargs) -> list[int]:
    """`prompt` rendered by `tokenizer` as TRL renders the student's: a conversation through its chat template with the
    generation prompt (which holds its BOS) and `chat_template_kwargs` (`tools` among them), text tokenized as it
    is."""
    if isinstance(prompt, str):
        return tokenizer(text=prompt)["input_ids"]
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **chat_template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def teacher_context(teacher, accelerator):
    """The context of `teacher` in tokens: a local model's `max_position_embeddings`, a server's `--max-model-len`;
    `None` where it gives none. Looked up once."""
    if teacher.context is None:
        if teacher.served:
            teacher.context = teacher.client.max_model_len() or 0
        else:
            config = accelerator.unwrap_model(teacher.model).config.get_text_config()
            teacher.context = getattr(config, "max_position_embeddings", None) or 0
    return teacher.context or None


def teacher_prompt_batch(trainer, rows, names, prompt_ids, prompt_mask) -> dict[str, torch.Tensor]:
    """
    `teacher_prompt_ids` / `teacher_prompt_mask` (`(B, P')`, left-padded, on the device of the student's `prompt_ids`
    / `prompt_mask`) of dataset `rows` whose teachers are `names`:
    - for a teacher with another tokenizer (`trainer.alignments`), the row's teacher prompt (or its prompt) rendered by
      that tokenizer with its own chat template, and the run's tools and `chat_template_kwargs`;
    - for a teacher of the student's tokenizer, its teacher prompt rendered exactly as TRL renders the student's
      prompts (the training chat template, tools and `chat_template_kwargs`): the teacher scores the student's ids;
      empty where the row has no teacher prompt, or one that renders to the student's prompt: the teacher then scores
      after the student's prompt itself (`teacher_inputs`).

    Raises a `ValueError` naming the fix for a teacher prompt that leaves the teacher's context no room for
    `max_completion_length` tokens.
    """
    ids = []
    for row, name, student, student_mask in zip(rows, names, prompt_ids, prompt_mask, strict=True):
        prompt = own_teacher_prompt(row)
        alignment = trainer.alignments.get(name)
        if alignment is not None:
            kwargs = {"tools": trainer.tools or None, **trainer.chat_template_kwargs}
            ids.append(alignment.teacher_prompt_ids(row["prompt"] if prompt is None else prompt, **kwargs))
        elif prompt is None:
            ids.append([])
        else:
            own = DistillationTrainer._tokenize_prompts(trainer, [copy.deepcopy(prompt)])[0][0]
            ids.append([] if own == student[student_mask.bool()].tolist() else list(own))
        context = teacher_context(trainer.teachers[name], trainer.accelerator)
        completion = trainer.args.max_completion_length
        if prompt is not None and context is not None and len(ids[-1]) + completion > context:
            raise ValueError(
                f"A teacher prompt of {len(ids[-1])} tokens leaves teacher {name!r}'s context of {context} tokens no "
                f"room for max_completion_length={completion} completion tokens: shorten that row's "
                f"`{TEACHER_PROMPT_COLUMN}`, or lower max_completion_length."
            )
    ids = [torch.tensor(row, dtype=torch.long) for row in ids]
    return {
        "teacher_prompt_ids": pad_sequence(ids, batch_first=True, padding_side="left").to(prompt_ids.device),
        "teacher_prompt_mask": pad_sequence(
            [torch.ones_like(row) for row in ids], batch_first=True, padding_side="left"
        ).to(prompt_ids.device),
    }


def teacher_inputs(batch, rows) -> dict[str, torch.Tensor]:
    """The inputs of a teacher of the student's tokenizer for `batch`'s `rows`: the student's completions after each
    row's teacher prompt where it has one (`teacher_prompt_batch`), after the student's prompt where not."""
    routed = {key: batch[key][rows] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    if "teacher_prompt_ids" not in batch or not batch["teacher_prompt_mask"][rows].any():
        return routed
    prompts = []
    for own, own_mask, student, student_mask in zip(
        batch["teacher_prompt_ids"][rows],
        batch["teacher_prompt_mask"][rows],
        routed["prompt_ids"],
        routed["prompt_mask"],
        strict=True,
    ):
        prompts.append(own[own_mask.bool()] if own_mask.any() else student[student_mask.bool()])
    routed["prompt_ids"] = pad_sequence(prompts, batch_first=True, padding_side="left")
    routed["prompt_mask"] = pad_sequence(
        [torch.ones_like(row) for row in prompts], batch_first=True, padding_side="left"
    )
    return routed
