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
"""The main job as a library: its arguments, the student, teacher and prompts it loads, the accuracy it measures, and
the checks it makes before any model loads.

`tvopd_trl.scripts.train` runs the job (`tvopd-trl train`); `tvopd-trl doctor` and `tvopd_trl.study` load what it
would load, from the same recipe.
"""

import contextlib
import io
import os
import sys
from dataclasses import dataclass, field

from transformers import AutoTokenizer
from trl import ModelConfig, TrlParser

from .console import OneLineErrors
from .eval import SamplingSettings, evaluate, get_benchmark, load_problems, local_generator, mean_at_k
from .eval.generation import PAPER_TEMPERATURE, PAPER_TOP_K, PAPER_TOP_P
from .packaged_recipes import find_recipe


# The embedded defaults a job runs without a model, teacher or dataset of its own (`embedded_task`)
EMBEDDED_TASKS = (
    "addition", "multi_teacher", "long_addition", "addition_vllm", "tools", "hint", "smollm2_terse", "smollm2_draft",
)  # fmt: skip
# The held-out splits that grade each embedded task (`eval_benchmark`)
EMBEDDED_BENCHMARKS = {
    "addition": "tiny",
    "multi_teacher": "tiny,tiny-subtraction",
    "long_addition": "tiny-long-addition",
    "addition_vllm": "tiny",
    "tools": "tiny-tools",
    "hint": "tiny",
    "smollm2_terse": "terse",
    "smollm2_draft": "terse",
}
# The embedded tasks whose prompts carry privileged context (a `teacher_prompt`) for `self_distillation` to teach from:
# task -> its held-out split with that context shown, where the untrained student's accuracy is the run's reference
HINTED_BENCHMARKS = {"hint": "tiny-hinted", "smollm2_terse": "terse-fewshot"}
# Their recipes, which set `self_distillation`
SELF_DISTILLATION_RECIPES = {
    "hint": "recipes/tiny/self_distill.yaml",
    "smollm2_terse": "recipes/real/smollm2_terse.yaml",
}
# `embedded_task: smollm2_draft`'s draft: SmolLM2-135M-Instruct's first decoder layers, its embeddings, final norm and
# head kept (`tvopd_trl.speculative.truncated_draft`)
DRAFT_LAYERS = 4
# `embedded_teacher`'s name of the default pair's imperfect teacher (`tvopd_trl.tiny.weak_teacher_path`)
WEAK_TEACHER = "weak"
# `embedded_teacher`'s names of the teachers of another family (`tvopd_trl.tiny.cross_tokenizer_paths`), by member
CROSS_TOKENIZER_TEACHERS = {"cross_digits": "digits", "cross_triplets": "triplets"}
# The embedded default: the recipe a job runs when it names no recipe, model, teacher or dataset.
DEFAULT_RECIPE = "tiny/tvopd"
CUSTOM_KEYS = ("model_name_or_path", "teacher_model_name_or_path", "teacher_model_server_url", "dataset_name")


