"""How TV-OPD's loss-phase step time and peak memory grow as completion length, batch size and vocabulary double.

    OMP_NUM_THREADS=1 python benchmarks/bench_scaling.py            # the full sweeps
    OMP_NUM_THREADS=1 python benchmarks/bench_scaling.py --quick    # a small validation sweep (about a minute)

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

Prints the machine and Markdown tables; writes bench_scaling.{json,md,png} (log-log axes) to `--out`.
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


def point_worker(job):
    shape = job["shape"]
    data = common.rollout(shape, job["cache_dir"])
    result = common.measure_trainer_memory(
        job["kind"], shape, data, job["steps"], common.scratch_dir(job["kind"]), full_step=False
    )
    result["timing"] = common.summarize(result["loss_seconds"][WARMUP_STEPS:])
    return result


def exponent(xs, ys):
    """Least-squares slope of log(y) on log(x); None with fewer than two positive points."""
    import numpy as np

    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and y > 0]
    if len(pairs) < 2:
        return None
    logs = np.log(np.array(pairs, dtype=float))
    return float(np.polyfit(logs[:, 0], logs[:, 1], 1)[0])


QUANTITIES = {
    "s/step": lambda r: r["timing"]["median"] if r.get("timing") else None,
    "peak RSS": lambda r: r.get("loss_peak_rss_mb"),
    "activation": lambda r: r.get("loss_activation_mb"),
}


def series(results, axis, kind, quantity):
    points = [r for r in results if r["axis"] == axis and r["kind"] == kind]
    return [p["value"] for p in points], [QUANTITIES[quantity](p["result"]) for p in points]


def tables(results, sweeps, trainers):
    rows = []
    for r in results:
        shape, res = common.Shape(**r["shape"]), r["result"]
        median = QUANTITIES["s/step"](res)
        rows.append(
            [
                r["axis"],
                r["value"],
                r["kind"],
                common.fmt(median) if median else f"failed: {res.get('error', '')[:60]}",
                common.fmt(shape.completion_tokens / median) if median else "-",
                common.fmt(res.get("loss_peak_rss_mb")),
                common.fmt(res.get("loss_activation_mb")),
            ]
        )
    points = common.markdown_table(
        ["swept", "value", "trainer", "loss s/step", "tok/s", "peak RSS (MB)", "activation (MB)"], rows
    )
    rows = []
    for axis in sweeps:
        for kind in trainers:
            slopes = [exponent(*series(results, axis, kind, q)) for q in QUANTITIES]
            rows.append([axis, kind, *(f"{s:.2f}" if s is not None else "-" for s in slopes)])
    exponents = common.markdown_table(
        ["doubled", "trainer", "time exponent", "peak RSS exponent", "activation exponent"], rows
    )
    return points, exponents


def plot(results, sweeps, trainers, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(sweeps), figsize=(4.5 * len(sweeps), 7.5), constrained_layout=True, squeeze=False)
    for column, axis in enumerate(sweeps):
        ax_time, ax_memory = axes[0][column], axes[1][column]
        for kind in trainers:
            xs, ys = series(results, axis, kind, "s/step")
            ax_time.plot(xs, ys, "o-", label=f"{kind}: slope {_slope_text(xs, ys)}")
            for quantity, style in (("peak RSS", "o-"), ("activation", "s--")):
                xs, ys = series(results, axis, kind, quantity)
                ax_memory.plot(xs, ys, style, label=f"{kind} {quantity}: slope {_slope_text(xs, ys)}")
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
    slope = exponent(xs, ys)
    return "-" if slope is None else f"{slope:.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser, default_out=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--trainers", default="tv", help="comma-separated subset of tv,raw,distill,gkd")
    parser.add_argument("--axes", default="completion,batch,vocab", help="which sweeps to run")
    parser.add_argument("--steps", type=int, help="steps per point (the first is dropped as warm-up)")
    cli = parser.parse_args()
    config = QUICK if cli.quick else FULL
    base, steps = config["base"], cli.steps or config["steps"]
    sweeps = {axis: values for axis, values in config["sweeps"].items() if axis in cli.axes.split(",")}
    trainers = cli.trainers.split(",")
    out, cache_dir, started, info = common.start(cli)
    done, results = {}, []
    for axis, values in sweeps.items():
        for value in values:
            shape = replace(base, **{axis: value})
            for kind in trainers:
                if (shape, kind) not in done:  # the base point belongs to every sweep: run it once
                    print(f"[bench_scaling] {shape.name}: {kind}", file=sys.stderr, flush=True)
                    done[shape, kind] = common.run_worker(
                        __file__, common.job("point", shape, kind=kind, steps=steps, cache_dir=cache_dir)
                    )
                results.append(
                    {"axis": axis, "value": value, "kind": kind, "shape": asdict(shape), "result": done[shape, kind]}
                )

    points, exponents = tables(results, sweeps, trainers)
    label = " (--quick validation configuration)" if cli.quick else ""
    report = "\n\n".join(
        [
            "## Machine\n\n" + common.machine_markdown(info),
            f"## Scaling of the loss phase{label}\n\nBase point {base.name}, prompts of P={base.prompt} tokens; "
            f"{steps - WARMUP_STEPS} timed steps per point; medians.\n\n" + points,
            "## Measured exponents (least-squares slope on log-log axes)\n\n" + exponents,
        ]
    )
    print(report)
    common.write_outputs(
        out, "bench_scaling", {"machine": info, "base": asdict(base), "sweeps": sweeps, "results": results}, report
    )
    plot(results, sweeps, trainers, os.path.join(out, "bench_scaling.png"))
    print(f"\nwrote {out}/bench_scaling.{{json,md,png}} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    if common.is_worker():
        common.serve_worker({"point": point_worker})
    else:
        main()
