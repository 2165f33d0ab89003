"""How TV-OPD's loss-phase step time and peak memory grow as completion length, batch size and vocabulary double.

    OMP_NUM_THREADS=1 python benchmarks/bench_scaling.py            # the full sweeps
    OMP_NUM_THREADS=1 python benchmarks/bench_scaling.py --quick    # a small validation sweep (about a minute)
    OMP_NUM_THREADS=1 python benchmarks/bench_scaling.py --axes vocab --update-norm both   # tv with and without
                                                                    # the `update/norm` parameter copy, side by side

Around a base point (default: vocabulary 151,936, hidden 256, completion 512, batch 4, prompts of 64 tokens, 2
layers), one quantity at a time doubles while the others stay at the base:

    completion length T   128, 256, 512, 1024
    batch size B          1, 2, 4, 8
    vocabulary V          37,984, 75,968, 151,936, 303,872   (every one more than one 32,768-column chunk)

Each (point, trainer) runs in its own fresh process: `--steps` loss-phase steps (the fixed, pre-generated completions;
see common.py for the work boundary), the first dropped as warm-up, with the peak RSS taken over all of them after
setup. Reported per point: median seconds per optimizer step, completion tokens per second, peak RSS and the
activation memory (peak - RSS after setup - the student's gradient and AdamW state). For each sweep, the measured
exponent is the least-squares slope of log(quantity) against log(swept value): 1 is linear, 0 is flat.

`--update-norm off` (or `--no-update-norm`) builds the TV-OPD trainers with `log_update_norm=False` (no copy of the
trainable parameters at each step, no `update/norm` metric); `--update-norm both` runs every TV-OPD point both ways,
each in its own process, and adds a table of their ratios (off / on). Other trainers have no such option and run once.

Prints the machine and Markdown tables; writes bench_scaling.{json,md,png} (log-log axes) to `--out`, or
bench_scaling_no_update_norm.{json,md,png} with `--update-norm off` or `both`.
"""

import argparse
import os
import sys
import time
from dataclasses import asdict, replace

import common


FULL = dict(
    base=common.Shape(vocab=151936, hidden=256, completion=512, prompt=64, batch=4),
    sweeps={"completion": [128, 256, 512, 1024], "batch": [1, 2, 4, 8], "vocab": [37984, 75968, 151936, 303872]},
    steps=4,
)
QUICK = dict(
    base=common.Shape(vocab=2048, hidden=32, completion=16, prompt=8, batch=2),
    sweeps={"completion": [16, 32], "batch": [2, 4], "vocab": [2048, 4096]},
    steps=3,
)
WARMUP_STEPS = 1


TVOPD_KINDS = ("tv", "raw")  # the trainers with a `log_update_norm` option


def point_worker(job):
    shape = job["shape"]
    data = common.rollout(shape, job["cache_dir"])
    result = common.measure_trainer_memory(
        job["kind"],
        shape,
        data,
        job["steps"],
        common.scratch_dir(job["kind"]),
        full_step=False,
        config_overrides=job.get("config_overrides"),
    )
    result["timing"] = common.summarize(result["loss_seconds"][WARMUP_STEPS:])
    return result


QUANTITIES = {
    "s/step": lambda r: r["timing"]["median"] if r.get("timing") else None,
    "peak RSS": lambda r: r.get("loss_peak_rss_mb"),
    "activation": lambda r: r.get("loss_activation_mb"),
}


def variants(trainers, update_norm):
    """The (trainer, log_update_norm) pairs to run at each point: `update_norm` is "on", "off" or "both" for the
    TV-OPD trainers; the others have no such option (None)."""
    norms = {"on": [True], "off": [False], "both": [True, False]}[update_norm]
    return [(kind, norm) for kind in trainers for norm in (norms if kind in TVOPD_KINDS else [None])]


