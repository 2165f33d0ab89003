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
"""A study: a grid of (method x seed) runs of the main job, run a few at a time and resumed where it stopped.

A study file (`recipes/tiny/study.yaml`, packaged as `tiny/study`) names the main job's recipe, the settings every
run shares, the methods (each a set of recipe overrides) and the seeds. Run `i` of the grid lives in
`<output_dir>/<method>/seed-<seed>/`; it is finished when it holds `summary.json`, which the main job writes last. A run folder without one was interrupted: it is
cleared and run again. A finished run whose settings differ from the study's is an error, never silently reused.
"""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field


ANALYSIS_KEYS = {
    "late_window",
    "stages",
    "main_methods",
    "alpha_sweep",
    "magnitude_ablation",
    "stage_methods",
    "curve_methods",
    "dynamics_methods",
    "update_norm_methods",
}


@dataclass
class Study:
    """A parsed study file. `methods` maps a folder name to `{"name": title, **recipe overrides}`. With
    `rollout_server` (a model path, or `embedded_vllm` for the vLLM-ready embedded student), every run gets a vLLM
    server of its own, started for it on a free loopback port (`tvopd_trl.testing.LocalVLLMServer`) and stopped after
    it: the recipe's server-mode rollouts go there."""

    recipe: str
    output_dir: str
    results_dir: str
    seeds: list
    methods: dict
    parallel: int = 2
    overrides: dict = field(default_factory=dict)
    analysis: dict = field(default_factory=dict)
    rollout_server: str | None = None


@dataclass
class Run:
    method: str
    name: str
    seed: int
    directory: str
    settings: dict

    @property
    def finished(self):
        return os.path.isfile(os.path.join(self.directory, "summary.json"))


def load_study(path):
    """Parses a study file as data (`yaml.safe_load`), refusing unknown keys and methods without a name."""
    import yaml

    from .packaged_recipes import find_recipe

    with open(find_recipe(path)) as f:
        raw = yaml.safe_load(f)
    known = set(Study.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; a study file has {sorted(known)}.")
    study = Study(**raw)
    study.source = path  # for the results' README
    for slug, method in study.methods.items():
        if not isinstance(method, dict) or "name" not in method:
            raise ValueError(f"{path}: method {slug!r} needs a `name` (its title in tables) and its recipe overrides.")
    # A study across skills (several teachers) and one against a single teacher have their own analyses.
    if not {"skills", "metric_methods", "span_metrics"} & set(study.analysis):
        missing = sorted(ANALYSIS_KEYS - set(study.analysis))
        if missing:
            raise ValueError(f"{path}: `analysis` lacks {missing}.")
    for key, value in study.analysis.items():
        unknown = sorted(set(value) - set(study.methods)) if key.endswith(("methods", "sweep", "ablation")) else []
        if unknown:
            raise ValueError(f"{path}: analysis.{key} names methods {unknown} that `methods` does not define.")
    try:
        recipe = find_recipe(study.recipe)  # the runs' `--config`, which takes a packaged recipe's name too
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path}: the recipe {study.recipe} does not exist, as a file (relative to the cwd) or as a packaged "
            "recipe (`tvopd-trl recipes` lists those)."
        ) from None
    if "skills" in study.analysis:
        _check_skills(path, study, recipe)
    return study


def _check_skills(path, study, recipe):
    """The skills of an analysis across skills are benchmarks that every run evaluates, with its teachers."""
    import yaml

    with open(recipe) as f:
        shared = {**yaml.safe_load(f), **study.overrides}
    for slug, method in study.methods.items():
        settings = {**shared, **method}
        benchmarks = [name.strip() for name in str(settings.get("eval_benchmark", "tiny")).split(",")]
        unknown = sorted(set(study.analysis["skills"]) - set(benchmarks))
        if unknown:
            raise ValueError(
                f"{path}: analysis.skills names {unknown}, which method {slug!r} does not evaluate (its "
                f"`eval_benchmark`: {', '.join(benchmarks)})."
            )
        if settings.get("eval_teacher", True) is False:
            raise ValueError(
                f"{path}: method {slug!r} sets `eval_teacher: false`; an analysis across skills measures each skill's "
                "gap to its teacher."
            )