@dataclass
class MainJobArguments:
    r"""
    Arguments of the main job that are neither training arguments (`TVOPDConfig`) nor model arguments (TRL's
    `ModelConfig`, parsed beside them as in TRL's scripts: the student's `model_name_or_path`, its `dtype`,
    `attn_implementation` and `model_revision`, LoRA and quantization; see `apply_model_config`).

    The student defaults to the embedded tiny student. The teacher is the config's `teacher_model_name_or_path`,
    defaulting to the embedded tiny teacher, or the server at the config's `teacher_model_server_url` (then
    `teacher_model_name_or_path`, if set, only names its tokenizer). Several teachers are a mapping `{name: path}` there
    (a JSON object on the command line), each prompt routed by the dataset's `teacher_id` column
    (docs/multi-teacher.md).

    Parameters:
        > Parameters that control the models and the data

        embedded_task (`str`, *optional*, defaults to `"addition"`):
            The embedded default the job runs without a model, teacher or dataset of its own: `"addition"` (the tiny
            pair), `"multi_teacher"` (the tiny family's student weak at addition and subtraction, one teacher per
            skill, the prompts of both skills routed to their teacher) or `"long_addition"` (three-digit addition
            worked out column by column: 45-49-token completions, so `max_completion_length` and
            `eval_max_new_tokens` of at least 64) or `"addition_vllm"` (the tiny pair's task on the vLLM-ready pair,
            whose heads vLLM's CPU attention serves) or `"tools"` (four-digit addition with an `add` tool: the
            student learns to call it and to answer with its result, docs/tools.md; `max_completion_length` of at
            least 64, `eval_max_new_tokens` of at least 40 per turn) or `"hint"` (the tiny addition task, whose
            `teacher_prompt` shows the answer as a hint: one model, a student that solves it with the hint and seldom
            without, which teaches itself with `self_distillation`, `recipes/tiny/self_distill.yaml`) or
            `"smollm2_terse"` (a real model: SmolLM2-135M-Instruct, built on first use by `tvopd_trl.pretrained`,
            teaches itself to answer general questions in at most ten words as it does after four terse few-shot
            turns, its `teacher_prompt`: `tvopd_trl.terse_task`, `recipes/real/smollm2_terse.yaml`) or
            `"smollm2_draft"` (a speculative-decoding draft: SmolLM2-135M-Instruct's first 4 of 30 decoder layers, its
            embeddings, final norm and head kept, built on first use beside the model, learns on the same questions
            as plain user turns to draft for the whole model, its teacher; measured by `eval_acceptance_prompts`:
            `recipes/real/smollm2_draft.yaml`, docs/drafts.md). Its held-out splits are `eval_benchmark`'s: `tiny`,
            `tiny,tiny-subtraction`, `tiny-long-addition`, `tiny`, `tiny-tools`, `tiny`, `terse` and `terse`. With
            `self_distillation` on `hint` or `smollm2_terse`, the reference the gap is measured to is the untrained
            student's score with the privileged context shown (`tiny-hinted`, `terse-fewshot`), in place of the
            teacher's.
        embedded_teacher (`str`, *optional*):
            An embedded teacher other than the task's own. With `embedded_task: addition`, `weak`: the tiny pair's
            imperfect teacher, a checkpoint of the same run that solves 60-75% of the held-out split
            (`tvopd_trl.tiny.weak_teacher_path()`); `cross_digits` and `cross_triplets`: teachers of another family
            (Llamas with tokenizers of their own that cut numbers into single digits, or into groups of up to three
            digits as Llama 3 does), which need `cross_tokenizer: true` (docs/cross-tokenizer.md). With
            `embedded_task: multi_teacher`, the one teacher of the family (`addition` or `subtraction`) that scores
            every prompt, the other skill's too, where it is wrong: the one-teacher baseline of docs/multi-teacher.md. Defaults to the task's teacher (with `multi_teacher`,
            routing each prompt to its own skill's teacher).
        dataset_name (`str`, *optional*):
            Hub dataset id or local JSON/JSONL file of prompts (see `dataset_prompt_column`). Defaults to the embedded
            task's OPD prompt split.
        dataset_config (`str`, *optional*):
            Configuration of `dataset_name` on the Hub (e.g. `all` for `open-r1/DAPO-Math-17k-Processed`).
        dataset_train_split (`str`, *optional*, defaults to `"train"`):
            Split of `dataset_name` to train on.
        dataset_prompt_column (`str`, *optional*):
            Column of `dataset_name` that holds the prompt: chat messages are used as they are, a problem text becomes
            one user turn followed by the evaluation's `\\boxed{}` instruction (`tvopd_trl.prompts`). Defaults to the
            first of `prompt`, `question` and `problem` that exists. Every other column but `teacher_id` (the
            routing of several teachers) is dropped.
        eval_benchmark (`str`, *optional*, defaults to `"tiny"`):
            Benchmark of the accuracy evaluation: a registered name (`tvopd_trl.eval.BENCHMARKS`: the paper's six and
            the embedded tasks' held-out splits, `tiny`, `tiny-subtraction`, `tiny-long-addition`, `tiny-tools` and
            `tiny-hinted`, `tiny` with each answer shown as a hint) or a JSONL file
            with `id`, `problem` and `answer` fields. Several, comma-separated, are evaluated each (per skill in the
            summary) and averaged.
        eval_data_dir (`str`, *optional*):
            Where the paper's benchmarks are read from: a folder with `<benchmark>.jsonl` files, or `hub` for their
            Hub datasets. Defaults to the copies that ship with the package (offline).

        > Parameters that control the accuracy evaluation

        eval_problems (`int`, *optional*, defaults to `200`):
            Number of benchmark problems evaluated (the first ones). `0` disables the evaluation.
        eval_k (`int`, *optional*, defaults to `4`):
            Samples per problem: the reported accuracy is mean@k.
        eval_temperature (`float`, *optional*, defaults to `0.6`):
            Sampling temperature of the evaluation (the paper's).
        eval_top_p (`float`, *optional*, defaults to `0.95`):
            Top-p of the evaluation (the paper's).
        eval_top_k (`int`, *optional*, defaults to `20`):
            Top-k of the evaluation (the paper's).
        eval_max_new_tokens (`int`, *optional*, defaults to `16`):
            Generation budget per response. The paper's is 31,744; the embedded task's answers need a few tokens.
        eval_every_steps (`int`, *optional*, defaults to `50`):
            Evaluate the student every this many optimizer steps, for the accuracy curve. `0` disables it.
        eval_batch_size (`int`, *optional*, defaults to `512`):
            Sequences generated at once by the evaluation.
        eval_teacher (`bool`, *optional*, defaults to `True`):
            Evaluate the teacher too. A grid of runs that share one teacher evaluates it once instead. With a live
            self-teacher (`self_distillation: live`), the teacher at the end: the trained student with its teacher
            prompt (`student_accuracy_hinted_after`); a frozen one is the step-0 student, always evaluated as the
            reference.
        trl_baseline (`bool`, *optional*, defaults to `False`):
            Train with TRL's own `DistillationTrainer` instead, for comparison: its full-vocabulary divergence (reverse
            KL, `beta=1`) on the same on-policy rollouts, batch, lengths and optimizer, a `teacher_prompt` read by its
            teacher (`tvopd_trl.trl_baseline`). One local teacher, or `self_distillation: frozen`. The evaluation and
            summary are the job's; the TV metrics are TV-OPD's and are not logged.
        eval_control_benchmark (`str`, *optional*):
            A control benchmark of what the student can already do (e.g. `facts`, questions with known answers),
            answered greedily before and after training: the summary's `control_retention` is the share of the
            problems it answered right before that it still answers right after, so that a run that wins its metric
            by breaking the model is seen. Defaults to none.

        > Parameters that control the draft evaluation

        eval_acceptance_prompts (`int`, *optional*, defaults to `0`):
            Measure the student as a speculative-decoding draft of its teacher, before and after training, on the first
            this many problems of the first `eval_benchmark` (its prompts as the accuracy evaluation renders them):
            transformers' assisted generation of the teacher with the student drafting, sampled at the rollouts'
            `temperature` with nothing truncated, `eval_max_new_tokens` tokens a prompt, counts the drafted tokens
            its verifier tests and accepts (`tvopd_trl.speculative.draft_report`). The summary's `draft_before` and
            `draft_after` hold the acceptance rate with its 95% interval, the tokens each teacher forward yields
            beside their prediction at that rate, and the wall-clock speedup over the teacher generating alone (which
            depends on the hardware). It needs one local teacher with the student's tokenizer and one process. `0`
            disables it.
        eval_acceptance_gamma (`int`, *optional*, defaults to `3`):
            Tokens the draft proposes per verification in that measurement.
    """

    embedded_task: str = field(
        default="addition",
        metadata={"help": "Embedded default without a model or dataset of its own.", "choices": EMBEDDED_TASKS},
    )
    embedded_teacher: str | None = field(
        default=None,
        metadata={
            "help": "Another embedded teacher: weak (embedded_task addition: the imperfect teacher), cross_digits or "
            "cross_triplets (embedded_task addition: another family's, with cross_tokenizer), or addition or "
            "subtraction (embedded_task multi_teacher: one family teacher for every prompt)."
        },
    )
    dataset_name: str | None = field(default=None, metadata={"help": "Prompt dataset (default: embedded task)."})
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration of `dataset_name`."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split of `dataset_name` to train on."})
    dataset_prompt_column: str | None = field(
        default=None,
        metadata={"help": "Prompt column (chat messages, or a problem text); default: prompt, question or problem."},
    )
    eval_benchmark: str = field(
        default="tiny", metadata={"help": "Benchmark name or JSONL file (id, problem, answer)."}
    )
    eval_data_dir: str | None = field(
        default=None, metadata={"help": "Folder with <benchmark>.jsonl files, or hub (default: the packaged copies)."}
    )
    eval_problems: int = field(default=200, metadata={"help": "Held-out problems evaluated; 0 disables."})
    eval_k: int = field(default=4, metadata={"help": "Samples per problem (mean@k)."})
    eval_temperature: float = field(default=PAPER_TEMPERATURE, metadata={"help": "Evaluation sampling temperature."})
    eval_top_p: float = field(default=PAPER_TOP_P, metadata={"help": "Evaluation top-p."})
    eval_top_k: int = field(default=PAPER_TOP_K, metadata={"help": "Evaluation top-k."})
    eval_max_new_tokens: int = field(default=16, metadata={"help": "Evaluation generation budget."})
    eval_every_steps: int = field(default=50, metadata={"help": "Accuracy-curve interval in steps; 0 disables."})
    eval_batch_size: int = field(default=512, metadata={"help": "Sequences generated at once by the evaluation."})
    eval_teacher: bool = field(default=True, metadata={"help": "Evaluate the teacher too."})
    trl_baseline: bool = field(
        default=False, metadata={"help": "Train with TRL's DistillationTrainer instead, for comparison."}
    )
    eval_control_benchmark: str | None = field(
        default=None, metadata={"help": "Control benchmark answered greedily before and after (e.g. facts)."}
    )
    eval_acceptance_prompts: int = field(
        default=0, metadata={"help": "Prompts the student's acceptance rate as a draft is measured on; 0 disables."}
    )
    eval_acceptance_gamma: int = field(default=3, metadata={"help": "Tokens drafted per verification there."})