def series(results, axis, kind, quantity, norm=True):
    points = [r for r in results if r["axis"] == axis and r["kind"] == kind and norm in (None, _norm(r))]
    return [p["value"] for p in points], [QUANTITIES[quantity](p["result"]) for p in points]


def _norm(r):
    return r.get("log_update_norm", True)


def _norm_text(norm):
    return "-" if norm is None else ("on" if norm else "off")


def tables(results, sweeps, pairs, show_norm):
    """The points table and the exponents table; with `show_norm`, an `update/norm` column beside the trainer."""

    def trainer_cells(kind, norm):
        return [kind, _norm_text(norm)] if show_norm else [kind]

    trainer_header = ["trainer", "update/norm"] if show_norm else ["trainer"]
    rows = []
    for r in results:
        shape, res = common.Shape(**r["shape"]), r["result"]
        median = QUANTITIES["s/step"](res)
        rows.append(
            [
                r["axis"],
                r["value"],
                *trainer_cells(r["kind"], r.get("log_update_norm")),
                common.fmt(median) if median else f"failed: {res.get('error', '')[:60]}",
                common.fmt(shape.completion_tokens / median) if median else "-",
                common.fmt(res.get("loss_peak_rss_mb")),
                common.fmt(res.get("loss_activation_mb")),
            ]
        )
    points = common.markdown_table(
        ["swept", "value", *trainer_header, "loss s/step", "tok/s", "peak RSS (MB)", "activation (MB)"], rows
    )
    rows = []
    for axis in sweeps:
        for kind, norm in pairs:
            slopes = [common.exponent(*series(results, axis, kind, q, norm)) for q in QUANTITIES]
            rows.append([axis, *trainer_cells(kind, norm), *(f"{s:.2f}" if s is not None else "-" for s in slopes)])
    exponents = common.markdown_table(
        ["doubled", *trainer_header, "time exponent", "peak RSS exponent", "activation exponent"], rows
    )
    return points, exponents


def ratio_table(results):
    """With `--update-norm both`: each TV-OPD point without the `update/norm` copy against with it, and the size of
    the copy it saves (one copy of the student's trainable parameters, `state_mb / 3`)."""
    by_key = {(r["axis"], r["value"], r["kind"], _norm(r)): r["result"] for r in results}
    rows = []
    for (axis, value, kind, norm), off in by_key.items():
        on = by_key.get((axis, value, kind, True))
        if norm is not False or on is None:
            continue

        def ratio(quantity, off=off, on=on):
            a, b = QUANTITIES[quantity](off), QUANTITIES[quantity](on)
            return common.fmt(a / b) if a and b else "-"

        saved = [r.get("loss_activation_mb") for r in (on, off)]
        rows.append(
            [
                axis,
                value,
                kind,
                ratio("s/step"),
                ratio("peak RSS"),
                ratio("activation"),
                common.fmt(saved[0] - saved[1]) if None not in saved else "-",
                common.fmt(on["state_mb"] / 3) if "state_mb" in on else "-",
            ]
        )
    return common.markdown_table(
        [
            "swept",
            "value",
            "trainer",
            "s/step off / on",
            "peak RSS off / on",
            "activation off / on",
            "activation on - off (MB)",
            "one parameter copy (MB)",
        ],
        rows,
    )


