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
"""
The main job: distill a teacher into a student with TV-OPD (or any baseline mode) from a YAML recipe.

```bash
accelerate launch -m tvopd_trl.scripts.train --config recipes/tiny/tvopd.yaml
tvopd-trl train --config recipes/tiny/tvopd.yaml --learning_rate 3e-3   # the same; CLI flags override the recipe
```

Without `model_name_or_path` / `teacher_model_name_or_path` / `dataset_name` it runs on the embedded default: the
tiny addition teacher and student shipped in `tvopd_trl.tiny`, trained on the task's OPD prompt split and evaluated
on its held-out split. It measures held-out accuracy (mean@k at the paper's sampling settings, and greedy) of the
teacher and of the student before and after training, and of the student every `eval_every_steps` steps. It writes
the model, PNG plots and `summary.json` into `output_dir`, and prints a summary table.
"""

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass, field

from transformers import AutoTokenizer


@dataclass
class MainJobArguments:
    r"""
    Arguments of the main job that are not training arguments.

    Parameters:
        > Parameters that control the models and the data

        model_name_or_path (`str`, *optional*):
            Student model id or path. Defaults to the embedded tiny student. The teacher is the config's
            `teacher_model_name_or_path`, defaulting to the embedded tiny teacher, or the server at the config's
            `teacher_model_server_url` (then `teacher_model_name_or_path`, if set, only names its tokenizer).
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
            first of `prompt`, `question` and `problem` that exists. Every other column is dropped.
        eval_benchmark (`str`, *optional*, defaults to `"tiny"`):
            Benchmark of the accuracy evaluation: a registered name (`tvopd_trl.eval.BENCHMARKS`: the paper's six and
            the embedded task's held-out split, `tiny`) or a JSONL file with `id`, `problem` and `answer` fields.
        eval_data_dir (`str`, *optional*):
            Folder with `<benchmark>.jsonl` files, read instead of the Hub for the paper's benchmarks.

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
            Evaluate the teacher too. A grid of runs that share one teacher evaluates it once instead.
    """

    model_name_or_path: str | None = field(default=None, metadata={"help": "Student id or path (default: embedded)."})
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
    eval_data_dir: str | None = field(default=None, metadata={"help": "Folder with local <benchmark>.jsonl files."})
    eval_problems: int = field(default=200, metadata={"help": "Held-out problems evaluated; 0 disables."})
    eval_k: int = field(default=4, metadata={"help": "Samples per problem (mean@k)."})
    eval_temperature: float = field(default=0.6, metadata={"help": "Evaluation sampling temperature."})
    eval_top_p: float = field(default=0.95, metadata={"help": "Evaluation top-p."})
    eval_top_k: int = field(default=20, metadata={"help": "Evaluation top-k."})
    eval_max_new_tokens: int = field(default=16, metadata={"help": "Evaluation generation budget."})
    eval_every_steps: int = field(default=50, metadata={"help": "Accuracy-curve interval in steps; 0 disables."})
    eval_batch_size: int = field(default=512, metadata={"help": "Sequences generated at once by the evaluation."})
    eval_teacher: bool = field(default=True, metadata={"help": "Evaluate the teacher too."})


def _load_dataset(name, config, split):
    from datasets import load_dataset

    if os.path.isfile(name):
        return load_dataset("json", data_files=name, split="train")
    return load_dataset(name, config, split=split)


def load_job(job_args, training_args):
    """The job's student and teacher paths (the teacher's is None when only served), the student's tokenizer and the
    prompt dataset."""
    from .. import tiny
    from ..prompts import to_prompt_dataset

    served = training_args.teacher_model_server_url is not None
    student_path = job_args.model_name_or_path or tiny.student_path()
    # With a teacher server, `teacher_model_name_or_path` only names the teacher's tokenizer, for the vocabulary check.
    teacher_path = training_args.teacher_model_name_or_path or (None if served else tiny.teacher_path())
    remote_code = training_args.trust_remote_code  # False unless the user sets it
    tokenizer = AutoTokenizer.from_pretrained(student_path, padding_side="left", trust_remote_code=remote_code)
    if job_args.dataset_name is None:
        train_dataset = tiny.prompt_dataset("opd")
    else:
        train_dataset = _load_dataset(job_args.dataset_name, job_args.dataset_config, job_args.dataset_train_split)
        train_dataset = to_prompt_dataset(train_dataset, job_args.dataset_prompt_column)
    return student_path, teacher_path, tokenizer, train_dataset