class RecipeParser(OneLineErrors, TrlParser):
    """TRL's parser of a YAML config and flags, whose `--config` also takes the name of a packaged recipe
    (`tiny/tvopd`, see `tvopd_trl.packaged_recipes`), and whose errors are one line (`OneLineErrors`)."""

    def parse_args_and_config(self, args=None, **kwargs):
        args = list(sys.argv[1:] if args is None else args)
        if "--config" in args:
            index = args.index("--config") + 1
            if index == len(args):
                self.error("argument --config: expected one argument")
            args[index] = find_recipe(args[index])
        return super().parse_args_and_config(args, **kwargs)


class JobParser(RecipeParser):
    """The main job's `RecipeParser`, with its defaults:

    - without `--config`, and without a model, teacher or dataset of its own, the job runs the embedded default, the
      packaged `tiny/tvopd` recipe (flags still override it);
    - `ModelConfig`'s `dtype` is unset instead of float32: the student then loads in float32 (the trainer's default)
      and each teacher as `teacher_model_init_kwargs` says, its checkpoint's dtype by default. `--dtype` loads both.
    """

    def __init__(self, dataclass_types, **kwargs):
        import torch

        super().__init__(dataclass_types, **kwargs)
        self.set_defaults_with_config(
            # Pinned memory needs an accelerator: without one, torch pins nothing and warns that it does not.
            dataloader_pin_memory=torch.accelerator.is_available(),
            dtype=None,
        )
        # TRL's help for these describes its own scripts' defaults, not the job's.
        helps = {
            "model_name_or_path": "Student id or path (default: the embedded tiny student).",
            "dtype": "Load the student and the teachers in this dtype (default: the student in float32, a teacher as "
            "teacher_model_init_kwargs says, else in its checkpoint's dtype).",
        }
        for action in self._actions:
            action.help = helps.get(action.dest, action.help)

    def parse_args_and_config(self, args=None, **kwargs):
        # Building `TrainingArguments` imports transformers' trackers module, which prints "[INFO] Running in WANDB
        # offline mode" under WANDB_MODE=offline whatever `report_to` says (a run that uses wandb hears it from
        # wandb): import it first, silently.
        with contextlib.redirect_stdout(io.StringIO()):
            import transformers.integrations.integration_utils  # noqa: F401
        args = list(sys.argv[1:] if args is None else args)
        if "--config" not in args and not any(getattr(self.parse_known_args(args)[0], key) for key in CUSTOM_KEYS):
            args = ["--config", DEFAULT_RECIPE, *args]
        return super().parse_args_and_config(args, **kwargs)


# The options of TRL and transformers that a recipe sets most, for `tvopd-trl train --help`
_COMMON_OPTIONS = (
    "model_name_or_path", "teacher_model_name_or_path", "output_dir", "learning_rate", "max_steps",
    "per_device_train_batch_size", "gradient_accumulation_steps", "max_completion_length", "temperature", "seed",
    "bf16", "use_vllm", "vllm_mode", "use_peft", "lora_r", "save_steps", "save_only_model", "resume_from_checkpoint",
    "report_to",
)  # fmt: skip


