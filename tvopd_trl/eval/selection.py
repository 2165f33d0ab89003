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
"""The paper's checkpoint selection, run aggregation and late-stage retention metrics, over saved evaluations.

A run is `{step: {benchmark: mean@k}}`, read from `<run dir>/eval/mean@<k>/step-<N>/results.json` by [`load_run`].

- Selection (paper, "Checkpoint selection"): per run, the earliest checkpoint with the highest unweighted mean of the
  six benchmarks within steps 1..1000; all six scores are read from that checkpoint; across runs, the mean and the
  sample standard deviation.
- Retention (paper, eq. retention-metrics): S_k = (AIME24_k + AIME25_k) / 2; LateMean is the mean of S_k over a late
  window (the paper's is steps 500, 525, ..., 625); PeakDrop = max_k S_k - LateMean, the maximum taken over the steps
  up to the window's end; stage averages are taken within each window and run, then across runs.
"""

import glob
import json
import os
import re
import statistics
import warnings
from typing import NamedTuple

from .accuracy import mean_at_k
from .benchmarks import PAPER_BENCHMARKS
from .evaluate import RESULTS_FILE, evaluated_steps, read_results, step_dir


RETENTION_BENCHMARKS = ("aime24", "aime25")
PAPER_LATE_WINDOW = tuple(range(500, 626, 25))
PAPER_STAGES = {"early": (0, 250), "middle": (275, 450), "late": (500, 625)}
# Means of the same six fractions summed in the same order are equal exactly; this only absorbs rounding between
# different fractions with the same mean.
TIE_TOLERANCE = 1e-12


class Selection(NamedTuple):
    step: int
    scores: dict
    mean: float


def evaluated_ks(run_dir):
    """The k of each mean@k protocol evaluated in `run_dir`, in increasing order."""
    found = (
        re.fullmatch(r"mean@(\d+)", os.path.basename(path)) for path in glob.glob(os.path.join(run_dir, "eval", "*"))
    )
    return sorted(int(match.group(1)) for match in found if match)


def load_run(run_dir, k=None):
    """`{step: {benchmark: mean@k}}` of the evaluations saved in `run_dir/eval/mean@<k>/step-<N>/`.

    `k` may be left out when the run was evaluated under one protocol only."""
    ks = evaluated_ks(run_dir)
    if not ks:
        raise ValueError(
            f"{run_dir} has no evaluations (no eval/mean@<k>/step-<N>/{RESULTS_FILE}). Evaluate during training with "
            f"`BenchmarkEvalCallback`, or afterwards with `tvopd-trl eval --model {run_dir}`."
        )
    if k is None:
        if len(ks) > 1:
            raise ValueError(f"{run_dir} was evaluated at mean@{ks}; say which k to use.")
        k = ks[0]
    if k not in ks:
        raise ValueError(f"{run_dir} has no mean@{k} evaluations; it has mean@{ks}.")
    run, protocols = {}, {}
    for step in evaluated_steps(run_dir, k):
        results = read_results(step_dir(run_dir, step, k))
        run[step] = {name: mean_at_k(scores) for name, scores in results["benchmarks"].items()}
        protocol = json.dumps({key: results.get(key) for key in ("settings", "limit", "prompt_template")})
        protocols.setdefault(protocol, []).append(step)
    if not run:
        raise ValueError(f"{run_dir}/eval/mean@{k} holds no step-<N>/{RESULTS_FILE}.")
    if len(protocols) > 1:
        groups = "; ".join(f"steps {steps}: {protocol}" for protocol, steps in protocols.items())
        raise ValueError(
            f"{run_dir}/eval/mean@{k} mixes evaluation settings across steps, which cannot be compared: {groups}."
        )
    return run


def select_checkpoint(run, benchmarks=PAPER_BENCHMARKS, min_step=1, max_step=1000):
    """The earliest step in `min_step..max_step` with the highest unweighted mean over `benchmarks`.

    Steps that lack one of `benchmarks` are not candidates; if no step qualifies the error says what is missing."""
    candidates = {
        step: [scores[name] for name in benchmarks]
        for step, scores in run.items()
        if min_step <= step <= max_step and all(name in scores for name in benchmarks)
    }
    if not candidates:
        in_range = {step: scores for step, scores in run.items() if min_step <= step <= max_step}
        if not in_range:
            raise ValueError(f"No evaluation within steps {min_step}..{max_step} (evaluated: {sorted(run)}).")
        missing = sorted({name for scores in in_range.values() for name in benchmarks if name not in scores})
        raise ValueError(
            f"No step in {min_step}..{max_step} has all of {', '.join(benchmarks)}; missing: {', '.join(missing)}."
        )
    incomplete = sorted(step for step in run if min_step <= step <= max_step and step not in candidates)
    if incomplete:
        warnings.warn(
            f"Steps {incomplete} lack some of {', '.join(benchmarks)} and are not candidates for selection (an "
            "evaluation that crashed or is still running?).",
            stacklevel=2,
        )
    means = {step: sum(values) / len(values) for step, values in candidates.items()}
    best = max(means.values())
    step = min(step for step, mean in means.items() if mean >= best - TIE_TOLERANCE)
    return Selection(step, {name: run[step][name] for name in benchmarks}, means[step])