def plot(results, sweeps, pairs, path, show_norm):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(sweeps), figsize=(4.5 * len(sweeps), 7.5), constrained_layout=True, squeeze=False)
    for column, axis in enumerate(sweeps):
        ax_time, ax_memory = axes[0][column], axes[1][column]
        for kind, norm in pairs:
            label = f"{kind}, update/norm {_norm_text(norm)}" if show_norm and norm is not None else kind
            xs, ys = series(results, axis, kind, "s/step", norm)
            ax_time.plot(xs, ys, "o-", label=f"{label}: slope {_slope_text(xs, ys)}")
            for quantity, style in (("peak RSS", "o-"), ("activation", "s--")):
                xs, ys = series(results, axis, kind, quantity, norm)
                ax_memory.plot(xs, ys, style, label=f"{label} {quantity}: slope {_slope_text(xs, ys)}")
        for ax, ylabel in ((ax_time, "loss phase, median s/step"), (ax_memory, "MB")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(axis)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _slope_text(xs, ys):
    slope = common.exponent(xs, ys)
    return "-" if slope is None else f"{slope:.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser, default_out=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--trainers", default="tv", help="comma-separated subset of tv,raw,distill,gkd")
    parser.add_argument("--axes", default="completion,batch,vocab", help="which sweeps to run")
    parser.add_argument("--steps", type=int, help="steps per point (the first is dropped as warm-up)")
    parser.add_argument(
        "--update-norm",
        choices=["on", "off", "both"],
        default="on",
        help="log_update_norm of the TV-OPD trainers: on (the default, the config's default), off, or both side by side",
    )
    parser.add_argument(
        "--no-update-norm", dest="update_norm", action="store_const", const="off", help="same as --update-norm off"
    )
    cli = parser.parse_args()
    config = QUICK if cli.quick else FULL
    base, steps = config["base"], cli.steps or config["steps"]
    sweeps = {axis: values for axis, values in config["sweeps"].items() if axis in cli.axes.split(",")}
    trainers = cli.trainers.split(",")
    pairs = variants(trainers, cli.update_norm)
    show_norm = cli.update_norm != "on"
    name = "bench_scaling" if cli.update_norm == "on" else "bench_scaling_no_update_norm"
    out, cache_dir, started, info = common.start(cli)
    done, results = {}, []
    for axis, values in sweeps.items():
        for value in values:
            shape = replace(base, **{axis: value})
            for kind, norm in pairs:
                overrides = {"log_update_norm": False} if norm is False else {}
                if (shape, kind, norm) not in done:  # the base point belongs to every sweep: run it once
                    print(
                        f"[bench_scaling] {shape.name}: {kind}"
                        + (f", update/norm {_norm_text(norm)}" if show_norm and norm is not None else ""),
                        file=sys.stderr,
                        flush=True,
                    )
                    done[shape, kind, norm] = common.run_worker(
                        __file__,
                        common.job(
                            "point", shape, kind=kind, steps=steps, cache_dir=cache_dir, config_overrides=overrides
                        ),
                    )
                entry = {"axis": axis, "value": value, "kind": kind, "shape": asdict(shape)}
                if show_norm:
                    entry["log_update_norm"] = norm
                results.append(entry | {"result": done[shape, kind, norm]})

    points, exponents = tables(results, sweeps, pairs, show_norm)
    label = " (--quick validation configuration)" if cli.quick else ""
    norm_label = {"on": "", "off": ", log_update_norm=False", "both": ", log_update_norm on and off"}[cli.update_norm]
    sections = [
        "## Machine\n\n" + common.machine_markdown(info),
        f"## Scaling of the loss phase{label}{norm_label}\n\nBase point {base.name}, prompts of P={base.prompt} "
        f"tokens; {steps - WARMUP_STEPS} timed steps per point; medians.\n\n" + points,
        "## Measured exponents (least-squares slope on log-log axes)\n\n" + exponents,
    ]
    if cli.update_norm == "both":
        sections.append(
            "## Without the `update/norm` parameter copy against with it (log_update_norm off / on, same point)\n\n"
            + ratio_table(results)
        )
    report = "\n\n".join(sections)
    print(report)
    raw = {"machine": info, "base": asdict(base), "sweeps": sweeps, "results": results}
    if show_norm:
        raw["update_norm"] = cli.update_norm
    common.write_outputs(out, name, raw, report)
    plot(results, sweeps, pairs, os.path.join(out, f"{name}.png"), show_norm)
    print(f"\nwrote {out}/{name}.{{json,md,png}} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    if common.is_worker():
        common.serve_worker({"point": point_worker})
    else:
        main()
