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
"""Several teachers by name, each prompt routed to its own by the dataset's `teacher_id` column.

A run's teachers are `{name: source}`: a local model, path or Hub id from `teacher_model`, or a server URL from
`teacher_model_server_url`, either of which may be a mapping. The local teachers come first, then the served ones, in
the order given; a row's `teacher_index` counts in that order. A single teacher, given as today, is named
`SINGLE_TEACHER` and needs no column.
"""

import contextlib
import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils.dataclasses import get_module_class_from_name
from transformers import PreTrainedModel
from transformers.utils import logging
from trl.models import prepare_deepspeed, prepare_fsdp
from trl.trainer import add_fused_lm_head
from trl.trainer.utils import create_model_from_path


logger = logging.get_logger(__name__)

TEACHER_ID_COLUMN = "teacher_id"  # the column TRL's asynchronous distillation trainer routes by
TEACHER_PROMPT_COLUMN = "teacher_prompt"  # what the teachers score a completion after (`tvopd_trl.teacher_prompts`)
SINGLE_TEACHER = "teacher"


@dataclass
class Teacher:
    """One teacher of a run: a prepared local `model`, or as `client` the `TeacherServerPool` of its server's replicas
    (the other is `None`). `live`: the model is the student itself, scored with its current weights
    (`self_distillation="live"`). `context`: its context in tokens, once looked up (`teacher_prompts.teacher_context`)."""

    name: str
    model: Any = None
    client: Any = None
    live: bool = False
    context: int | None = None

    @contextlib.contextmanager
    def scoring(self):
        """The model in eval mode, so that dropout never makes a score a random draw; the live student goes back to
        its own mode afterwards."""
        training = self.model.training
        self.model.eval()
        try:
            yield self.model
        finally:
            if self.live:
                self.model.train(training)

    @property
    def served(self) -> bool:
        return self.client is not None


def teacher_sources(teacher_model, server_url) -> tuple[dict[str, Any], dict[str, str | list[str]]]:
    """`(local, served)`: `{name: model or path}` and `{name: URL or list of replica URLs}`, from the trainer's
    `teacher_model` and the config's `teacher_model_server_url`. Raises a `ValueError` naming the fix for an empty
    teacher or replica, a name given twice, or a mapping beside an unnamed teacher."""
    named = isinstance(teacher_model, Mapping) or isinstance(server_url, Mapping)
    if named and not (teacher_model is None or isinstance(teacher_model, Mapping)):
        raise ValueError("With several teachers, `teacher_model` is a mapping {name: model or path} too.")
    if named and not (server_url is None or isinstance(server_url, Mapping)):
        raise ValueError(
            "With several teachers, `teacher_model_server_url` is a mapping {name: URL or list of replica URLs} too."
        )
    if not named:
        local = {} if teacher_model is None else {SINGLE_TEACHER: teacher_model}
        served = {} if server_url is None else {SINGLE_TEACHER: server_url}
    else:
        local, served = dict(teacher_model or {}), dict(server_url or {})
        both = sorted(set(local) & set(served))
        if both:
            raise ValueError(f"Teacher {both[0]!r} is both a local model and a server: name each teacher once.")
        for name, source in {**local, **served}.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"Teacher names are non-empty strings, got {name!r}.")
            if source is None or (isinstance(source, str) and not source.strip()):
                raise ValueError(
                    f"Teacher {name!r} is empty: give it a model, a local path, a Hub id or a server URL."
                )
    for name, urls in served.items():
        if not isinstance(urls, str) and not (urls and all(isinstance(url, str) and url.strip() for url in urls)):
            raise ValueError(
                f"The server replicas of teacher {name!r} are {urls!r}: give a URL or a non-empty list of URLs."
            )
    return local, served


def teacher_processing_classes(teacher_processing_class, names) -> dict[str, Any]:
    """`{name: tokenizer or None}` from the trainer's `teacher_processing_class`: one tokenizer for every teacher
    (teachers of one family share theirs), or a mapping by teacher name."""
    if isinstance(teacher_processing_class, Mapping):
        unknown = sorted(set(teacher_processing_class) - set(names))
        if unknown:
            raise ValueError(f"`teacher_processing_class` names unknown teachers {unknown}; the teachers are {names}.")
        return {name: teacher_processing_class.get(name) for name in names}
    return dict.fromkeys(names, teacher_processing_class)


