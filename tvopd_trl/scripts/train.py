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

The job's arguments (`MainJobArguments`), what it loads and how it measures accuracy are in `tvopd_trl.job`.
"""

import json
import os
import time
from dataclasses import asdict

from transformers import AutoTokenizer

from ..job import (
    Accuracy,
    MainJobArguments,  # noqa: F401  (moved to `tvopd_trl.job`; this import keeps working)
    check_job_arguments,
    check_launch_options,
    job_parser,
    load_job,
)


def main(job_args, training_args):
    from accelerate import PartialState
    from rich.console import Console

    from ..eval import BenchmarkEvalCallback, get_benchmark, mean_at_k, step_dir
    from ..plots import plot_run
    from ..trainer import TVOPDTrainer

    start = time.perf_counter()
    state = PartialState()
    check_job_arguments(job_args, training_args, state)
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


def make_parser(prog=None):
    return job_parser(prog=prog)


def run(argv=None):
    parser = make_parser(prog="tvopd-trl train")
    job_args, training_args, remaining = parser.parse_args_and_config(args=argv, return_remaining_strings=True)
    check_launch_options(remaining)  # `accelerate launch` settings in a recipe are for `tvopd-trl train`
    main(job_args, training_args)
    return 0


if __name__ == "__main__":
    import sys

    from accelerate import PartialState

    from ..console import quiet, report_errors

    # The process `tvopd-trl train` launches: a user error is one line here too, and the launcher adds nothing to it.
    quiet()
    status = report_errors("tvopd-trl train", run)
    # Gloo aborts in its destructors at exit in some multi-process CPU runs ("terminate called without an active
    # exception", exit code 1 after a finished job) unless the process group is gone first.
    PartialState().destroy_process_group()
    sys.exit(status)
