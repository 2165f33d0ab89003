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
"""PNG plots of a TV-OPD run, drawn from `trainer.state.log_history`."""

import os

from matplotlib.figure import Figure


def _series(log_history, key):
    points = [(entry["step"], entry[key]) for entry in log_history if entry.get(key) is not None and "step" in entry]
    return [step for step, _ in points], [value for _, value in points]


def _subplots(ncols=1, figsize=(6, 4)):
    # A bare Figure, not pyplot: no backend is chosen and no global figure state is touched, so plotting from a
    # training script never changes a notebook's inline backend.
    figure = Figure(figsize=figsize)
    return figure, figure.subplots(1, ncols)


def _save(figure, output_dir, name):
    path = os.path.join(output_dir, name)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def plot_run(log_history, accuracy_history, output_dir, teacher_accuracy=None, reference_label="teacher"):
    """
    Writes `accuracy.png`, `tv.png`, `update_norm.png` and `advantage_dispersion.png` into `output_dir`: the first
    where there is an accuracy to draw (not with `eval_problems: 0`), the last three where `log_history` has their
    metrics (a run of TRL's own trainer, `trl_baseline`, logs none of them).

    Args:
        log_history (`list[dict]`): `trainer.state.log_history`.
        accuracy_history (`list[tuple[int, float]]`): (step, held-out accuracy of the student) pairs.
        teacher_accuracy (`float`, *optional*): drawn as a horizontal reference on the accuracy plot.
        reference_label (`str`, *optional*, defaults to `"teacher"`): that reference's legend (a self-distillation
            run's is the untrained student's accuracy with the hint).

    Returns:
        `list[str]`: the paths written.
    """
    paths = []
    if accuracy_history or teacher_accuracy is not None:  # without an evaluation there is no curve to draw
        figure, axis = _subplots()
        if accuracy_history:
            steps, accuracy = zip(*accuracy_history, strict=True)
            axis.plot(steps, accuracy, marker="o", label="student")
        if teacher_accuracy is not None:
            axis.axhline(teacher_accuracy, color="tab:green", linestyle="--", label=reference_label)
        axis.set(xlabel="optimizer step", ylabel="held-out accuracy", ylim=(0, 1.05), title="Student accuracy")
        axis.legend()
        paths.append(_save(figure, output_dir, "accuracy.png"))

    if not any("tv/estimate" in entry for entry in log_history):
        return paths
    figure, (left, right) = _subplots(2, figsize=(10, 4))
    # With a scale per teacher, `tv/<teacher>/ema` and `tv/<teacher>/scale` replace `tv/ema` and `tv/scale`
    teachers = sorted(
        {key.split("/")[1] for entry in log_history for key in entry if key.count("/") == 2 and key.startswith("tv/")}
    )
    for key in ("tv/estimate", "tv/ema", "tv/reference", *(f"tv/{name}/ema" for name in teachers)):
        if any(key in entry for entry in log_history):
            left.plot(*_series(log_history, key), label=key)
    # 1 - the estimate: the student's estimated acceptance rate as a speculative-sampling draft of its teacher
    if any("tv/acceptance" in entry for entry in log_history):
        left.plot(*_series(log_history, "tv/acceptance"), linestyle=":", label="tv/acceptance (as a draft)")
    left.set(xlabel="optimizer step", ylabel="total variation / acceptance", title="On-policy TV estimate")
    left.legend()
    for key in ("tv/scale", *(f"tv/{name}/scale" for name in teachers)):
        if any(key in entry for entry in log_history):
            right.plot(*_series(log_history, key), label=f"{key} (c_k)")
    right.set(xlabel="optimizer step", ylabel="c_k", ylim=(0, 1.05), title="TV-OPD scale")
    right.legend()
    paths.append(_save(figure, output_dir, "tv.png"))

    figure, axis = _subplots()
    axis.plot(*_series(log_history, "update/norm"))
    axis.set(xlabel="optimizer step", ylabel="||theta_k+1 - theta_k||", title="update/norm")
    paths.append(_save(figure, output_dir, "update_norm.png"))

    figure, (left, right) = _subplots(2, figsize=(10, 4))
    for key in ("advantage/abs_median", "advantage/abs_p99", "advantage/abs_max"):
        left.plot(*_series(log_history, key), label=key.split("/")[1])
    left.set(xlabel="optimizer step", ylabel="|delta|", yscale="log", title="Raw advantage magnitude")
    left.legend()
    for key in ("advantage/top1pct_energy", "advantage/top10pct_energy"):
        right.plot(*_series(log_history, key), label=key.split("/")[1])
    right.set(xlabel="optimizer step", ylabel="share of sum(delta^2)", ylim=(0, 1), title="Energy concentration")
    right.legend()
    paths.append(_save(figure, output_dir, "advantage_dispersion.png"))
    return paths