def train_help(parser):
    """`tvopd-trl train --help`: how the command launches, the job's and TV-OPD's own options and the most used of
    TRL's and transformers' (`--help-all`: all 1,100 lines of them)."""
    import argparse
    import copy

    from .config import TVOPDConfig

    formatter = argparse.RawDescriptionHelpFormatter(parser.prog, max_help_position=36)
    formatter.add_usage(
        f"{parser.prog} [--config RECIPE] [--accelerate_config NAME_OR_PATH] [--num_processes N] [OPTION ...]",
        [],
        [],
        "usage: ",
    )
    formatter.add_text(
        "Runs the main job (tvopd_trl.scripts.train) through `accelerate launch`. RECIPE is a YAML file or a packaged "
        "recipe's name (`tvopd-trl recipes` lists them; default: tiny/tvopd); flags after it override its keys. A "
        "recipe key or flag the job does not know goes to `accelerate launch`: --accelerate_config (one of "
        "recipes/accelerate_configs/, then of TRL's, or a path), --num_processes, --main_process_port, ... A key or "
        "flag that is neither is refused. --help-all lists every option; docs/config-reference.md describes them."
    )
    # A dataclass's own fields are its annotations (the inherited ones are its bases')
    sections = [
        ("the job (MainJobArguments)", list(vars(MainJobArguments)["__annotations__"])),
        ("TV-OPD (TVOPDConfig)", list(vars(TVOPDConfig)["__annotations__"])),
        ("most used of TRL's and transformers' options", list(_COMMON_OPTIONS)),
    ]
    # Each option once, under its first name (not its dashed alias, nor the `--no_` twin of a boolean)
    by_dest = {}
    for action in parser._actions:
        if action.option_strings and action.dest not in by_dest:
            by_dest[action.dest] = copy.copy(action)
            by_dest[action.dest].option_strings = action.option_strings[:1]
    for title, names in sections:
        formatter.start_section(title)
        formatter.add_arguments([by_dest[name] for name in names if name in by_dest])
        formatter.end_section()
    return formatter.format_help()


def job_parser(*dataclass_types, prog=None):
    """The parser of the main job's recipe and flags (`MainJobArguments`, `TVOPDConfig`, TRL's `ModelConfig`), after a
    command's own `dataclass_types`."""
    from .config import TVOPDConfig

    return JobParser((*dataclass_types, MainJobArguments, TVOPDConfig, ModelConfig), prog=prog)


def apply_model_config(model_args, training_args):
    """TRL's `ModelConfig` applied as TRL's distillation script applies it: `dtype`, `attn_implementation` and
    `model_revision` go into the config's `model_init_kwargs`, and `dtype` and `attn_implementation` into
    `teacher_model_init_kwargs` too, where a recipe's own keys win. Returns the trainer's `peft_config` (`use_peft`,
    `lora_*`) and `quantization_config` (`load_in_4bit`, `load_in_8bit`) arguments."""
    from trl import get_peft_config, get_quantization_config

    # Only what was set: an unset `dtype` keeps each model's default (see `JobParser`).
    shared = {"dtype": model_args.dtype, "attn_implementation": model_args.attn_implementation}
    shared = {key: value for key, value in shared.items() if value is not None}
    student = dict(shared)
    if model_args.model_revision != "main":  # ModelConfig's default, the Hub's too
        student["revision"] = model_args.model_revision
    if student:
        training_args.model_init_kwargs = {**student, **(training_args.model_init_kwargs or {})}
    if shared and training_args.self_distillation is None:  # a self-teacher loads as the student
        training_args.teacher_model_init_kwargs = {**shared, **(training_args.teacher_model_init_kwargs or {})}
    return {"peft_config": get_peft_config(model_args), "quantization_config": get_quantization_config(model_args)}


def _load_dataset(name, config, split):
    from datasets import load_dataset

    if os.path.isfile(name):
        return load_dataset("json", data_files=name, split="train")
    return load_dataset(name, config, split=split)


def check_model_source(name, what):
    """Refuses a model that is neither a folder nor a Hub id, naming the fix: transformers' own message only says that
    the name is not a valid Hub repository id."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if os.path.isdir(name):
        if not any(os.path.isfile(os.path.join(name, file)) for file in ("config.json", "adapter_config.json")):
            raise FileNotFoundError(f"{what} {name!r} is a folder without config.json, not a saved model.")
        return
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise FileNotFoundError(
            f"{what} {name!r} is neither a model folder nor a Hub model id (namespace/name). Check the path (a relative "
            "one starts from the current directory)."
        ) from None


def embedded_draft_paths():
    """`embedded_task: smollm2_draft`'s (draft, target) folders: the real model's (built on first use) and its first
    `DRAFT_LAYERS` layers' beside it (`<model>-first-4-layers`, built on first use)."""
    from .pretrained import default_model_dir, model_path
    from .speculative import truncated_draft_dir
    from .terse_task import MODEL

    target = str(model_path(MODEL))
    cut = default_model_dir(MODEL).with_name(f"{MODEL}-first-{DRAFT_LAYERS}-layers")
    return truncated_draft_dir(target, DRAFT_LAYERS, cut), target