def grid(study):
    """Every run of the study, method by method."""
    runs = []
    for slug, method in study.methods.items():
        overrides = {key: value for key, value in method.items() if key != "name"}
        for seed in study.seeds:
            directory = os.path.join(study.output_dir, slug, f"seed-{seed}")
            settings = {**study.overrides, **overrides, "seed": seed, "output_dir": directory}
            runs.append(Run(slug, method["name"], seed, directory, settings))
    return runs


def _flags(settings):
    flags = []
    for key, value in settings.items():
        text = (
            json.dumps(value)
            if isinstance(value, dict | list)
            else str(value).lower()
            if isinstance(value, bool)
            else str(value)
        )
        flags += [f"--{key}", text]
    return flags


def _check_settings(study, run):
    """A finished run must have been made with the settings the study asks for now."""
    with open(os.path.join(run.directory, "study_run.json")) as f:
        recorded = json.load(f)
    expected = {"recipe": study.recipe, "settings": run.settings}
    if recorded != expected:
        changed = sorted(
            key
            for key in set(recorded["settings"]) | set(run.settings)
            if recorded["settings"].get(key) != run.settings.get(key)
        )
        raise ValueError(
            f"{run.directory} was run with other settings ({changed or 'the recipe'} differ). Give the study another "
            "output_dir, or delete that run to redo it."
        )


@contextlib.contextmanager
def _rollout_server(study, run):
    """The URL of the run's own rollout server (see `Study`), or None without one."""
    if study.rollout_server is None:
        yield None
        return
    from .testing import LocalVLLMServer
    from .tiny import vllm_paths

    model = vllm_paths()["student"] if study.rollout_server == "embedded_vllm" else study.rollout_server
    server = LocalVLLMServer(model, run.directory)
    try:
        yield server.wait_ready().url
    finally:
        server.stop()