def check_routing(dataset, names, every_teacher=True) -> None:
    """With several teachers, every prompt of `dataset` names one of them in `teacher_id`; with `every_teacher` (the
    training set), a teacher no prompt names is an error too (its scale would never move). An iterable dataset is
    checked as its rows are drawn."""
    if len(names) < 2 or dataset is None:
        return
    columns = getattr(dataset, "column_names", None)
    if columns is not None and TEACHER_ID_COLUMN not in columns:
        raise ValueError(
            f"With several teachers ({', '.join(names)}), each prompt names its teacher in a `{TEACHER_ID_COLUMN}` "
            f"column, which the training dataset lacks (its columns: {', '.join(columns)})."
        )
    if not hasattr(dataset, "unique"):
        return
    used = set(dataset.unique(TEACHER_ID_COLUMN))
    unknown = sorted(map(str, used - set(names)))
    if unknown:
        raise ValueError(
            f"Prompts name unknown teachers {unknown} in `{TEACHER_ID_COLUMN}`; the teachers are {names}."
        )
    unused = [name for name in names if name not in used]
    if unused and every_teacher:
        raise ValueError(
            f"No prompt names teacher {unused[0]!r} in `{TEACHER_ID_COLUMN}`: drop it, or route prompts to it."
        )


def teacher_index(rows, names, device) -> torch.Tensor:
    """The `(B,)` position in `names` of each dataset row's teacher (all 0 for a single teacher)."""
    if len(names) == 1:
        return torch.zeros(len(rows), dtype=torch.long, device=device)
    try:
        return torch.tensor([names.index(row[TEACHER_ID_COLUMN]) for row in rows], dtype=torch.long, device=device)
    except (KeyError, ValueError):
        found = sorted({str(row.get(TEACHER_ID_COLUMN)) for row in rows} - set(names))
        raise ValueError(
            f"A prompt names teacher {found} in `{TEACHER_ID_COLUMN}`; the teachers are {names}."
        ) from None


# `self_teacher`'s source for `self_distillation="live"`: the student itself, not a model to load
LIVE_STUDENT = object()


def self_teacher(args, model, teacher_model):
    """The trainer's `teacher_model`, or with `args.self_distillation` the student's own weights as its teacher:
    `LIVE_STUDENT` for `"live"`, for `"frozen"` the student's path (loaded again) or a copy of the student model as
    it is before training. Raises a `ValueError` naming the fix when a teacher is given beside it."""
    if args.self_distillation is None:
        return teacher_model
    if teacher_model is not None or args.teacher_model_server_url is not None:
        raise ValueError(
            f"self_distillation={args.self_distillation!r} makes the student its own teacher: pass no `teacher_model` "
            "and no `teacher_model_server_url`, or set self_distillation=None to distil from them."
        )
    if args.self_distillation == "live":
        return LIVE_STUDENT
    return model if isinstance(model, str) else copy.deepcopy(model)


def local_teachers_of(trainer, sources, tokenizers) -> dict[str, Teacher]:
    """`{name: Teacher}` of the local teacher `sources` (`teacher_sources`), prepared (`prepare_teacher`); the live
    student (`LIVE_STUDENT`) is the trainer's own model. With `self_distillation`, the teacher's tokenizer in
    `tokenizers` is the student's."""
    teachers = {}
    for name, source in sources.items():
        if trainer.args.self_distillation is not None:
            tokenizers[name] = trainer._tokenizer
        if source is LIVE_STUDENT:
            teachers[name] = Teacher(name, model=trainer.model, live=True)
            continue
        # A teacher of another tokenizer scores its own ids: its output layer covers its own tokenizer
        vocabulary = (trainer.args.cross_tokenizer and tokenizers[name]) or trainer._tokenizer
        teachers[name] = Teacher(name, model=prepare_teacher(trainer, name, source, vocabulary))
    return teachers


