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

from ..eval import retention
from ..eval.selection import gap_closed
from ..job import (
    Accuracy,
    DraftAcceptance,
    MainJobArguments,  # noqa: F401  (moved to `tvopd_trl.job`; this import keeps working)
    apply_model_config,
    check_job_arguments,
    check_launch_options,
    check_recipe_launch,
    embedded_tools,
    hinted_reference,
    job_parser,
    load_job,
    tool_frequencies_of,
)


def main(job_args, training_args, model_args):
    from accelerate import PartialState
    from rich.console import Console

    from ..eval import BenchmarkEvalCallback, mean_at_k, step_dir
    from ..eval.callback import generation_model
    from ..plots import plot_run
    from ..trainer import TVOPDTrainer

    start = time.perf_counter()
    state = PartialState()
    check_job_arguments(job_args, training_args, model_args)
    servers = training_args.teacher_model_server_url
    student_path, teacher_path, tokenizer, train_dataset = load_job(job_args, training_args, model_args)
    # The evaluation renders its prompts as training does (`chat_template_kwargs`: Qwen3's `enable_thinking`)
    rendering = dict(chat_template_kwargs=training_args.chat_template_kwargs)
    accuracy = Accuracy(job_args, tokenizer, **rendering) if job_args.eval_problems > 0 else None
    # With `self_distillation` on a task with privileged context: the untrained student's accuracy with it shown is the
    # reference (the teacher's, elsewhere)
    reference = hinted_reference(job_args, training_args)
    hinted = Accuracy(job_args, tokenizer, benchmarks=[reference], **rendering) if reference else None
    control = None  # what the student could already do, answered greedily before and after (`control_retention`)
    if job_args.eval_control_benchmark and job_args.eval_problems > 0:
        control = Accuracy(job_args, tokenizer, benchmarks=[job_args.eval_control_benchmark], **rendering)
    draft = None  # the student as a speculative-decoding draft of its teacher, measured before and after
    if job_args.eval_acceptance_prompts > 0:
        if state.num_processes > 1:
            raise ValueError(
                "`eval_acceptance_prompts` measures the draft in one process: launch the job with one (or set it to 0)."
            )
        draft = DraftAcceptance(job_args, training_args.temperature, tokenizer, training_args.seed)
    local_teachers = teacher_sources = teacher_path
    if servers is not None:
        # `teacher_model_name_or_path` names the served teachers' tokenizers; its other names are local teachers.
        mixed = isinstance(servers, dict) and isinstance(teacher_path, dict)
        local_teachers = {name: path for name, path in teacher_path.items() if name not in servers} if mixed else None
        teacher_sources = {**local_teachers, **servers} if local_teachers else servers

    # Paths, not models: the trainer loads both with the config's `model_init_kwargs` / `teacher_model_init_kwargs`,
    # where the model arguments (`--dtype`, ...) go, and wraps the student in LoRA with `--use_peft`.
    model_options = apply_model_config(model_args, training_args)
    if job_args.trl_baseline:
        from ..trl_baseline import trl_baseline_trainer

        trainer = trl_baseline_trainer(
            student_path, teacher_path, training_args, train_dataset, tokenizer, **model_options
        )
    else:
        trainer = TVOPDTrainer(
            model=student_path,
            teacher_model=local_teachers or None,
            args=training_args,
            train_dataset=train_dataset,
            processing_class=tokenizer,
            teacher_processing_class=_teacher_tokenizers(teacher_path, training_args.trust_remote_code),
            tools=embedded_tools(job_args),
            **model_options,
        )
    trainer.dataset_name = job_args.dataset_name  # for the model card
    curve = None
    if accuracy is not None and job_args.eval_every_steps > 0:
        curve = BenchmarkEvalCallback(
            trainer,
            accuracy.names,
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
    scores = {}  # "student_accuracy_before", ..., "teacher_accuracy" -> {benchmark: accuracy}
    tools = {}  # "before" / "after" -> the student's tool-call frequencies at mean@k, with a tool loop
    teacher_scores = {}  # teacher name -> {benchmark: accuracy}
    # Every process evaluates, each a shard of the responses: a model sharded by ZeRO-3 or FSDP generates on all of them.
    sharded = dict(accelerator=trainer.accelerator)
    if accuracy is not None:
        # A served teacher is not in this process to evaluate; the student as its own teacher is evaluated with the hint
        if job_args.eval_teacher and training_args.self_distillation is None:
            for name, teacher in trainer.teachers.items():
                if teacher.served:
                    continue
                single = len(trainer.teachers) == 1
                teacher_dir = os.path.join(out, "eval", "teacher" if single else f"teacher-{name}")
                model_id = teacher_path if single else teacher_path[name]
                # A teacher of another family reads and writes its own tokens
                alignment = trainer.alignments.get(name)
                own = dict(sharded, tokenizer=alignment and alignment.teacher)
                with generation_model(trainer, teacher.model) as model:
                    teacher_scores[name] = accuracy.scores(model, False, teacher_dir, model_id=model_id, **own)
                    teacher_scores[f"{name}_greedy"] = accuracy.scores(model, greedy=True, **own)
            if teacher_scores:
                # A benchmark's teacher is the one that knows it best: with several teachers, the one routed its skill
                for suffix in ("", "_greedy"):
                    runs = [run for name, run in teacher_scores.items() if name.endswith("_greedy") == bool(suffix)]
                    best = {
                        benchmark.name: max(run[benchmark.name] for run in runs) for benchmark in accuracy.benchmarks
                    }
                    scores[f"teacher_accuracy{suffix}"] = best
        with generation_model(trainer) as student:
            scores["student_accuracy_before"] = accuracy.scores(
                student, output_dir=step_dir(out, 0, job_args.eval_k), model_id=os.path.abspath(out), **sharded
            )
            tools["before"] = accuracy.tools
            scores["student_accuracy_before_greedy"] = accuracy.scores(student, greedy=True, **sharded)
            if hinted is not None:  # recorded beside the teacher's records of a run with a teacher
                records = dict(output_dir=os.path.join(out, "eval", "student-hinted"), model_id=student_path)
                scores.update(_hinted_scores(hinted, accuracy, student, "student_accuracy_hinted", sharded, **records))
            if control is not None:
                control_before = control(
                    student, greedy=True, output_dir=_control_dir(out, 0), model_id=out, **sharded
                )
    drafts = {}  # "before" / "after" -> `draft`'s record
    if draft is not None:
        (drafting_for,) = trainer.teachers.values()
        with generation_model(trainer) as student, generation_model(trainer, drafting_for.model) as teacher:
            drafts["before"] = draft(student, teacher)
    train_start = time.perf_counter()
    trainer.train(resume_from_checkpoint=_resume_argument(training_args.resume_from_checkpoint))
    train_seconds = time.perf_counter() - train_start
    trainer.save_model(training_args.output_dir)

    # The curve: per benchmark, and averaged over them
    curves = [
        (step, {name: mean_at_k(result) for name, result in r["benchmarks"].items()})
        for step, r in (curve.history if curve else [])
    ]
    final_step = trainer.state.global_step
    if accuracy is not None:
        evaluated = dict(curves)
        with generation_model(trainer) as student:  # the trainer wrapped the student in `train`
            if final_step in evaluated:
                scores["student_accuracy_after"] = evaluated[final_step]
                tools["after"] = tool_frequencies_of(
                    dict(curve.history)[final_step], [benchmark.name for benchmark in accuracy.benchmarks]
                )
            else:
                scores["student_accuracy_after"] = accuracy.scores(
                    student,
                    output_dir=step_dir(out, final_step, job_args.eval_k),
                    model_id=os.path.abspath(out),
                    **sharded,
                )
                curves.append((final_step, scores["student_accuracy_after"]))
                tools["after"] = accuracy.tools
            scores["student_accuracy_after_greedy"] = accuracy.scores(student, greedy=True, **sharded)
            # The live teacher at the end: the trained student with its teacher prompt (a frozen one is the step-0
            # student, evaluated above)
            if hinted is not None and training_args.self_distillation == "live" and job_args.eval_teacher:
                scores.update(_hinted_scores(hinted, accuracy, student, "student_accuracy_hinted_after", sharded))
            if control is not None:
                after_dir = _control_dir(out, final_step)
                control_after = control(student, greedy=True, output_dir=after_dir, model_id=out, **sharded)
    if draft is not None:
        with generation_model(trainer) as student, generation_model(trainer, drafting_for.model) as teacher:
            drafts["after"] = draft(student, teacher)
    if state.is_main_process:
        if "student_accuracy_before" in scores:
            curves = [(0, scores["student_accuracy_before"]), *curves]
        results.update({key: sum(values.values()) / len(values) for key, values in scores.items()})
        history = [(step, sum(values.values()) / len(values)) for step, values in curves]
        reference_key = "student_accuracy_hinted" if hinted is not None else "teacher_accuracy"
        plots = plot_run(
            trainer.state.log_history,
            history,
            training_args.output_dir,
            results.get(reference_key),
            reference_label="student with its teacher prompt" if hinted is not None else "teacher",
        )
        if control is not None:
            (benchmark,) = control.benchmarks
            results["control_accuracy_before"], results["control_accuracy_after"] = control_before, control_after
            results["control_retention"] = retention(_control_dir(out, 0), after_dir, benchmark.name)
        last = next((e for e in reversed(trainer.state.log_history) if "tv/estimate" in e), {})
        scales = {key: value for key, value in last.items() if key.startswith("tv/") and key.endswith("/scale")}
        summary = {
            "advantage_mode": "trl" if job_args.trl_baseline else training_args.advantage_mode,
            "steps": trainer.state.global_step,
            "wall_seconds": time.perf_counter() - start,
            "train_seconds": train_seconds,
            **results,
            "gap_closed": _gap_closed(results),
            # Several benchmarks (the multi-teacher task's skills): each one's accuracies and gap
            **({"skills": _skills(scores)} if accuracy is not None and len(accuracy.benchmarks) > 1 else {}),
            **({"teachers": teacher_scores} if len(trainer.teachers) > 1 else {}),
            **{
                f"tool_{kind}_{when}": frequencies[kind]
                for when, frequencies in tools.items()
                if frequencies is not None
                for kind in ("call_frequency", "failure_frequency")
            },
            "final_tv_scale": last.get("tv/scale"),
            **({"final_tv_scales": scales} if len(scales) > 1 else {}),
            "final_tv_estimate": last.get("tv/estimate"),
            "final_tv_acceptance": last.get("tv/acceptance"),
            **{f"draft_{when}": record for when, record in drafts.items()},
            "accuracy_curve": history,
            **({"accuracy_curves": curves} if accuracy is not None and len(accuracy.benchmarks) > 1 else {}),
            "student": student_path,
            "teacher": teacher_sources,
            "self_distillation": training_args.self_distillation,
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


def _teacher_tokenizers(teacher_path, trust_remote_code):
    def load(path):
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)

    if isinstance(teacher_path, dict):
        return {name: load(path) for name, path in teacher_path.items()}
    return load(teacher_path) if teacher_path else None


def _skills(scores):
    """Per benchmark: the student's accuracies before and after, its teacher's, and the gap closed there."""
    benchmarks = scores["student_accuracy_before"]
    skills = {name: {key: values[name] for key, values in scores.items()} for name in benchmarks}
    for skill in skills.values():
        skill["gap_closed"] = _gap_closed(skill)
    return skills


def _hinted_scores(hinted, accuracy, student, key, sharded, output_dir=None, model_id=None):
    """The student's mean@k (under `key`, its records in `output_dir`) and greedy accuracy (`<key>_greedy`) with the
    hint shown (`hinted`'s benchmark), keyed by the job's own benchmark, the same problems without it."""
    (name,) = [benchmark.name for benchmark in accuracy.benchmarks]
    return {
        key: {name: hinted(student, output_dir=output_dir, model_id=model_id, **sharded)},
        f"{key}_greedy": {name: hinted(student, greedy=True, **sharded)},
    }


def _control_dir(output_dir, step):
    """Where the control benchmark's greedy records at `step` go (`MainJobArguments.eval_control_benchmark`)."""
    return os.path.join(output_dir, "eval", "control", f"step-{step}")


def _gap_closed(results):
    """(after - before) / (reference - before): the share of the gap the run closed to its reference, the teacher's
    accuracy, or with self-distillation on a task with privileged context the untrained student's accuracy with that
    context shown (`student_accuracy_hinted`)."""
    reference = "student_accuracy_hinted" if "student_accuracy_hinted" in results else "teacher_accuracy"
    keys = ("student_accuracy_before", "student_accuracy_after", reference)
    if any(key not in results for key in keys):
        return None
    return gap_closed(*(results[key] for key in keys))


def _summary_table(summary):
    from rich.table import Table

    args = summary["job_args"]
    table = Table(title=f"TV-OPD main job ({summary['advantage_mode']}, {summary['steps']} steps)")
    table.add_column("held-out accuracy", justify="left")

    def fmt(value):
        return "-" if value is None else f"{100 * value:.1f}%"

    skills = summary.get("skills")
    if skills:  # mean@k per skill, and each teacher on every skill
        for skill in skills:
            table.add_column(f"{skill} mean@{args['eval_k']}", justify="right")
        for label, key in (("student before", "student_accuracy_before"), ("student after", "student_accuracy_after")):
            table.add_row(label, *(fmt(skill.get(key)) for skill in skills.values()))
        for name, run in summary.get("teachers", {}).items():
            if not name.endswith("_greedy"):
                table.add_row(f"teacher {name}", *(fmt(run.get(skill)) for skill in skills))
        if "teachers" not in summary:
            table.add_row("teacher", *(fmt(skill.get("teacher_accuracy")) for skill in skills.values()))
        return table
    table.add_column(f"mean@{args['eval_k']}", justify="right")
    table.add_column("greedy", justify="right")
    for label, key in (("student before", "student_accuracy_before"), ("student after", "student_accuracy_after")):
        table.add_row(label, fmt(summary.get(key)), fmt(summary.get(f"{key}_greedy")))
    if "student_accuracy_hinted" in summary:  # self-distillation: the reference is the student with its teacher prompt
        for label, key in (("with its teacher prompt, before", ""), ("with its teacher prompt, after", "_after")):
            hinted = f"student_accuracy_hinted{key}"
            if hinted in summary:  # after: a live teacher's only
                table.add_row(label, fmt(summary[hinted]), fmt(summary.get(f"{hinted}_greedy")))
    else:
        table.add_row("teacher", fmt(summary.get("teacher_accuracy")), fmt(summary.get("teacher_accuracy_greedy")))
    if "tool_call_frequency_before" in summary:  # a tool loop's evaluation: how often the student calls, at mean@k
        calls = [summary.get(f"tool_call_frequency_{when}") for when in ("before", "after")]
        table.add_row("tool calls per answer, before -> after", " -> ".join(f"{c:.2f}" for c in calls), "")
    if "control_retention" in summary:  # the control benchmark, greedy: before -> after, and what was kept
        control = " -> ".join(fmt(summary[f"control_accuracy_{when}"]) for when in ("before", "after"))
        table.add_row(f"control ({args['eval_control_benchmark']}), before -> after", "", control)
        table.add_row("control answers kept", "", fmt(summary["control_retention"]))
    return table


def _summary_footer(summary, output_dir):
    args, gap, scale = summary["job_args"], summary.get("gap_closed"), summary.get("final_tv_scale")

    def percent(value):
        return "-" if value is None else f"{100 * value:.0f}%"

    gaps = f"gap closed: {percent(gap)}"
    if summary.get("skills"):
        gaps += " (" + ", ".join(f"{name} {percent(skill['gap_closed'])}" for name, skill in summary["skills"].items())
        gaps += ")"
    scales = summary.get("final_tv_scales")
    if scales:
        scale_text = "final " + ", ".join(f"{key} {value:.3f}" for key, value in scales.items())
    else:
        scale_text = f"final tv/scale {'-' if scale is None else f'{scale:.3f}'}"
    drafts = [summary[key] for key in ("draft_before", "draft_after") if key in summary]
    draft_text = ""
    if drafts:
        draft_text = (
            f"as a draft (gamma {drafts[0]['gamma']}, {args['eval_acceptance_prompts']} prompts): acceptance "
            + " -> ".join(f"{d['acceptance']:.3f}" for d in drafts)
            + ", speedup "
            + " -> ".join(f"{d['speedup']:.2f}x" for d in drafts)
            + " on this machine\n"
        )
    return (
        f"{args['eval_problems']} held-out problems, sampled at T={args['eval_temperature']}, top-p "
        f"{args['eval_top_p']}, top-k {args['eval_top_k']}\n"
        f"{draft_text}{gaps} · {scale_text} · {summary['wall_seconds']:.0f} s\n"
        f"plots and summary.json in {output_dir}"
    )


def make_parser(prog=None):
    return job_parser(prog=prog)


def run(argv=None):
    parser = make_parser(prog="tvopd-trl train")
    job_args, training_args, model_args, remaining = parser.parse_args_and_config(
        args=argv, return_remaining_strings=True
    )
    check_launch_options(remaining)  # `accelerate launch` settings in a recipe are for `tvopd-trl train`
    check_recipe_launch(remaining)
    main(job_args, training_args, model_args)
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