def _execute(study, run, log):
    if os.path.isdir(run.directory):
        log(f"{run.directory}: interrupted earlier, starting it again")
        shutil.rmtree(run.directory)
    os.makedirs(run.directory)
    with open(os.path.join(run.directory, "study_run.json"), "w") as f:
        json.dump({"recipe": study.recipe, "settings": run.settings}, f, indent=2)
    command = [sys.executable, "-m", "tvopd_trl.scripts.train", "--config", study.recipe, *_flags(run.settings)]
    start = time.perf_counter()
    with _rollout_server(study, run) as url, open(os.path.join(run.directory, "train.log"), "w") as output:
        # One thread per run: `parallel` runs share the cores without oversubscribing them.
        result = subprocess.run(
            command + ([] if url is None else ["--vllm_server_base_url", url]),
            stdout=output,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    if result.returncode != 0:
        raise RuntimeError(
            f"{run.method} seed {run.seed} failed (exit {result.returncode}): see {run.directory}/train.log"
        )
    return time.perf_counter() - start


def run_grid(study, log=print):
    """Runs every unfinished run of the grid, `study.parallel` at a time; returns {(method, seed): seconds} of the runs
    it executed (empty when the grid was already complete)."""
    from tqdm.auto import tqdm

    runs = grid(study)
    for run in runs:
        if run.finished:
            _check_settings(study, run)
    pending = [run for run in runs if not run.finished]
    log(
        f"{len(runs) - len(pending)} of {len(runs)} runs already finished; {len(pending)} to run, {study.parallel} at a time"
    )
    seconds = {}
    if not pending:
        return seconds
    with ThreadPoolExecutor(study.parallel) as pool, tqdm(total=len(pending), desc="study runs") as bar:
        futures = {pool.submit(_execute, study, run, log): run for run in pending}
        for future, run in futures.items():
            seconds[(run.method, run.seed)] = future.result()
            bar.update()
    return seconds


# ----------------------------------------------------------------------------------------------------------------------
# Analysis: the paper's tables and figures from a finished grid
# ----------------------------------------------------------------------------------------------------------------------


def _steps(window):
    first, last, stride = window
    return tuple(range(first, last + 1, stride))


def _history_series(log_history, key):
    return {entry["step"]: entry[key] for entry in log_history if isinstance(entry.get(key), int | float)}


def job_setting(study, key):
    """A main-job argument of the study's runs: the study's override, else its recipe's value, else the default."""
    import yaml

    from .job import MainJobArguments
    from .packaged_recipes import find_recipe

    if key in study.overrides:
        return study.overrides[key]
    with open(find_recipe(study.recipe)) as f:
        return yaml.safe_load(f).get(key, getattr(MainJobArguments, key))


def eval_k(study):
    """The runs' samples per problem (`job_setting`)."""
    return job_setting(study, "eval_k")


def load_results(study):
    """`{method: [{"seed", "accuracy": {step: mean@k}, "log_history", "summary"}]}` of the finished grid."""
    from .eval.selection import load_run

    runs = grid(study)
    unfinished = [run.directory for run in runs if not run.finished]
    if unfinished:
        raise ValueError(
            f"{len(unfinished)} of {len(runs)} runs are not finished (e.g. {unfinished[0]}): run the study to the end "
            "first (it resumes where it stopped)."
        )
    benchmark = job_setting(study, "eval_benchmark")
    skills = study.analysis.get("skills", {benchmark: benchmark})
    results = {}
    for run in runs:
        with open(os.path.join(run.directory, "log_history.json")) as f:
            log_history = json.load(f)
        with open(os.path.join(run.directory, "summary.json")) as f:
            summary = json.load(f)
        evaluations = load_run(run.directory, eval_k(study))
        by_skill = {skill: {step: scores[skill] for step, scores in evaluations.items()} for skill in skills}
        results.setdefault(run.method, []).append(
            {
                "seed": run.seed,
                "accuracy": {
                    step: sum(scores[s] for s in skills) / len(skills) for step, scores in evaluations.items()
                },
                "by_skill": by_skill,
                "log_history": log_history,
                "summary": summary,
            }
        )
    return results


def _aggregate(values):
    from .eval.selection import mean_std

    return mean_std(values)


def retention_rows(study, results, methods):
    """Per method: selected-checkpoint, final, LateMean and PeakDrop accuracy, (mean, std) across seeds."""
    from .eval.tables import main_results_row, retention_row

    window = _steps(study.analysis["late_window"])
    benchmark = job_setting(study, "eval_benchmark")
    rows = {}
    for method in methods:
        series = [run["accuracy"] for run in results[method]]
        runs = [{step: {benchmark: value} for step, value in s.items()} for s in series]
        retention = retention_row(series, window)
        rows[study.methods[method]["name"]] = {
            "selected": main_results_row(runs, [benchmark])[0]["avg"],
            "final": _aggregate(s[max(s)] for s in series),
            "late_mean": retention["LateMean"],
            "peak_drop": retention["PeakDrop"],
        }
    return rows


def stage_rows(study, results, methods):
    from .eval.tables import stage_row

    stages = {name: tuple(bounds) for name, bounds in study.analysis["stages"].items()}
    return {
        study.methods[method]["name"]: stage_row([run["accuracy"] for run in results[method]], stages)
        for method in methods
    }


def magnitude_rows(study, results, methods):
    """Per-run best-over-training and trajectory average on the steps every run evaluated (the paper's appendix)."""
    from .eval.selection import align_runs, best_over_training, trajectory_average

    labelled = {(method, i): run["accuracy"] for method in methods for i, run in enumerate(results[method])}
    aligned = align_runs(labelled, "common")
    rows = {}
    for method in methods:
        series = [aligned.runs[(method, i)] for i in range(len(results[method]))]
        rows[study.methods[method]["name"]] = {
            "best": _aggregate(best_over_training(s) for s in series),
            "trajectory": _aggregate(trajectory_average(s) for s in series),
        }
    return rows, aligned.note


def first_batch_delta(study):
    """delta of the sampled tokens of the study's first rollout batch (the first run's settings), from the untrained
    student, with -inf clamped as the advantages clamp it: the input of the dispersion case study."""
    import tempfile

    from .advantages import LOG_FLOAT32_TINY
    from .delta import token_delta
    from .doctor import rollouts
    from .job import apply_model_config, job_parser, load_job
    from .trainer import TVOPDTrainer

    with tempfile.TemporaryDirectory() as output_dir:
        flags = _flags({**grid(study)[0].settings, "output_dir": output_dir, "report_to": "none"})
        job_args, training_args, model_args = job_parser().parse_args_and_config(
            args=["--config", study.recipe, *flags], fail_with_unknown_args=False
        )[:3]
        student, teacher, tokenizer, dataset = load_job(job_args, training_args, model_args)
        options = apply_model_config(model_args, training_args)
        trainer = TVOPDTrainer(
            model=student,
            teacher_model=teacher,
            args=training_args,
            train_dataset=dataset,
            processing_class=tokenizer,
            **options,
        )
        rollout = rollouts(trainer, next(iter(trainer.get_train_dataloader())))
    delta, active = token_delta(rollout["teacher_logps"], rollout["old_logps"], rollout["active"])
    return delta.clamp(min=LOG_FLOAT32_TINY)[active]


def _curves(study, results, methods, key=None):
    """`{title: [{step: value} per seed]}`: accuracy, or a logged metric `key`."""
    return {
        study.methods[method]["name"]: [
            run["accuracy"] if key is None else _history_series(run["log_history"], key) for run in results[method]
        ]
        for method in methods
    }


def _scale_curves(study, results, metric="scale"):
    """`{"method, teacher": [{step: value} per seed]}` of every TV scheduler's `metric`: each teacher's
    (`tv/<teacher>/<metric>`) where a run has one per teacher, else the pooled one (`tv/<metric>`)."""
    curves = {}
    for method, runs in results.items():
        keys = sorted({key for run in runs for entry in run["log_history"] for key in entry})
        per_teacher = [key for key in keys if key.startswith("tv/") and key.count("/") == 2 and key.endswith(metric)]
        for key in per_teacher or [f"tv/{metric}"]:
            label = study.methods[method]["name"] + (f", {key.split('/')[1]}" if per_teacher else "")
            curves[label] = [_history_series(run["log_history"], key) for run in runs]
    return curves


def analyze_skills(study, results):
    """A study across skills: per skill, each method's accuracy before and after and the share of the gap it closed
    (mean ± std over seeds), its accuracy curves, and every TV scheduler's c_k and estimate."""
    from .eval.selection import gap_closed
    from .eval.tables import format_table
    from .plots import plot_curves

    out = study.results_dir
    skills = study.analysis["skills"]
    # The gap is to the skill's best teacher in the study: a method whose teacher is wrong on a skill has not closed
    # that skill's gap by matching its teacher there.
    best = {
        skill: max(run["summary"]["skills"][skill]["teacher_accuracy"] for runs in results.values() for run in runs)
        for skill in skills
    }
    rows = {}
    for method, runs in results.items():
        row = {}
        for skill in skills:
            summaries = [run["summary"]["skills"][skill] for run in runs]
            row[f"{skill}/before"] = _aggregate(s["student_accuracy_before"] for s in summaries)
            row[f"{skill}/after"] = _aggregate(s["student_accuracy_after"] for s in summaries)
            gaps = [
                gap_closed(s["student_accuracy_before"], s["student_accuracy_after"], best[skill]) for s in summaries
            ]
            gaps = [gap for gap in gaps if gap is not None]
            row[f"{skill}/gap"] = _aggregate(gaps) if gaps else None
        rows[study.methods[method]["name"]] = row
    columns = [f"{skill}/{column}" for skill in skills for column in ("before", "after", "gap")]
    header = {
        f"{skill}/{column}": f"{title} {label}"
        for skill, title in skills.items()
        for column, label in (("before", "before"), ("after", "after"), ("gap", "gap closed"))
    }
    k = eval_k(study)
    table = format_table(rows, columns, header=header)
    teacher_note = "; ".join(f"{skills[skill]} {100 * accuracy:.1f}%" for skill, accuracy in best.items())
    tables = (
        f"### Accuracy per skill\n\nHeld-out mean@{k} (%) before and after training, and the share of the gap to the "
        f"skill's best teacher ({teacher_note}) that training closed, mean ± sample std over seeds {study.seeds}. "
        f"Bold best, underlined second.\n\n{table}\n"
    )
    for skill, title in skills.items():
        curves = {study.methods[m]["name"]: [run["by_skill"][skill] for run in runs] for m, runs in results.items()}
        plot_curves(curves, os.path.join(out, f"accuracy_{skill}.png"), f"{title}: held-out mean@{k}")
    plot_curves(_scale_curves(study, results), os.path.join(out, "tv_scale.png"), "c_k per TV scheduler", "c_k", 1)
    plot_curves(
        _scale_curves(study, results, "estimate"),
        os.path.join(out, "tv_estimate.png"),
        "On-policy TV estimate per teacher",
        "total variation",
        1,
    )
    figures = [f"accuracy_{skill}.png" for skill in skills] + ["tv_scale.png", "tv_estimate.png"]
    return {"Accuracy per skill": rows}, tables, figures


def analyze_against_teacher(study, results):
    """A study against one teacher (the task reward's, the asynchronous rollouts'), or against the student's own
    accuracy with privileged context shown (self-distillation's reference, `student_accuracy_hinted`): each method's
    retention numbers, gap closed and wall time beside the reference's accuracy, its accuracy curves, a figure per
    logged metric of `analysis.metric_curves` (`{file name: metric}`) for the methods of `analysis.metric_methods`, and
    each run's mean over training of the metrics of `analysis.metric_means` (`{column title: metric}`)."""
    from .eval.tables import format_table
    from .plots import plot_curves

    out, k, analysis = study.results_dir, eval_k(study), study.analysis
    summaries = [run["summary"] for runs in results.values() for run in runs]
    own = all("student_accuracy_hinted" in summary for summary in summaries)
    reference_key = "student_accuracy_hinted" if own else "teacher_accuracy"
    reference = "Student with its teacher prompt (step 0)" if own else "Teacher"
    reference_accuracy = _aggregate(summary[reference_key] for summary in summaries)
    student = _aggregate(runs[0]["accuracy"][0] for runs in results.values())
    rows = retention_rows(study, results, list(study.methods))
    header = {"selected": "Selected", "final": "Final", "late_mean": "LateMean", "peak_drop": "PeakDrop"}
    extra = {
        "gap_closed": "Gap closed",
        "student_accuracy_hinted_after": "With its teacher prompt, after",
        "control_accuracy_after": "Control, after",
        "control_retention": "Control kept",
    }
    # A column where some method has it (a live self-teacher's prompted accuracy after training; a frozen one has none)
    header |= {key: title for key, title in extra.items() if any(key in summary for summary in summaries)}
    header["minutes"] = "Wall time (min)"
    for method, runs in results.items():
        row = rows[study.methods[method]["name"]]
        for key in header.keys() & extra.keys():
            if all(key in r["summary"] for r in runs):
                row[key] = _aggregate(r["summary"][key] for r in runs)
        # minutes, divided by the table's percent scale
        row["minutes"] = _aggregate(r["summary"]["wall_seconds"] / 6000 for r in runs)
    fixed = {
        reference: {"selected": reference_accuracy, "final": reference_accuracy},
        "Student (step 0)": {"selected": student, "final": student},
    }
    if "control_accuracy_after" in header:  # the control benchmark before training, in its column
        before = _aggregate(
            summary["control_accuracy_before"] for summary in summaries if "control_accuracy_before" in summary
        )
        fixed["Student (step 0)"]["control_accuracy_after"] = before
    table = format_table(rows, list(header), header=header, lower_is_better=("peak_drop", "minutes"), fixed_rows=fixed)
    window = list(_steps(analysis["late_window"]))
    title = "Against the student with its teacher prompt" if own else "Against the teacher"
    tables = [
        f"### {title}\n\nHeld-out mean@{k} (%), mean ± sample std over seeds {study.seeds}; LateMean over "
        f"steps {window}, PeakDrop = max over steps - LateMean (lower is better); gap closed = (final - student at step 0) "
        f"/ (first row - student at step 0); wall time of each run, on a machine running {study.parallel} at a time. Bold "
        f"best, underlined second.\n\n{table}\n"
    ]
    numbers = {title: rows, reference: reference_accuracy}
    means = analysis.get("metric_means", {})
    if means:
        dynamics = {}
        for method, runs in results.items():
            per_run = {metric: [_run_mean(r["log_history"], metric) for r in runs] for metric in means.values()}
            dynamics[study.methods[method]["name"]] = {
                metric: None if None in values else _aggregate(values) for metric, values in per_run.items()
            }
        numbers["Over training"] = dynamics
        table = format_table(
            dynamics,
            list(means.values()),
            header={v: t for t, v in means.items()},
            highlight="none",
            scale=1,
            digits=3,
        )
        tables.append(
            "### Over training\n\nEach run's mean over its logged steps, then mean ± sample std over seeds ("
            + ", ".join(f"{t}: `{metric}`" for t, metric in means.items())
            + f"; — where a method does not log it).\n\n{table}\n"
        )
    plot_curves(_curves(study, results, list(study.methods)), os.path.join(out, "curves.png"), f"Held-out mean@{k}")
    figures = ["curves.png"]
    for name, metric in analysis.get("metric_curves", {}).items():
        curves = _curves(study, results, analysis["metric_methods"], metric)
        plot_curves(curves, os.path.join(out, name), metric, ylabel=metric, scale=1)
        figures.append(name)
    return numbers, "\n".join(tables), figures


# A teacher with another tokenizer's alignment statistics, each run's mean over its logged steps (`span_metrics`)
SPAN_METRICS = {
    "student_tokens_per_span": "Student tokens / span",
    "teacher_tokens_per_span": "Teacher tokens / span",
    "max_span_tokens": "Largest span (student tokens)",
    "masked_fraction": "Masked fraction (%)",
}


def _run_mean(log_history, key):
    values = [value for value in _history_series(log_history, key).values() if value is not None]
    return sum(values) / len(values) if values else None


def analyze_span_metrics(study, results):
    """A study across teachers of other families (`analysis.span_metrics`): per method, the share of its own teacher's
    gap it closed, its retention numbers, the alignment's span statistics and the final TV scale, and its accuracy and
    TV-scale curves."""
    from .eval.tables import format_table
    from .plots import plot_curves

    out, k = study.results_dir, eval_k(study)
    methods = list(study.methods)
    rows = retention_rows(study, results, methods)
    spans = {}
    for method in methods:
        runs, name = results[method], study.methods[method]["name"]
        rows[name]["gap_closed"] = _aggregate(run["summary"]["gap_closed"] for run in runs)
        rows[name]["teacher"] = _aggregate(run["summary"]["teacher_accuracy"] for run in runs)
        means = {
            key: [_run_mean(run["log_history"], f"cross_tokenizer/{key}") for run in runs] for key in SPAN_METRICS
        }
        # The masked fraction in percent, as its column says
        scales = {"masked_fraction": 100}
        spans[name] = {
            key: None if None in values else _aggregate(scales.get(key, 1) * value for value in values)
            for key, values in means.items()
        }
        spans[name]["scale"] = _aggregate(
            _history_series(run["log_history"], "tv/scale")[max(run["accuracy"])] for run in runs
        )
    header = {
        "teacher": "Teacher",
        "gap_closed": "Gap closed",
        "final": "Final",
        "late_mean": "LateMean",
        "peak_drop": "PeakDrop",
    }
    window = list(_steps(study.analysis["late_window"]))
    accuracy = format_table(rows, list(header), header=header, lower_is_better=("peak_drop",))
    span_header = {**SPAN_METRICS, "scale": "Final tv/scale"}
    span_table = format_table(spans, list(span_header), header=span_header, highlight="none", scale=1.0, digits=3)
    tables = (
        f"### Against each method's own teacher\n\nHeld-out mean@{k} (%), mean ± sample std over seeds {study.seeds}: "
        "the teacher's accuracy, the share of the gap between the student's and its teacher's accuracy closed at the "
        f"end, the final accuracy, LateMean over steps {window} and PeakDrop = max over steps - LateMean (lower is "
        f"better). Bold best, underlined second.\n\n{accuracy}\n\n### The alignment\n\nEach run's mean over its "
        "logged steps of the `cross_tokenizer/*` metrics (none for a teacher of the student's family: its tokens are "
        f"its spans), then mean ± std over seeds; the TV scale c_k at the last step.\n\n{span_table}\n"
    )
    plot_curves(_curves(study, results, methods), os.path.join(out, "curves.png"), f"Held-out mean@{k}")
    tv_scale = _curves(study, results, methods, "tv/scale")
    plot_curves(tv_scale, os.path.join(out, "tv_scale.png"), "tv/scale", ylabel="tv/scale", scale=1)
    return {"Against each teacher": rows, "Alignment": spans}, tables, ["curves.png", "tv_scale.png"]


def analyze(study, log=print):
    """Writes the study's tables (Markdown, and all numbers in `results.json`) and figures into `study.results_dir`."""
    from .eval.tables import format_table
    from .metrics import advantage_dispersion
    from .plots import plot_curves, plot_dispersion

    results = load_results(study)
    out = study.results_dir
    os.makedirs(out, exist_ok=True)
    analysis = study.analysis
    for key, analysis_of in (
        ("skills", analyze_skills),
        ("metric_methods", analyze_against_teacher),
        ("span_metrics", analyze_span_metrics),
    ):
        if key in analysis:
            numbers, tables, figures = analysis_of(study, results)
            return _write_results(study, results, numbers, [tables], figures, log)
    header = {
        "selected": "Selected",
        "final": "Final",
        "late_mean": "LateMean",
        "peak_drop": "PeakDrop",
        "best": "Best over training",
        "trajectory": "Trajectory avg.",
    }
    student = _aggregate(runs[0]["accuracy"][0] for runs in results.values())
    k = eval_k(study)
    tables, numbers = [], {}

    def add(title, rows, columns, note, **options):
        numbers[title] = rows
        table = format_table(rows, columns, header=header, lower_is_better=("peak_drop",), **options)
        tables.append(f"### {title}\n\n{note}\n\n{table}")

    every = list(study.methods)
    add(
        "Main results",
        retention_rows(study, results, analysis["main_methods"]),
        ["selected", "final", "late_mean", "peak_drop"],
        f"Held-out mean@{k} (%), mean ± sample std over seeds {study.seeds}. Selected: the checkpoint with the highest "
        "accuracy (earliest on ties), as the paper selects; PeakDrop: lower is better. Bold best, underlined second.",
        fixed_rows={"Student (step 0)": {"selected": student, "final": student}},
    )
    add(
        "Retention, every method",
        retention_rows(study, results, every),
        ["selected", "final", "late_mean", "peak_drop"],
        f"LateMean over steps {list(_steps(analysis['late_window']))}; PeakDrop = max over steps - LateMean.",
    )
    stages = stage_rows(study, results, analysis["stage_methods"])
    numbers["Stage-wise"] = stages
    tables.append(
        "### Stage-wise accuracy\n\n"
        + ", ".join(f"{name}: steps {a}..{b}" for name, (a, b) in analysis["stages"].items())
        + ". Bold: each method's best stage.\n\n"
        + format_table(stages, list(analysis["stages"]), highlight="rows")
    )
    add(
        "Alpha sweep",
        retention_rows(study, results, analysis["alpha_sweep"]),
        ["selected", "final", "late_mean", "peak_drop"],
        "Sign-TV is alpha = 0; `c_k on lr` applies the alpha = 0.5 scale to the learning rate instead of the advantage.",
    )
    magnitude, note = magnitude_rows(study, results, analysis["magnitude_ablation"])
    add("Magnitude ablation", magnitude, ["best", "trajectory"], f"Per-run values, then mean ± std; {note}.")

    dynamics = analysis["dynamics_methods"]
    exact = {
        f"{study.methods[m]['name']}, exact": _curves(study, results, [m], "tv/exact")[study.methods[m]["name"]]
        for m in dynamics
    }
    figures = {
        "curves.png": (_curves(study, results, analysis["curve_methods"]), "Training dynamics", {}),
        "alpha_sweep.png": (_curves(study, results, analysis["alpha_sweep"]), "Alpha sweep", {}),
        "magnitude_ablation.png": (_curves(study, results, analysis["magnitude_ablation"]), "Magnitude ablation", {}),
        "tv_scale.png": (
            _curves(study, results, dynamics, "tv/scale"),
            "tv/scale (c_k)",
            {"ylabel": "c_k", "scale": 1},
        ),
        "tv_estimate.png": (
            {**_curves(study, results, dynamics, "tv/estimate"), **exact},
            "On-policy TV estimate and exact TV",
            {"ylabel": "total variation", "scale": 1},
        ),
        "update_norm.png": (
            _curves(study, results, analysis["update_norm_methods"], "update/norm"),
            "update/norm = ||theta_k+1 - theta_k||",
            {"ylabel": "update norm", "scale": 1},
        ),
    }
    for name, (curves, title, options) in figures.items():
        plot_curves(curves, os.path.join(out, name), title, **options)

    delta = first_batch_delta(study)
    abs_delta = delta.abs()
    dispersion = {**advantage_dispersion(abs_delta), "pooled_std": delta.double().std().item()}
    numbers["Dispersion (first batch)"] = {**dispersion, "tokens": abs_delta.numel()}
    plot_dispersion(abs_delta, os.path.join(out, "dispersion.png"), "Raw-advantage dispersion, first rollout batch")
    tables.append(
        "### Dispersion of the first batch\n\n| statistic | ours | paper |\n| --- | ---: | ---: |\n"
        + "\n".join(
            f"| {label} | {dispersion[key]:.3g} | {paper} |"
            for label, key, paper in (
                ("pooled std of A", "pooled_std", "1.34"),
                ("median abs(A)", "abs_median", "0.106"),
                ("p99 abs(A)", "abs_p99", "6.47"),
                ("max abs(A)", "abs_max", "34.58"),
                ("top-1% energy share", "top1pct_energy", "0.414"),
                ("top-10% energy share", "top10pct_energy", "0.903"),
            )
        )
        + f"\n\n{abs_delta.numel()} sampled tokens.\n"
    )

    figures = [*figures, "dispersion.png"]
    return _write_results(study, results, numbers, tables, figures, log)


def _write_results(study, results, numbers, tables, figures, log):
    out = study.results_dir
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(
            {
                "aggregates": numbers,
                "runs": {
                    m: [{k: r[k] for k in ("seed", "accuracy", "by_skill")} for r in runs]
                    for m, runs in results.items()
                },
            },
            f,
            indent=1,
        )
    with open(os.path.join(out, "tables.md"), "w") as f:
        f.write("\n".join(tables))
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(_readme(study, results, "\n".join(tables), figures))
    log(f"tables, figures and results.json in {out}")
    return numbers


def wall_times(study):
    """(elapsed seconds from the first run's start to the last run's end, sum of the runs' own wall seconds)."""
    starts, ends, total = [], [], 0.0
    for run in grid(study):
        starts.append(os.path.getmtime(os.path.join(run.directory, "study_run.json")))
        ends.append(os.path.getmtime(os.path.join(run.directory, "summary.json")))
        with open(os.path.join(run.directory, "summary.json")) as f:
            total += json.load(f)["wall_seconds"]
    return max(ends) - min(starts), total


def _readme(study, results, tables, figures):
    import platform

    import torch
    import transformers
    import trl

    elapsed, total = wall_times(study)
    runs = sum(len(r) for r in results.values())
    return f"""# Study results: {os.path.basename(os.path.abspath(study.output_dir))}

Generated by `tvopd-trl study --config {study.source}` (`tvopd_trl.study`); do not edit by hand.

- Grid: {len(study.methods)} methods x seeds {study.seeds} = {runs} runs of `{study.recipe}` with
  `{json.dumps(study.overrides)}`, {study.parallel} at a time, one thread each.
- Machine: {platform.platform()}, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}); Python
  {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, TRL {trl.__version__}.
- Wall time: {elapsed / 60:.0f} min from the first run's start to the last run's end (the runs' own times sum to
  {total / 60:.0f} min; the grid may have been resumed across sessions or shared the CPU with other work).
- Files: `tables.md` (the tables below), `results.json` (every number, and each run's accuracy curve), and the
  figures {", ".join(f"`{name}`" for name in figures)}.

{tables}"""