def load_job(job_args, training_args, model_args):
    """The job's student and teacher paths (the teacher's is None when only served, a mapping by name with several), the
    student's tokenizer and the prompt dataset."""
    from . import tiny
    from .prompts import to_prompt_dataset

    served = training_args.teacher_model_server_url is not None
    task = job_args.embedded_task
    if task == "hint":  # one model: the student, its own teacher with the hint (`self_distillation`)
        family = {"student": tiny.hint_student_path(), "teachers": None}
    elif task == "smollm2_terse":  # a real model, built on first use: its own teacher after the few-shot turns
        from .pretrained import model_path
        from .terse_task import MODEL

        family = {"student": None if model_args.model_name_or_path else str(model_path(MODEL)), "teachers": None}
    elif task == "smollm2_draft":  # the real model's first layers, built on first use beside it, drafting for it
        family = dict(zip(("student", "teachers"), embedded_draft_paths(), strict=True))
    elif task == "multi_teacher":
        family = tiny.multi_teacher_paths()
    elif task in ("long_addition", "addition_vllm", "tools"):
        paths = {
            "long_addition": tiny.long_addition_paths,
            "addition_vllm": tiny.vllm_paths,
            "tools": tiny.tools_paths,
        }
        paths = paths[task]()
        family = {"student": paths["student"], "teachers": paths["teacher"]}
    else:
        family = {"student": tiny.student_path(), "teachers": tiny.teacher_path()}
    student_path = model_args.model_name_or_path or family["student"]
    if job_args.embedded_teacher == WEAK_TEACHER:
        family["teachers"] = tiny.weak_teacher_path()
    elif job_args.embedded_teacher in CROSS_TOKENIZER_TEACHERS:
        family["teachers"] = tiny.cross_tokenizer_paths()[CROSS_TOKENIZER_TEACHERS[job_args.embedded_teacher]]
    elif job_args.embedded_teacher is not None:
        family["teachers"] = family["teachers"][job_args.embedded_teacher]
    # With a teacher server, `teacher_model_name_or_path` only names the teacher's tokenizer, for the vocabulary check
    # (the draft task's server serves its target, whose folder names it); with `self_distillation`, the student is its
    # own teacher.
    embedded_teacher = None if served or training_args.self_distillation is not None else family["teachers"]
    if served and task == "smollm2_draft" and model_args.model_name_or_path is None:
        embedded_teacher = family["teachers"]
    teacher_path = training_args.teacher_model_name_or_path or embedded_teacher
    check_model_source(student_path, "`model_name_or_path`")
    if isinstance(teacher_path, dict):
        for name, path in teacher_path.items():
            check_model_source(path, f"`teacher_model_name_or_path[{name!r}]`")
    elif teacher_path is not None:
        check_model_source(teacher_path, "`teacher_model_name_or_path`")
    remote_code = training_args.trust_remote_code  # False unless the user sets it
    tokenizer = AutoTokenizer.from_pretrained(
        student_path, revision=model_args.model_revision, padding_side="left", trust_remote_code=remote_code
    )
    if job_args.dataset_name is None:
        if task == "multi_teacher":
            train_dataset = tiny.multi_skill_prompt_dataset("opd")
        elif task == "tools":
            train_dataset = tiny.tool_prompt_dataset("opd")
        elif task == "hint":
            from .tiny.hint_task import prompt_dataset

            train_dataset = prompt_dataset("opd")  # `prompt` bare, `teacher_prompt` hinted
        elif task == "smollm2_terse":
            from .terse_task import prompt_dataset

            train_dataset = prompt_dataset("train")  # `prompt` bare, `teacher_prompt` after the few-shot turns
        elif task == "smollm2_draft":
            from .terse_task import prompt_dataset

            train_dataset = prompt_dataset("train").remove_columns("teacher_prompt")  # the questions as they come
        else:
            train_dataset = tiny.prompt_dataset("opd", skill="addition" if task == "addition_vllm" else task)
    else:
        train_dataset = _load_dataset(job_args.dataset_name, job_args.dataset_config, job_args.dataset_train_split)
        train_dataset = to_prompt_dataset(train_dataset, job_args.dataset_prompt_column)
    return student_path, teacher_path, tokenizer, train_dataset


def embedded_tools(job_args):
    """The tools the embedded task's student may call (`embedded_task: tools`: `add`), else None."""
    if job_args.embedded_task != "tools":
        return None
    from .tiny.tool_task import TOOLS

    return TOOLS


def tool_frequencies_of(results, names):
    """The `tools/*` frequencies that a tool loop's evaluation recorded (`results["benchmarks"][name]["tools"]`) for
    the first of `names` that has them, or None."""
    return next((results["benchmarks"][n]["tools"] for n in names if "tools" in results["benchmarks"][n]), None)


class Accuracy:
    """Benchmark accuracy of a model at the job's evaluation settings: mean@k, or greedy, on each of the job's
    benchmarks (`eval_benchmark`, comma-separated, or the names given as `benchmarks`) and averaged over them."""

    def __init__(self, job_args, tokenizer, benchmarks=None, chat_template_kwargs=None):
        self.job_args, self.tokenizer = job_args, tokenizer
        self.settings = SamplingSettings(
            chat_template_kwargs=chat_template_kwargs or None,
            k=job_args.eval_k,
            temperature=job_args.eval_temperature,
            top_p=job_args.eval_top_p,
            top_k=job_args.eval_top_k,
            max_new_tokens=job_args.eval_max_new_tokens,
        )
        self.options = dict(data_dir=job_args.eval_data_dir, limit=job_args.eval_problems)
        # Registered names or JSONL files
        self.names = benchmarks or [name.strip() for name in job_args.eval_benchmark.split(",")]
        self.benchmarks = [get_benchmark(name) for name in self.names]
        self.tools = None  # the last evaluation's tool-call frequencies (`tool_frequencies_of`), with a tool loop
        for name in self.names:
            load_problems(name, **self.options)  # a bad name or file fails before any training

    def scores(self, model, greedy=False, output_dir=None, model_id=None, accelerator=None, tokenizer=None):
        """`{benchmark: mean@k}` (or greedy accuracy) of `model`; with `output_dir`, records land there under
        `model_id`. With `accelerator`, every process calls this and generates a shard (see `evaluate`). `tokenizer`
        (a teacher of another family's) replaces the job's."""
        # Seeded, under a forked RNG: the training run's random stream is left untouched.
        settings = (
            SamplingSettings(
                k=1,
                temperature=0,
                max_new_tokens=self.settings.max_new_tokens,
                chat_template_kwargs=self.settings.chat_template_kwargs,
            )
            if greedy
            else None
        )
        generator = local_generator(self.benchmarks, model, tokenizer or self.tokenizer, self.job_args.eval_batch_size)
        results = evaluate(
            generator,
            self.benchmarks,
            settings or self.settings,
            output_dir,
            model=model_id,
            accelerator=accelerator,
            **self.options,
        )
        # Only the job's benchmarks: `results` also holds those an earlier evaluation left in `output_dir`.
        names = [benchmark.name for benchmark in self.benchmarks]
        self.tools = tool_frequencies_of(results, names)
        return {name: mean_at_k(results["benchmarks"][name]) for name in names}

    def __call__(self, model, greedy=False, output_dir=None, model_id=None, accelerator=None):
        """The mean over the benchmarks of `scores`."""
        scores = self.scores(model, greedy, output_dir, model_id, accelerator)
        return sum(scores.values()) / len(scores)


