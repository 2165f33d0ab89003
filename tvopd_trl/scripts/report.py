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
`tvopd-trl select` and `tvopd-trl report`: the paper's checkpoint selection, tables and figures from saved evaluations.

```bash
tvopd-trl select runs/tv-s0 runs/tv-s1 runs/tv-s2 --k 16
tvopd-trl report --method "TV-OPD=runs/tv-s0,runs/tv-s1" --method "Raw OPD=runs/raw-s0,runs/raw-s1" \
    --output_dir report --k 16 --curve_k 4
```
"""

import argparse
import json
import os

from ..console import OneLineErrors
from ..eval.benchmarks import PAPER_BENCHMARKS, get_benchmark
from ..eval.selection import PAPER_LATE_WINDOW, PAPER_STAGES, RETENTION_BENCHMARKS


def _names(text):
    return [name.strip() for name in text.split(",") if name.strip()]


def _window(text):
    """`first:last:stride` (inclusive) -> a tuple of steps."""
    try:
        first, last, stride = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected first:last:stride, e.g. 500:625:25 (got {text!r})") from None
    return tuple(range(first, last + 1, stride))


def _stages(text):
    """`name=first:last,...` -> `{name: (first, last)}`."""
    stages = {}
    for item in _names(text):
        try:
            name, bounds = item.split("=")
            first, last = (int(part) for part in bounds.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected name=first:last,..., e.g. early=0:250 (got {item!r})"
            ) from None
        stages[name] = (first, last)
    return stages


def _method(text):
    """`NAME=RUN_DIR[,RUN_DIR...]` -> (name, [run dirs])."""
    name, separator, runs = text.partition("=")
    if not separator or not name.strip() or not _names(runs):
        raise argparse.ArgumentTypeError(f"expected NAME=RUN_DIR[,RUN_DIR...] (got {text!r})")
    return name.strip(), _names(runs)


def add_selection_arguments(parser):
    """The options `tvopd-trl select` and `tvopd-trl report` share: what a checkpoint is selected on."""
    parser.add_argument("--benchmarks", type=_names, default=list(PAPER_BENCHMARKS), help="Benchmarks averaged.")
    parser.add_argument(
        "--k", type=int, default=None, help="The mean@k protocol to select on (default: the only one)."
    )
    parser.add_argument("--min_step", type=int, default=1, help="First eligible step (the paper's: 1).")
    parser.add_argument("--max_step", type=int, default=1000, help="Last eligible step (the paper's: 1000).")


def select(args):
    """Selects each run's checkpoint, writes `<run>/selection.json`, and prints the per-run and aggregated scores."""
    from ..eval.selection import aggregate_selections, evaluated_ks, load_run, select_checkpoint
    from ..eval.tables import format_table

    selections = {}
    for run_dir in args.runs:
        selection = select_checkpoint(load_run(run_dir, args.k), args.benchmarks, args.min_step, args.max_step)
        k = args.k or evaluated_ks(run_dir)[0]  # `load_run` has refused an ambiguous default
        checkpoint = os.path.join(run_dir, f"checkpoint-{selection.step}")
        record = {
            "step": selection.step,
            "checkpoint": checkpoint if os.path.isdir(checkpoint) else None,
            "mean": selection.mean,
            "scores": selection.scores,
            "k": k,
            "rule": (
                f"earliest step with the highest unweighted mean of {', '.join(args.benchmarks)} within steps "
                f"{args.min_step}..{args.max_step}"
            ),
        }
        with open(os.path.join(run_dir, "selection.json"), "w") as f:
            json.dump(record, f, indent=2)
        selections[run_dir] = selection
    header = {name: get_benchmark(name).title for name in args.benchmarks} | {"avg": "Avg.", "step": "step"}
    rows = {run: {**s.scores, "avg": s.mean} for run, s in selections.items()}
    table = format_table(rows, [*args.benchmarks, "avg"], header=header, first_column="Run", highlight="none")
    aggregate = aggregate_selections(list(selections.values()), args.benchmarks)
    summary = format_table(
        {f"mean ± std over {len(selections)} runs": aggregate},
        [*args.benchmarks, "avg"],
        header=header,
        highlight="none",
    )
    for run, selection in selections.items():
        print(f"{run}: step {selection.step}")
    print(table + "\n" + summary)
    return selections