class Accuracy:
    """Benchmark accuracy of a model at the job's evaluation settings: mean@k, or greedy."""

    def __init__(self, job_args, tokenizer):
        from ..eval import SamplingSettings, load_problems

        self.job_args, self.tokenizer = job_args, tokenizer
        self.settings = SamplingSettings(
            k=job_args.eval_k,
            temperature=job_args.eval_temperature,
            top_p=job_args.eval_top_p,
            top_k=job_args.eval_top_k,
            max_new_tokens=job_args.eval_max_new_tokens,
        )
        self.options = dict(data_dir=job_args.eval_data_dir, limit=job_args.eval_problems)
        load_problems(job_args.eval_benchmark, **self.options)  # a bad name or file fails before any training

    def __call__(self, model, greedy=False, output_dir=None, model_id=None):
        """mean@k (or greedy accuracy) of `model`; with `output_dir`, records land there under `model_id`."""
        from ..eval import SamplingSettings, TransformersGenerator, evaluate, get_benchmark, mean_at_k

        # Seeded, under a forked RNG: the training run's random stream is left untouched.
        settings = (
            SamplingSettings(k=1, temperature=0, max_new_tokens=self.settings.max_new_tokens) if greedy else None
        )
        generator = TransformersGenerator(model, self.tokenizer, self.job_args.eval_batch_size)
        benchmark = get_benchmark(self.job_args.eval_benchmark)
        results = evaluate(
            generator, [benchmark], settings or self.settings, output_dir, model=model_id, **self.options
        )
        return mean_at_k(results["benchmarks"][benchmark.name])