class DraftAcceptance:
    """The student's acceptance rate as a speculative-decoding draft of its teacher (`eval_acceptance_prompts`), with
    the job's sampling temperature, on the first problems of its first benchmark: a summary record of
    `tvopd_trl.speculative.draft_report`. Each call times the teacher alone just before the draft, so that a speedup
    compares two runs under the same load (measured here: timed once at the start, a run's "after" on a machine
    that had since grown quieter read 0.74x where the two side by side read 0.45x)."""

    def __init__(self, job_args, temperature, tokenizer, seed):
        benchmark = get_benchmark(job_args.eval_benchmark.split(",")[0].strip())
        problems = load_problems(benchmark, data_dir=job_args.eval_data_dir, limit=job_args.eval_acceptance_prompts)
        self.prompts = [benchmark.prompt(problem) for problem in problems]
        self.sampling = dict(temperature=temperature, max_new_tokens=job_args.eval_max_new_tokens, seed=seed)
        self.gamma, self.tokenizer = job_args.eval_acceptance_gamma, tokenizer

    def __call__(self, student, teacher):
        import torch

        from .speculative import draft_report, generation_speed

        with torch.random.fork_rng():  # the training run's random stream is left untouched
            teacher_speed = generation_speed(teacher, self.tokenizer, self.prompts, **self.sampling)
            record = draft_report(
                teacher, student, self.tokenizer, self.prompts, self.gamma, target_speed=teacher_speed, **self.sampling
            )
        return {**record, "target_tokens_per_second": teacher_speed}


def check_job_arguments(job_args, training_args, model_args):
    """Refuses, before any model loads, what the job cannot run: a student without its teacher (or the reverse; with
    `self_distillation` the student is its own), self-distillation on an embedded task without privileged context, the
    hint task without it, and the embedded benchmark for a custom model or dataset."""
    # A teacher server may serve the embedded teacher, so it can go with the embedded student.
    student_named = model_args.model_name_or_path is not None
    teacher_named = training_args.teacher_model_name_or_path is not None
    own_teacher = training_args.self_distillation is not None
    if (student_named and not (teacher_named or training_args.teacher_model_server_url or own_teacher)) or (
        teacher_named and not student_named
    ):
        raise ValueError(
            "Name both `model_name_or_path` and the teacher (`teacher_model_name_or_path` or "
            "`teacher_model_server_url`), or neither (the embedded tiny pair): a student and a teacher must share one "
            "tokenizer."
        )
    if job_args.embedded_task not in EMBEDDED_TASKS:  # a recipe's value does not go through argparse's `choices`
        raise ValueError(
            f"Unknown `embedded_task` {job_args.embedded_task!r}; choose one of {', '.join(EMBEDDED_TASKS)}."
        )
    check_self_distillation(job_args, training_args, student_named or teacher_named)
    if job_args.trl_baseline:
        from .trl_baseline import check_trl_baseline

        check_trl_baseline(training_args)
    if job_args.embedded_teacher is not None:
        from .tiny import SKILLS

        choices = {"multi_teacher": SKILLS, "addition": (WEAK_TEACHER, *CROSS_TOKENIZER_TEACHERS)}
        if job_args.embedded_teacher not in choices.get(job_args.embedded_task, ()):
            raise ValueError(
                f"`embedded_teacher` names one of the multi-teacher family's teachers ({', '.join(SKILLS)}) and goes "
                f"with `embedded_task: multi_teacher`, or is {' or '.join(CROSS_TOKENIZER_TEACHERS)} (another family's) or "
                f"`{WEAK_TEACHER}` (the tiny pair's imperfect teacher) and goes with `embedded_task: addition`; got "
                f"{job_args.embedded_teacher!r} with `embedded_task: {job_args.embedded_task}`."
            )
        if teacher_named or training_args.teacher_model_server_url:
            raise ValueError("`embedded_teacher` picks the embedded family's teacher: drop it, or your own teacher.")
    custom = student_named or job_args.dataset_name is not None
    if custom and job_args.eval_problems > 0 and job_args.eval_benchmark == "tiny":
        raise ValueError(
            "With your own model or dataset, set `eval_benchmark` (e.g. `math500`, or a JSONL "
            "file with id, problem and answer fields): the default, the embedded addition task, says nothing about "
            "your model. Or pass `--eval_problems 0`."
        )
    if job_args.embedded_task in EMBEDDED_BUDGETS and not custom:
        check_embedded_budget(job_args, training_args)
    if job_args.eval_acceptance_prompts > 0:
        check_draft_evaluation(job_args, training_args)