def report(args):
    """Writes the main-results, stage-wise and retention tables (Markdown and LaTeX), curves and `report.json`."""
    from ..eval.selection import aggregate_score, align_runs, evaluated_ks, load_run
    from ..eval.tables import format_table, main_results_row, retention_row, stage_row
    from ..plots import plot_curves

    os.makedirs(args.output_dir, exist_ok=True)
    methods = dict(args.method)
    header = {name: get_benchmark(name).title for name in args.benchmarks} | {"avg": "Avg. ↑"}
    written, outputs = [], {}

    def write(name, text):
        path = os.path.join(args.output_dir, name)
        with open(path, "w") as f:
            f.write(text)
        written.append(path)

    # Main results: each run selects its own checkpoint on its own step grid; across runs, mean ± sample std.
    selection_runs = {method: {run: load_run(run, args.k) for run in runs} for method, runs in methods.items()}
    main_rows, student = {}, None
    for method, runs in selection_runs.items():
        main_rows[method], selections = main_results_row(runs.values(), args.benchmarks, args.min_step, args.max_step)
        outputs.setdefault("selected_steps", {})[method] = {
            label: s.step for label, s in zip(runs, selections, strict=True)
        }
        for run in runs.values():
            if student is None and all(name in run.get(0, {}) for name in args.benchmarks):
                scores = run[0]
                student = {
                    "Student": {**scores, "avg": sum(scores[n] for n in args.benchmarks) / len(args.benchmarks)}
                }
    if student is None:
        print(
            "No run has a step-0 evaluation of every benchmark: the tables leave out the Student row. `tvopd-trl eval "
            "--model RUN --student MODEL` makes it (MODEL: the model the run started from)."
        )
    columns = [*args.benchmarks, "avg"]
    k = args.k or evaluated_ks(next(iter(methods.values()))[0])[0]  # `load_run` has checked there is only one
    caption = (
        f"Validation accuracy (mean@{k}, %): per run, the earliest checkpoint with the highest mean over "
        f"steps {args.min_step}..{args.max_step}; mean ± sample std across runs."
    )
    for fmt, suffix in (("markdown", "md"), ("latex", "tex")):
        write(
            f"main_results.{suffix}",
            format_table(main_rows, columns, header=header, fixed_rows=student, fmt=fmt, caption=caption),
        )
    outputs["main_results"] = main_rows

    # Curves, stages and retention: on one step grid across all runs (`--horizon`).
    curve_runs = {method: {run: load_run(run, args.curve_k) for run in runs} for method, runs in methods.items()}
    flat = {f"{method} · {run}": series for method, runs in curve_runs.items() for run, series in runs.items()}
    alignment = align_runs(flat, args.horizon)
    outputs["horizon"] = alignment.note
    aligned = {method: [alignment.runs[f"{method} · {run}"] for run in runs] for method, runs in curve_runs.items()}
    retention = args.retention_benchmarks
    series_of = {
        name: {m: [aggregate_score(r, [name]) for r in runs] for m, runs in aligned.items()} for name in retention
    }
    aggregate_name = "S_k = mean(" + ", ".join(get_benchmark(n).title for n in retention) + ")"
    series_of[aggregate_name] = {m: [aggregate_score(r, retention) for r in runs] for m, runs in aligned.items()}
    for name, curves in series_of.items():
        title = get_benchmark(name).title if name in retention else aggregate_name
        filename = f"curve_{name if name in retention else 'aggregate'}.png"
        written.append(plot_curves(curves, os.path.join(args.output_dir, filename), f"{title} ({alignment.horizon})"))

    # A run that lacks a stage, or the late window, is left out of that number, and the output says so: the paper's
    # runs did not all cover every window either.
    stage_rows, gaps = {}, []
    for name in retention:
        for stage, bounds in args.stages.items():
            row = {}
            for method, runs in series_of[name].items():
                covered = [s for s in runs if _covers_stage(s, bounds)]
                row[method] = stage_row(covered, {stage: bounds})[stage][0] if covered else None
                if len(covered) < len(runs):
                    gaps.append(f"{method}: {len(runs) - len(covered)} run(s) without {stage}-stage evaluations")
            stage_rows[f"{get_benchmark(name).title}, {stage} stage"] = row
    retention_rows = {}
    for method, runs in series_of[aggregate_name].items():
        if all(all(step in s for step in args.late_window) for s in runs):
            retention_rows[method] = retention_row(runs, args.late_window)
        else:
            retention_rows[method] = {"LateMean": None, "PeakDrop": None}
            gaps.append(f"{method}: not every run was evaluated at every step of the late window")
    outputs["coverage_gaps"] = sorted(set(gaps))
    stage_caption = "Stage-wise accuracy (%), averaged within each window and run, then across runs; " + ", ".join(
        f"{stage}: steps {first}–{last}" for stage, (first, last) in args.stages.items()
    )
    retention_caption = (
        f"Retention of {aggregate_name}: LateMean over steps {args.late_window[0]}..{args.late_window[-1]} "
        f"(every {args.late_window[1] - args.late_window[0] if len(args.late_window) > 1 else 0}), PeakDrop = max S_k "
        "- LateMean; mean ± sample std across runs."
    )
    for fmt, suffix in (("markdown", "md"), ("latex", "tex")):
        write(
            f"stages.{suffix}",
            format_table(
                stage_rows,
                list(methods),
                first_column="Metric",
                highlight="rows",
                rank_second=False,
                fmt=fmt,
                caption=stage_caption,
            ),
        )
        write(
            f"retention.{suffix}",
            format_table(
                retention_rows, ["LateMean", "PeakDrop"], highlight="none", fmt=fmt, caption=retention_caption
            ),
        )
    outputs.update(stages=stage_rows, retention=retention_rows, files=written)
    with open(os.path.join(args.output_dir, "report.json"), "w") as f:
        json.dump(outputs, f, indent=2, default=list)
    for name in ("main_results.md", "stages.md", "retention.md"):
        with open(os.path.join(args.output_dir, name)) as f:
            print(f.read())
    print(f"Curves, stages and retention on the {alignment.note}.")
    for gap in outputs["coverage_gaps"]:
        print(f"Left out: {gap}.")
    print(f"Wrote {', '.join(os.path.basename(path) for path in written)} and report.json to {args.output_dir}")
    return outputs


