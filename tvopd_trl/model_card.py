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
"""The TV-OPD section of a model card: what trained the model, on what, and how the run ended.

TRL's model-card mechanism (`Trainer.create_model_card`) writes the card; [`TVOPDTrainer`] inserts this section into it.
"""

import math
import os

from .advantages import ADVANTAGE_MODE_REGISTRY
from .teachers import SINGLE_TEACHER


# A mode that takes c_k as an input is set by the scheduler's hyperparameters too
_SCHEDULER_HYPERPARAMETERS = ("tv_alpha", "tv_ema_decay", "tv_min_scale", "tv_eps")
_SHARED_HYPERPARAMETERS = (
    "learning_rate",
    "temperature",
    "max_completion_length",
    "epsilon",
    "epsilon_high",
    "num_iterations",
    "steps_per_generation",
)


# Listed when the run scored a task reward
_REWARD_HYPERPARAMETERS = ("reward_funcs", "reward_coef", "distillation_coef", "num_generations", "scale_rewards")


def card_section(args, log_history, teacher=None, dataset=None):
    """Markdown: the advantage mode and its hyperparameters, the teacher, the dataset, and the run's last values of
    `tv/scale`, `tv/estimate`, `reward` (with a task reward) and every `eval/...` metric in `log_history`."""
    mode = args.advantage_mode
    spec = ADVANTAGE_MODE_REGISTRY[mode]
    lines = ["## TV-OPD training", ""]
    lines.append(f"Trained with on-policy distillation, `advantage_mode={mode!r}` ({spec.paper}).")
    if teacher:
        lines.append(f"- Teacher: `{teacher}`")
    if dataset:
        lines.append(f"- Prompts: `{dataset}`")
    values = {name: getattr(args, name) for name in (_SCHEDULER_HYPERPARAMETERS if "scale" in spec.inputs else ())}
    # The mode's own hyperparameters that are set (an optional -inf floor left unset is not listed)
    values.update(
        {spec.label(keyword): value for keyword, value in spec.config_kwargs(args).items() if value is not None}
    )
    values.update({name: getattr(args, name) for name in _SHARED_HYPERPARAMETERS})
    if args.reward_funcs or args.reward_coef:
        values.update({name: getattr(args, name) for name in _REWARD_HYPERPARAMETERS})
    lines.append("- Hyperparameters: " + ", ".join(f"`{name}={value}`" for name, value in values.items()))
    last = {}
    for entry in log_history:
        for key, value in entry.items():
            if (key in ("tv/scale", "tv/estimate", "reward") or key.startswith("eval/")) and _is_number(value):
                last[key] = (entry.get("step"), value)
    if "step" in (log_history[-1] if log_history else {}):
        lines.append(f"- Optimizer steps: {log_history[-1]['step']}")
    if last:
        lines += ["", "| metric | last value | at step |", "| --- | ---: | ---: |"]
        lines += [f"| `{key}` | {value:.4g} | {step} |" for key, (step, value) in sorted(last.items())]
    return "\n".join(lines) + "\n"


def add_run_section(trainer, dataset_name):
    """Adds the run's section (`card_section`) to the card TRL wrote into `trainer.args.output_dir`."""
    args = trainer.args
    sources = {
        name: args.teacher_model_server_url
        if teacher.served and name == SINGLE_TEACHER
        else args.teacher_model_server_url[name]
        if teacher.served
        else trainer.accelerator.unwrap_model(teacher.model).config._name_or_path
        for name, teacher in trainer.teachers.items()
    }
    teacher = sources[SINGLE_TEACHER] if len(sources) == 1 and SINGLE_TEACHER in sources else sources
    if args.self_distillation is not None:
        teacher = f"the student itself (self_distillation={args.self_distillation!r})"
    section = card_section(args, trainer.state.log_history, teacher=teacher, dataset=dataset_name)
    add_section(os.path.join(args.output_dir, "README.md"), section)


def add_section(path, section):
    """Inserts `section` into the card at `path` (see `insert_section`)."""
    with open(path, encoding="utf-8") as f:
        card = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(insert_section(card, section))


def insert_section(card_text, section):
    """`card_text` with `section` before its "### Framework versions" heading (at the end if there is none)."""
    marker = "### Framework versions"
    if marker in card_text:
        return card_text.replace(marker, section + "\n" + marker, 1)
    return card_text.rstrip("\n") + "\n\n" + section


def _is_number(value):
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