def gap_closed(before, after, teacher):
    """(after - before) / (teacher - before): the share of the teacher-student gap that training closed; `None`
    without a gap."""
    return (after - before) / (teacher - before) if teacher != before else None


def mean_std(values):
    """(mean, sample standard deviation) of `values`; the deviation is `None` for a single value."""
    values = list(values)
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def aggregate_selections(selections, benchmarks=PAPER_BENCHMARKS):
    """`{benchmark: (mean, std)}` across runs' selections, plus `"avg"`: each run's mean first, then across runs."""
    table = {name: mean_std(selection.scores[name] for selection in selections) for name in benchmarks}
    table["avg"] = mean_std(selection.mean for selection in selections)
    return table


def aggregate_score(run, benchmarks=RETENTION_BENCHMARKS):
    """`{step: S_k}`, the mean of `benchmarks` at each step that has all of them (S_k of the paper by default)."""
    return {
        step: sum(scores[name] for name in benchmarks) / len(benchmarks)
        for step, scores in run.items()
        if all(name in scores for name in benchmarks)
    }


def late_mean(series, window=PAPER_LATE_WINDOW):
    """The mean of `series` (`{step: value}`) over the steps of `window`, all of which must be present."""
    missing = [step for step in window if step not in series]
    if missing:
        raise ValueError(
            f"The late window needs steps {missing}, which were not evaluated (evaluated: {sorted(series)})."
        )
    return statistics.fmean(series[step] for step in window)


def peak_drop(series, window=PAPER_LATE_WINDOW):
    """max_k S_k - LateMean, the maximum over the evaluated steps up to the window's last step."""
    peak = max(value for step, value in series.items() if step <= max(window))
    return peak - late_mean(series, window)


def stage_averages(series, stages=PAPER_STAGES):
    """`{stage: mean of series over the evaluated steps in [first, last]}` for `stages` (`{name: (first, last)}`)."""
    averages = {}
    for name, (first, last) in stages.items():
        values = [value for step, value in series.items() if first <= step <= last]
        if not values:
            raise ValueError(
                f"Stage {name!r} (steps {first}..{last}) has no evaluation (evaluated: {sorted(series)})."
            )
        averages[name] = statistics.fmean(values)
    return averages


def best_over_training(series):
    """The highest value of `series` (the magnitude diagnostic's per-run best-over-training accuracy)."""
    return max(series.values())


def trajectory_average(series):
    """The mean of `series` over its steps (the magnitude diagnostic's per-run trajectory average)."""
    return statistics.fmean(series.values())


class Alignment(NamedTuple):
    runs: dict
    horizon: str
    missing: dict
    note: str


def align_runs(runs, horizon="common"):
    """Puts runs (`{label: run}`) on one step grid for comparison.

    `"common"` keeps the steps every run evaluated (the paper's magnitude diagnostic); `"all"` keeps every
    observation (its retention metrics). `missing` lists, per run, the steps other runs have and it lacks; `note`
    says in words which horizon was used and what it dropped."""
    if horizon not in ("common", "all"):
        raise ValueError(f"`horizon` must be 'common' or 'all' (got {horizon!r}).")
    union = set().union(*(run.keys() for run in runs.values()))
    missing = {label: sorted(union - run.keys()) for label, run in runs.items()}
    if horizon == "all":
        aligned = runs
        note = "all observations kept"
    else:
        common = set.intersection(*(set(run) for run in runs.values()))
        if not common:
            raise ValueError(f"The runs share no evaluated step; steps missing per run: {missing}.")
        aligned = {label: {step: run[step] for step in sorted(common)} for label, run in runs.items()}
        note = f"common horizon: {len(common)} steps evaluated by all {len(runs)} runs ({min(common)}..{max(common)})"
    gaps = {label: steps for label, steps in missing.items() if steps}
    if gaps:
        note += "; steps missing: " + "; ".join(f"{label} lacks {_ranges(steps)}" for label, steps in gaps.items())
    return Alignment(aligned, horizon, missing, note)


def _ranges(steps):
    return ", ".join(str(step) for step in steps[:8]) + (f" and {len(steps) - 8} more" if len(steps) > 8 else "")