def plot_curves(curves, path, title, ylabel="accuracy (%)", scale=100.0):
    """
    Writes a training-curve PNG in the style of the paper's training-dynamics figure: for each method, the mean across
    its runs with a band of one (sample) standard deviation.

    Args:
        curves (`dict[str, list[dict[int, float]]]`): per method, one `{step: value}` series per run. At each step the
            mean and deviation are over the runs that evaluated it.
        path (`str`): the PNG to write.

    Returns:
        `str`: `path`.
    """
    import statistics

    figure, axis = _subplots()
    for method, runs in curves.items():
        steps = sorted(set().union(*(run.keys() for run in runs)))
        values = [[run[step] * scale for run in runs if step in run] for step in steps]
        means = [statistics.fmean(v) for v in values]
        stds = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
        (line,) = axis.plot(steps, means, label=f"{method} (n={len(runs)})")
        lower = [m - s for m, s in zip(means, stds, strict=True)]
        upper = [m + s for m, s in zip(means, stds, strict=True)]
        axis.fill_between(steps, lower, upper, color=line.get_color(), alpha=0.2, linewidth=0)
    axis.set(xlabel="optimizer step", ylabel=ylabel, title=title)
    axis.legend()
    return _save(figure, os.path.dirname(path) or ".", os.path.basename(path))


def plot_dispersion(abs_delta, path, title="Raw-advantage dispersion"):
    """The paper's dispersion case study for one batch of |delta|: the empirical survival curve (log scale) and the
    cumulative squared energy of the tokens sorted by |delta|. Returns `path`."""
    from .metrics import advantage_dispersion, cumulative_energy, survival_curve

    stats = advantage_dispersion(abs_delta)
    figure, (left, right) = _subplots(2, figsize=(10, 4))
    values, survival = survival_curve(abs_delta)
    left.plot(values.numpy(), survival.numpy())
    for key, style in (("abs_median", ":"), ("abs_p99", "--")):
        left.axvline(stats[key], color="gray", linestyle=style, label=f"{key.removeprefix('abs_')} {stats[key]:.3g}")
    left.set(xlabel="|delta|", ylabel="P(|delta| >= x)", yscale="log", title="Survival of |delta|")
    left.legend()
    fraction, share = cumulative_energy(abs_delta)
    right.plot(100 * fraction.numpy(), share.numpy())
    for percent, key in ((1, "top1pct_energy"), (10, "top10pct_energy")):
        right.axvline(percent, color="gray", linestyle=":")
        right.annotate(
            f"top {percent}%: {stats[key]:.1%}", (percent, stats[key]), textcoords="offset points", xytext=(5, -12)
        )
    right.set(
        xlabel="% of tokens, largest |delta| first", ylabel="share of sum(delta^2)", xscale="log", ylim=(0, 1.02)
    )
    right.set_title("Cumulative squared energy")
    figure.suptitle(title)
    return _save(figure, os.path.dirname(path) or ".", os.path.basename(path))