def check_draft_evaluation(job_args, training_args):
    """`eval_acceptance_prompts` measures the student drafting for its teacher in one process: both models there, one
    tokenizer."""
    teacher = training_args.teacher_model_name_or_path
    reasons = {
        "a served teacher (`teacher_model_server_url`)": training_args.teacher_model_server_url is not None,
        "several teachers": isinstance(teacher, dict),
        "a self-teacher (`self_distillation`)": training_args.self_distillation is not None,
        "a teacher of another tokenizer (`cross_tokenizer`)": training_args.cross_tokenizer,
    }
    found = [reason for reason, present in reasons.items() if present]
    if found:
        raise ValueError(
            f"`eval_acceptance_prompts` measures the student drafting for one local teacher with its tokenizer, "
            f"through transformers' assisted generation: not with {found[0]}. Set it to 0, or measure the trained "
            "student with `tvopd_trl.speculative.draft_report` (docs/drafts.md)."
        )
    if job_args.eval_acceptance_gamma < 1:
        raise ValueError(
            f"`eval_acceptance_gamma` drafts at least 1 token a verification; got {job_args.eval_acceptance_gamma}."
        )


def check_self_distillation(job_args, training_args, custom_models):
    """`self_distillation` on an embedded task needs one whose prompts carry privileged context (`HINTED_BENCHMARKS`),
    and is graded on its bare held-out split; the hint and terse tasks have no teacher but the student itself."""
    task, mode = job_args.embedded_task, training_args.self_distillation
    embedded_prompts = job_args.dataset_name is None
    if mode is not None and embedded_prompts and task not in HINTED_BENCHMARKS:
        raise ValueError(
            f"`self_distillation: {mode}` makes the student its own teacher, which knows more than the student only "
            f"where its prompt shows more (a `teacher_prompt`): `embedded_task: {task}`'s prompts carry none, so the "
            f"teacher would be the student itself. Use `embedded_task: {' or '.join(HINTED_BENCHMARKS)}` "
            f"({', '.join(SELF_DISTILLATION_RECIPES.values())}), a dataset with a `teacher_prompt` column, or a "
            "teacher."
        )
    if task in HINTED_BENCHMARKS and embedded_prompts and not custom_models:
        if mode is None and training_args.teacher_model_server_url is None:
            raise ValueError(
                f"`embedded_task: {task}` ships one model, a student that does the task with its teacher prompt and "
                "seldom without, to teach itself: set `self_distillation: live` (or `frozen`), as "
                f"{SELF_DISTILLATION_RECIPES[task]} does."
            )
        benchmark = EMBEDDED_BENCHMARKS[task]
        if mode is not None and job_args.eval_problems > 0 and job_args.eval_benchmark != benchmark:
            raise ValueError(
                f"`embedded_task: {task}` is graded on its held-out split without its teacher prompt, `eval_benchmark: "
                f"{benchmark}`, and measured against the untrained student's score with it "
                f"({HINTED_BENCHMARKS[task]}); got `eval_benchmark: {job_args.eval_benchmark}`."
            )


def hinted_reference(job_args, training_args):
    """The benchmark whose accuracy of the untrained student is a self-distillation run's reference in place of a
    teacher's (its held-out split with the privileged context shown: `HINTED_BENCHMARKS`), or None."""
    task = job_args.embedded_task
    if training_args.self_distillation is None or job_args.dataset_name is not None or job_args.eval_problems <= 0:
        return None
    if task not in HINTED_BENCHMARKS or job_args.eval_benchmark != EMBEDDED_BENCHMARKS[task]:
        return None
    return HINTED_BENCHMARKS[task]


# The embedded tasks whose completions need more than the job's default budgets: what a completion holds, and the
# recipe that sets the budgets (`embedded_budgets` has the numbers).
EMBEDDED_BUDGETS = {
    "long_addition": ("column traces of 45-49 tokens (with the EOS) before the answer", "long_tvopd"),
    "tools": ("a calling turn of 33 tokens, the tool's result and an answering turn: 55-57 tokens", "tools"),
}


def embedded_budgets(task):
    """The least `max_completion_length` and `eval_max_new_tokens` (per turn with tools) of a task of
    `EMBEDDED_BUDGETS`, from the task's own budgets."""
    if task == "long_addition":
        from .tiny.task import max_new_tokens

        return max_new_tokens(task), max_new_tokens(task)
    from .tiny.tool_task import MAX_NEW_TOKENS

    return 64, MAX_NEW_TOKENS  # a whole conversation, 55-57 tokens; one turn


def check_embedded_budget(job_args, training_args):
    """A task of `EMBEDDED_BUDGETS` needs its whole generation budget, and its own held-out split: a shorter budget
    cuts every completion before its answer, and the default benchmark grades another skill."""
    task = job_args.embedded_task
    holds, recipe = EMBEDDED_BUDGETS[task]
    completion, per_response = embedded_budgets(task)
    short = {"max_completion_length": (training_args.max_completion_length, completion)}
    if job_args.eval_problems > 0:
        short["eval_max_new_tokens"] = (job_args.eval_max_new_tokens, per_response)
    short = {key: pair for key, pair in short.items() if pair[0] is not None and pair[0] < pair[1]}
    if short:
        keys = ", ".join(f"`{key}` {value}" for key, (value, _) in short.items())
        least = ", ".join(f"`{key}` to {least}" for key, (_, least) in short.items())
        raise ValueError(
            f"`embedded_task: {task}` writes {holds}: {keys} would cut them. Set {least} (recipes/tiny/{recipe}.yaml)."
        )
    if job_args.eval_problems > 0 and job_args.eval_benchmark == EMBEDDED_BENCHMARKS["addition"]:
        raise ValueError(
            f"`embedded_task: {task}` is graded on its own held-out split: set `eval_benchmark: "
            f"{EMBEDDED_BENCHMARKS[task]}` (the default, `tiny`, is two-digit addition's)."
        )
    if task == "tools" and job_args.eval_problems > 0 and training_args.world_size > 1:
        raise ValueError(
            "The embedded tool task is evaluated in one process (its tool loop's turns are not collectives): run it "
            "on one process, or set `eval_problems: 0` and score the saved model with `tvopd-trl eval --benchmarks "
            "tiny-tools`."
        )