def _covers_stage(series, bounds):
    return any(bounds[0] <= step <= bounds[1] for step in series)


def make_parser(prog=None):
    parser = OneLineErrors(prog=prog, description=report.__doc__)
    parser.add_argument(
        "--method", type=_method, action="append", required=True, help="NAME=RUN_DIR[,RUN_DIR...]; repeat per method."
    )
    parser.add_argument("--output_dir", required=True, help="Where the tables, curves and report.json go.")
    add_selection_arguments(parser)
    parser.add_argument("--curve_k", type=int, default=None, help="mean@k protocol of curves, stages and retention.")
    parser.add_argument(
        "--retention_benchmarks", type=_names, default=list(RETENTION_BENCHMARKS), help="Benchmarks averaged into S_k."
    )
    parser.add_argument(
        "--late_window", type=_window, default=PAPER_LATE_WINDOW, help="first:last:stride of LateMean."
    )
    parser.add_argument("--stages", type=_stages, default=PAPER_STAGES, help="name=first:last,... stage windows.")
    parser.add_argument(
        "--horizon",
        choices=("common", "all"),
        default="common",
        help="common: the steps every run evaluated (default); all: every observation.",
    )
    return parser


def run(argv=None):
    report(make_parser(prog="tvopd-trl report").parse_args(argv))
    return 0