def prepare_teacher(trainer, name: str, teacher: str | PreTrainedModel, vocabulary=None):
    """A local teacher of `trainer`, ready to score: a path or Hub id loaded and a model placed as TRL's
    `DistillationTrainer` does its one teacher, sharded under FSDP, in eval mode, with the fused float32 LM head.

    Unlike TRL, its output layer may have another size than the student's (padded rows of one model family): the
    tokenizers were compared before, and its head must cover every token of `vocabulary`, the tokenizer whose ids it
    scores (the student's by default; its own with another tokenizer)."""
    args, accelerator = trainer.args, trainer.accelerator
    if isinstance(teacher, str):
        if args.self_distillation == "frozen":
            # The student's checkpoint again, loaded exactly as TRL loaded the student: its dtype, attention,
            # revision and quantization, so that the frozen teacher is the student at step 0
            kwargs = dict(args.model_init_kwargs or {})
            if trainer.student_quantization_config is not None:
                kwargs["quantization_config"] = trainer.student_quantization_config
        else:
            kwargs = dict(args.teacher_model_init_kwargs or {})
            dtype = kwargs.get("dtype")
            kwargs["dtype"] = dtype if dtype in ("auto", None) else getattr(torch, dtype)
            if args.teacher_model_revision is not None:
                kwargs.setdefault("revision", args.teacher_model_revision)
        if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
            kwargs["device_map"] = None  # as TRL: "auto" fails under distributed training
        kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        teacher = create_model_from_path(teacher, **kwargs)
    elif args.teacher_model_init_kwargs is not None:
        raise ValueError(
            "You passed teacher_model_init_kwargs to the config, but the teacher is already instantiated: load it "
            "with those arguments yourself, or pass its path."
        )
    rows, tokens = teacher.config.get_text_config().vocab_size, len(vocabulary or trainer._tokenizer)
    if rows < tokens:
        raise ValueError(
            f"Teacher {name!r} has {rows} output rows, fewer than the tokenizer's {tokens} tokens: it cannot score "
            "every token the student may sample. Use a checkpoint whose output layer covers the tokenizer."
        )
    if trainer.is_deepspeed_enabled:
        teacher = prepare_deepspeed(teacher, accelerator)
    elif trainer.is_fsdp_enabled:
        # TRL's base trainer leaves the teacher whole (and unplaced) under FSDP. Sharding places it.
        teacher = accelerator.prepare_model(
            shard_teacher(teacher, accelerator), device_placement=False, evaluation_mode=True
        )
    else:
        teacher = accelerator.prepare_model(teacher, evaluation_mode=True)
    # A teacher passed as an object may be in train mode: its dropout would make every score a random draw
    teacher.eval()
    add_fused_lm_head(accelerator.unwrap_model(teacher), temperature=trainer.temperature, cast_lm_head_to_fp32=True)
    return teacher


def shard_teacher(teacher, accelerator):
    """`teacher` sharded under FSDP, from wherever it was loaded. Under FSDP2 each decoder layer (the model's
    `_no_split_modules`) is a unit of its own before the root is, as accelerate's auto-wrap does for the student:
    `fully_shard` moves one unit at a time to the device, and a forward gathers one layer at a time beside the root's
    own parameters, never the whole teacher. Under FSDP1, TRL's `prepare_fsdp` wraps it by the run's auto-wrap policy."""
    if accelerator.state.fsdp_plugin.fsdp_version == 2:
        from accelerate.utils import get_module_children_bottom_up  # accelerate >= 1.6; FSDP2 needs 1.7 anyway

        names = getattr(teacher, "_no_split_modules", None) or []
        layers = tuple(filter(None, (get_module_class_from_name(teacher, name) for name in names)))
        if not layers:
            logger.warning(
                f"The teacher ({type(teacher).__name__}) names no decoder layer class in `_no_split_modules`: under "
                "FSDP2 it is one unit, gathered whole on every process at each forward."
            )
        # Bottom-up, as a unit must be sharded before any unit around it
        for module in get_module_children_bottom_up(teacher)[:-1]:
            if isinstance(module, layers):
                prepare_fsdp(module, accelerator)
    return prepare_fsdp(teacher, accelerator)