def main(job_args, training_args):
    from accelerate import PartialState
    from rich.console import Console

    from ..eval import BenchmarkEvalCallback, get_benchmark, mean_at_k, step_dir
    from ..plots import plot_run
    from ..trainer import TVOPDTrainer

    start = time.perf_counter()
    state = PartialState()
    _check_job_arguments(job_args, training_args, state)
    served = training_args.teacher_model_server_url is not None
    student_path, teacher_path, tokenizer, train_dataset = load_job(job_args, training_args)
    accuracy = Accuracy(job_args, tokenizer) if job_args.eval_problems > 0 else None

    # Paths, not models: the trainer loads both with the config's `model_init_kwargs` / `teacher_model_init_kwargs`.
    trainer = TVOPDTrainer(
        model=student_path,
        teacher_model=None if served else teacher_path,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        teacher_processing_class=(
            AutoTokenizer.from_pretrained(teacher_path, trust_remote_code=training_args.trust_remote_code)
            if teacher_path
            else None
        ),
    )
    trainer.dataset_name = job_args.dataset_name  # for the model card
    curve = None
    if accuracy is not None and job_args.eval_every_steps > 0:
        curve = BenchmarkEvalCallback(
            trainer,
            [job_args.eval_benchmark],
            job_args.eval_every_steps,
            accuracy.settings,
            at_start=False,
            batch_size=job_args.eval_batch_size,
            **accuracy.options,
        )
        trainer.add_callback(curve)
    results = {}
    out = training_args.output_dir
    if state.is_main_process and training_args.resume_from_checkpoint is None and os.path.isdir(f"{out}/eval"):
        # A fresh run in a used output_dir: keep the earlier run's evaluations, out of this run's way.
        kept = f"{out}/eval-{time.strftime('%Y%m%d-%H%M%S')}"
        os.rename(f"{out}/eval", kept)
        print(f"{out}/eval held an earlier run's evaluations: moved to {kept}")
    if accuracy is not None and state.is_main_process:
        student = trainer.accelerator.unwrap_model(trainer.model)
        if job_args.eval_teacher and not served:  # a served teacher is not in this process to evaluate
            teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
            teacher_dir = os.path.join(training_args.output_dir, "eval", "teacher")
            results["teacher_accuracy"], results["teacher_accuracy_greedy"] = (
                accuracy(teacher, False, teacher_dir, model_id=teacher_path),
                accuracy(teacher, True),
            )
        results["student_accuracy_before"] = accuracy(
            student, output_dir=step_dir(out, 0, job_args.eval_k), model_id=os.path.abspath(out)
        )
        results["student_accuracy_before_greedy"] = accuracy(student, greedy=True)
    train_start = time.perf_counter()
    trainer.train(resume_from_checkpoint=_resume_argument(training_args.resume_from_checkpoint))
    train_seconds = time.perf_counter() - train_start
    trainer.save_model(training_args.output_dir)

    if state.is_main_process:
        history = [
            (step, mean_at_k(r["benchmarks"][get_benchmark(job_args.eval_benchmark).name]))
            for step, r in (curve.history if curve else [])
        ]
        final_step = trainer.state.global_step
        if accuracy is not None:
            student = trainer.accelerator.unwrap_model(trainer.model)  # the trainer may have re-wrapped it
            evaluated = dict(history)
            if final_step in evaluated:
                results["student_accuracy_after"] = evaluated[final_step]
            else:
                results["student_accuracy_after"] = accuracy(
                    student, output_dir=step_dir(out, final_step, job_args.eval_k), model_id=os.path.abspath(out)
                )
                history.append((final_step, results["student_accuracy_after"]))
            results["student_accuracy_after_greedy"] = accuracy(student, greedy=True)
        if "student_accuracy_before" in results:
            history = [(0, results["student_accuracy_before"]), *history]
        plots = plot_run(trainer.state.log_history, history, training_args.output_dir, results.get("teacher_accuracy"))
        last = next((e for e in reversed(trainer.state.log_history) if "tv/scale" in e), {})
        summary = {
            "advantage_mode": training_args.advantage_mode,
            "steps": trainer.state.global_step,
            "wall_seconds": time.perf_counter() - start,
            "train_seconds": train_seconds,
            **results,
            "gap_closed": _gap_closed(results),
            "final_tv_scale": last.get("tv/scale"),
            "final_tv_estimate": last.get("tv/estimate"),
            "accuracy_curve": history,
            "student": student_path,
            "teacher": training_args.teacher_model_server_url if served else teacher_path,
            "plots": [os.path.basename(path) for path in plots],
            "job_args": asdict(job_args),
        }
        with open(os.path.join(training_args.output_dir, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f)
        with open(os.path.join(training_args.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        console = Console()
        console.print(_summary_table(summary))
        console.print(_summary_footer(summary, training_args.output_dir))
    trainer.accelerator.wait_for_everyone()
    return trainer


def _resume_argument(value):
    """`--resume_from_checkpoint last` (or `true`) resumes from the last complete checkpoint; a path, from that one."""
    return True if value is not None and value.lower() in ("last", "true") else value


def _check_job_arguments(job_args, training_args, state):
    # A teacher server may serve the embedded teacher, so it can go with the embedded student.
    student_named = job_args.model_name_or_path is not None
    teacher_named = training_args.teacher_model_name_or_path is not None
    if (student_named and not (teacher_named or training_args.teacher_model_server_url)) or (
        teacher_named and not student_named
    ):
        raise ValueError(
            "Name both `model_name_or_path` and the teacher (`teacher_model_name_or_path` or "
            "`teacher_model_server_url`), or neither (the embedded tiny pair): a student and a teacher must share one "
            "tokenizer."
        )
    custom = job_args.model_name_or_path is not None or job_args.dataset_name is not None
    if custom and job_args.eval_problems > 0 and job_args.eval_benchmark == "tiny":
        raise ValueError(
            "With your own model or dataset, set `eval_benchmark` (e.g. `math500` with `eval_data_dir`, or a JSONL "
            "file with id, problem and answer fields): the default, the embedded addition task, says nothing about "
            "your model. Or pass `--eval_problems 0`."
        )
    sharded = state.distributed_type.name == "FSDP" or (
        state.distributed_type.name == "DEEPSPEED" and training_args.deepspeed_plugin.zero_stage == 3
    )
    if sharded and job_args.eval_problems > 0:
        raise ValueError(
            "The main job's accuracy evaluation generates on the main process only, which sharded models (ZeRO-3, "
            "FSDP) cannot do. Pass `--eval_problems 0`."
        )


def _gap_closed(results):
    """(after - before) / (teacher - before): the share of the teacher-student gap the run closed."""
    keys = ("student_accuracy_before", "student_accuracy_after", "teacher_accuracy")
    if any(key not in results for key in keys):
        return None
    before, after, teacher = (results[key] for key in keys)
    return (after - before) / (teacher - before) if teacher != before else None


def _summary_table(summary):
    from rich.table import Table

    args = summary["job_args"]
    table = Table(title=f"TV-OPD main job ({summary['advantage_mode']}, {summary['steps']} steps)")
    table.add_column("held-out accuracy", justify="left")
    table.add_column(f"mean@{args['eval_k']}", justify="right")
    table.add_column("greedy", justify="right")

    def fmt(value):
        return "-" if value is None else f"{100 * value:.1f}%"

    for label, key in (("student before", "student_accuracy_before"), ("student after", "student_accuracy_after")):
        table.add_row(label, fmt(summary.get(key)), fmt(summary.get(f"{key}_greedy")))
    table.add_row("teacher", fmt(summary.get("teacher_accuracy")), fmt(summary.get("teacher_accuracy_greedy")))
    return table


def _summary_footer(summary, output_dir):
    args, gap, scale = summary["job_args"], summary.get("gap_closed"), summary.get("final_tv_scale")
    return (
        f"{args['eval_problems']} held-out problems, sampled at T={args['eval_temperature']}, top-p "
        f"{args['eval_top_p']}, top-k {args['eval_top_k']}\n"
        f"gap closed: {'-' if gap is None else f'{100 * gap:.0f}%'} · final tv/scale "
        f"{'-' if scale is None else f'{scale:.3f}'} · {summary['wall_seconds']:.0f} s\n"
        f"plots and summary.json in {output_dir}"
    )


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None):
    from trl import TrlParser

    from ..config import TVOPDConfig

    dataclass_types = (MainJobArguments, TVOPDConfig)
    if subparsers is not None:
        return subparsers.add_parser("train", help="Run the TV-OPD main job", dataclass_types=dataclass_types)
    return TrlParser(dataclass_types, prog=prog)


def check_launch_options(remaining):
    """Recipe keys and flags the script does not know must be `accelerate launch` options (`tvopd-trl train` passes
    those on); anything else is a typo, refused before any model loads instead of being silently ignored."""
    import difflib

    from accelerate.commands.launch import launch_command_parser

    launch = {option for action in launch_command_parser()._actions for option in action.option_strings}
    unknown = [flag.split("=")[0] for flag in remaining if flag.startswith("--")]
    unknown = [flag for flag in unknown if flag not in launch and flag != "--accelerate_config"]
    if unknown:
        ours = [option for action in make_parser()._actions for option in action.option_strings]
        hints = [
            f"{flag} (did you mean {match[0]}?)" if (match := difflib.get_close_matches(flag, ours, n=1)) else flag
            for flag in unknown
        ]
        raise ValueError(
            f"Unknown option{'s' * (len(unknown) > 1)} {', '.join(hints)}: neither a training option "
            "(docs/config-reference.md) nor an `accelerate launch` option. Fix the recipe key or the flag."
        )


def run(args=None):
    import torch

    parser = make_parser()
    if not torch.accelerator.is_available():
        # Pinned memory needs an accelerator: without one, torch pins nothing and warns that it does not.
        # A default only: the recipe's `dataloader_pin_memory` (applied over it) and a flag still win.
        parser.set_defaults_with_config(dataloader_pin_memory=False)
    *parsed, remaining = parser.parse_args_and_config(args=args, return_remaining_strings=True)
    check_launch_options(remaining)  # `accelerate launch` settings in a recipe are for `tvopd-trl train`
    job_args, training_args = parsed[:2]
    return main(job_args, training_args)


if __name__ == "__main__":
    run()
    # Gloo aborts in its destructors at exit in some multi-process CPU runs ("terminate called without an active
    # exception", exit code 1 after a finished job) unless the process group is gone first.
    from accelerate import PartialState

    PartialState().destroy_process_group()