def check_launch_options(remaining):
    """Recipe keys and flags the script does not know must be `accelerate launch` options (`tvopd-trl train` passes
    those on); anything else is a typo, refused before any model loads instead of being silently ignored."""
    import difflib

    from accelerate.commands.launch import launch_command_parser

    launch = {option for action in launch_command_parser()._actions for option in action.option_strings}
    unknown = [flag.split("=")[0] for flag in remaining if flag.startswith("--")]
    unknown = [flag for flag in unknown if flag not in launch and flag != "--accelerate_config"]
    if unknown:
        ours = [option for action in job_parser()._actions for option in action.option_strings]
        hints = [
            f"{flag} (did you mean {match[0]}?)" if (match := difflib.get_close_matches(flag, ours, n=1)) else flag
            for flag in unknown
        ]
        raise ValueError(
            f"Unknown option{'s' * (len(unknown) > 1)} {', '.join(hints)}: neither a training option "
            "(docs/config-reference.md) nor an `accelerate launch` option. Fix the recipe key or the flag."
        )


def accelerate_launch_args(config_remaining, cli_remaining):
    """`accelerate launch` flags: the recipe's and the command line's keys that the script does not know, with
    `--accelerate_config NAME_OR_PATH` turned into `--config_file PATH`. Fails on a config that does not exist."""
    import importlib.resources as resources
    from pathlib import Path

    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    from .packaged_recipes import recipe_names

    if "--accelerate_config" in config_remaining and "--accelerate_config" in cli_remaining:
        # The command line wins over the recipe, as for every other key (TRL would resolve the recipe's value and
        # leave the flag to `accelerate launch`, which rejects it).
        index = config_remaining.index("--accelerate_config")
        config_remaining = config_remaining[:index] + config_remaining[index + 2 :]
    flags = config_remaining + cli_remaining
    if "--accelerate_config" in flags[:-1]:
        index = flags.index("--accelerate_config")
        value = flags[index + 1]
        shipped = resources.files("trl.accelerate_configs")
        if not Path(value).is_file():
            # A name is one of ours first (`zero3`, `zero3_cpu`, `accelerate_configs/zero3_cpu`, or its repository
            # path), so that the recipes' `accelerate_config: zero3` is recipes/accelerate_configs/zero3.yaml, edits
            # included; then one of TRL's (`zero1`, `fsdp1`).
            try:
                flags[index + 1] = find_recipe(value if "/" in value else f"accelerate_configs/{value}")
            except FileNotFoundError:
                if not shipped.joinpath(f"{value}.yaml").is_file():
                    # TRL's own message names neither the recipe nor the names it accepts.
                    names = sorted(
                        entry.name.removesuffix(".yaml") for entry in shipped.iterdir() if entry.name.endswith(".yaml")
                    )
                    ours = [name.split("/")[1] for name in recipe_names() if name.startswith("accelerate_configs/")]
                    source = (
                        "the recipe's `accelerate_config`" if index < len(config_remaining) else "--accelerate_config"
                    )
                    raise ValueError(
                        f"{source} {value!r} is neither a file nor one of our accelerate configs ({', '.join(ours)}) "
                        f"or TRL's ({', '.join(name for name in names if name not in ours)}). Name one of those, or "
                        "give the path of a YAML file, such as recipes/accelerate_configs/zero3.yaml (a relative path "
                        "starts from the current directory)."
                    ) from None
    return resolve_accelerate_config_argument(flags)


# Set by `tvopd-trl train` in the processes it launches: the recipe's `accelerate launch` keys were applied there
LAUNCHED_BY_CLI = "TVOPD_TRL_LAUNCHED"


def check_recipe_launch(remaining):
    """A recipe's `accelerate launch` keys (`accelerate_config`, `num_processes`, ...) are applied by `tvopd-trl train`
    only. In processes started otherwise (`accelerate launch -m tvopd_trl.scripts.train --config RECIPE`, `python -m
    ...`), a launch that differs from what they ask for is refused rather than trained silently without them."""
    from accelerate import PartialState
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import DistributedType

    if os.environ.get(LAUNCHED_BY_CLI) or not remaining:
        return
    asked = launch_command_parser().parse_args([*accelerate_launch_args(remaining, []), "-m", __name__])
    state = PartialState()
    config = load_config_from_file(asked.config_file) if asked.config_file else None
    processes = asked.num_processes or (config.num_processes if config else None)
    wanted_type = DistributedType(config.distributed_type) if config else None
    differences = []
    if wanted_type is not None and wanted_type != state.distributed_type:
        differences.append(f"{asked.config_file} is {wanted_type.value}, this launch {state.distributed_type.value}")
    if processes is not None and processes != state.num_processes:
        differences.append(f"{processes} processes asked for, {state.num_processes} launched")
    if differences:
        raise ValueError(
            f"The recipe's launch settings ({', '.join(differences)}) are applied by `tvopd-trl train --config RECIPE`, "
            "not by `accelerate launch` or `python -m`, which would train without them. Run `tvopd-trl train`, "
            "launch with the same settings (`accelerate launch --config_file ... --num_processes ...`), or state "
            "this launch's on the command line after --config (`--num_processes 4 --accelerate_config "
            "recipes/accelerate_configs/multi_gpu.yaml`)."
        )
