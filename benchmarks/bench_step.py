"""Optimizer-step time, throughput and peak memory of TV-OPD against TRL's distillation trainers, side by side.

    OMP_NUM_THREADS=1 python benchmarks/bench_step.py            # the full grid (about 1.5 h on 2 free cores)
    OMP_NUM_THREADS=1 python benchmarks/bench_step.py --quick    # a small validation grid (a couple of minutes)

Trainers (the same models, prompts, completions, generation settings and batch shape for all; see common.py):

    tv       TVOPDTrainer(advantage_mode="tv")
    raw      TVOPDTrainer(advantage_mode="raw")
    distill  trl.DistillationTrainer(beta=1.0)       reverse KL over the full vocabulary, TRL's chunked loss
    gkd      trl.experimental.gkd.GKDTrainer(beta=1.0) reverse KL over the full vocabulary, full logits

Grid (default): vocabulary 32,000 and 151,936 x hidden size 64 and 256 x completion length 128 and 512; 4 prompts of
64 tokens, 2 layers.

For each grid point:

1. Timing, in one fresh process: `--rounds` rounds; each round builds each trainer in turn (tv, raw, distill, gkd,
   tv, raw, ...: A B A B, so that machine drift hits all of them alike), runs `--steps` loss-phase steps (the
   completions pre-generated once and fed to every trainer), then `--steps` full steps (the trainer's own
   generation). The first step of each run is dropped as warm-up. Reported: the median seconds per optimizer step
   and completion tokens per second (B x T / median).
2. Memory, one fresh process per trainer: RSS after setup, peak RSS over 2 loss-phase steps (the peak is reset after
   setup), the activation memory (peak - setup RSS - gradient and AdamW state of the student), and the peak over 2
   full steps.

Prints the machine, a Markdown table and the targets' ratios; writes bench_step.{json,md,png} to `--out`.
"""

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

import common


FULL = dict(vocabs=[32000, 151936], hiddens=[64, 256], completions=[128, 512], prompt=64, batch=4, rounds=3, steps=3)
QUICK = dict(vocabs=[1024, 4096], hiddens=[32], completions=[16], prompt=8, batch=4, rounds=2, steps=2)
MEMORY_STEPS = 2
WARMUP_STEPS = 1  # dropped from each run's timings
TARGET = dict(vocab=151936, hidden=256, completion=512)  # the target point


# ----------------------------------------------------------------------------------------------------------------------
# Workers (each in a fresh process)
# ----------------------------------------------------------------------------------------------------------------------


def time_worker(job):
    shape = job["shape"]
    data = common.rollout(shape, job["cache_dir"])
    seconds = {kind: {"loss": [], "full": []} for kind in job["trainers"]}
    for _ in range(job["rounds"]):
        for kind in job["trainers"]:
            trainer = common.build_trainer(kind, shape, data, job["steps"], common.scratch_dir(kind))
            seconds[kind]["loss"] += common.train_and_time(trainer)[WARMUP_STEPS:]
            common.use_fixed_completions(trainer, kind, data, fixed=False)
            seconds[kind]["full"] += common.train_and_time(trainer)[WARMUP_STEPS:]
            del trainer
            common.settle()
            with open(job["partial"], "w") as f:  # kept if a later trainer kills the process (out of memory)
                json.dump(seconds, f)
    return seconds


def memory_worker(job):
    shape = job["shape"]
    data = common.rollout(shape, job["cache_dir"])
    return common.measure_trainer_memory(job["kind"], shape, data, MEMORY_STEPS, common.scratch_dir(job["kind"]))


# ----------------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------------


def table(results, trainers):
    header = [
        "V",
        "H",
        "T",
        "trainer",
        "timed steps",
        "loss s/step",
        "loss tok/s",
        "full s/step",
        "full tok/s",
        "peak RSS loss (MB)",
        "activation (MB)",
        "peak RSS full (MB)",
        "loss time / distill",
        "peak RSS / distill",
    ]
    rows = []
    for point in results:
        shape = common.Shape(**point["shape"])
        timing, memory = point["timing"], point["memory"]
        base_time = _median(timing, "distill", "loss")
        base_rss = memory.get("distill", {}).get("loss_peak_rss_mb")
        for kind in trainers:
            loss, full = _median(timing, kind, "loss"), _median(timing, kind, "full")
            mem = memory.get(kind, {})
            peak = mem.get("loss_peak_rss_mb")
            rows.append(
                [
                    shape.vocab,
                    shape.hidden,
                    shape.completion,
                    kind,
                    len(timing.get(kind, {}).get("loss", [])),
                    common.fmt(loss) if loss else _error(timing, mem),
                    common.fmt(shape.completion_tokens / loss) if loss else "-",
                    common.fmt(full) if full else "-",
                    common.fmt(shape.completion_tokens / full) if full else "-",
                    common.fmt(peak) if peak else _error({}, mem),
                    common.fmt(mem.get("loss_activation_mb")),
                    common.fmt(mem.get("full_peak_rss_mb")),
                    common.fmt(loss / base_time) if loss and base_time else "-",
                    common.fmt(peak / base_rss) if peak and base_rss else "-",
                ]
            )
    return common.markdown_table(header, rows)


def targets(results):
    """The issue's targets at its target point (or at the largest point run), each a ratio from the same run."""
    points = [p for p in results if all(p["shape"][key] == value for key, value in TARGET.items())] or results[-1:]
    lines = []
    for point in points:
        timing, memory = point["timing"], point["memory"]
        tv, raw, distill = (_median(timing, kind, "loss") for kind in ("tv", "raw", "distill"))
        rss = {kind: memory.get(kind, {}).get("loss_peak_rss_mb") for kind in ("tv", "distill")}
        name = common.Shape(**point["shape"]).name
        if tv and distill:
            lines.append(f"- {name}: loss-phase throughput tv / distill = {distill / tv:.2f}x (target >= 2x)")
        if rss["tv"] and rss["distill"]:
            lines.append(f"- {name}: peak RSS tv / distill = {rss['tv'] / rss['distill']:.2f} (target <= 0.8)")
        if tv and raw:
            lines.append(f"- {name}: loss-phase time tv / raw - 1 = {100 * (tv / raw - 1):+.1f}% (target < 2%)")
    # Activation memory against the vocabulary, at each (hidden, completion) of the grid (target: flat)
    by_size = {}
    for point in results:
        activation = point["memory"].get("tv", {}).get("loss_activation_mb")
        if activation is not None:
            key = (point["shape"]["hidden"], point["shape"]["completion"])
            by_size.setdefault(key, []).append(f"{activation:,.0f} MB at V={point['shape']['vocab']:,}")
    for (hidden, completion), values in by_size.items():
        if len(values) > 1:
            lines.append(
                f"- tv activation memory, H={hidden}, T={completion}: {', '.join(values)} (target: flat in V)"
            )
    return "\n".join(lines)


def whole_rounds(path):
    """The timings in `path` of the trainers whose runs all finished (a killed run leaves its trainer out)."""
    with open(path) as f:
        seconds = json.load(f)
    counts = {len(phases["loss"]) for phases in seconds.values() if phases["loss"] and phases["full"]}
    done = min(counts) if counts else 0
    return {
        kind: {phase: values[:done] for phase, values in phases.items()} for kind, phases in seconds.items() if done
    }


def _median(timing, kind, phase):
    stats = common.summarize(timing.get(kind, {}).get(phase, []))
    return stats["median"] if stats else None


def _error(timing, memory):
    error = timing.get("error") or memory.get("error")
    return f"failed: {error[:60]}" if error else "-"


def plot(results, trainers, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [f"V{p['shape']['vocab']}\nH{p['shape']['hidden']} T{p['shape']['completion']}" for p in results]
    panels = [
        ("loss phase: median s/step", lambda p, k: _median(p["timing"], k, "loss")),
        ("full step (with generation): median s/step", lambda p, k: _median(p["timing"], k, "full")),
        ("loss phase: peak RSS (MB)", lambda p, k: p["memory"].get(k, {}).get("loss_peak_rss_mb")),
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 1.4 * len(results)), 10), constrained_layout=True)
    x = np.arange(len(results))
    offsets = np.linspace(-0.2, 0.2, len(trainers))
    for ax, (title, value) in zip(axes, panels, strict=True):
        for offset, kind in zip(offsets, trainers, strict=True):
            values = [value(p, kind) or np.nan for p in results]
            ax.plot(x + offset, values, "o", markersize=7, label=kind)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xticks(x, names, fontsize=8)
        ax.grid(which="both", alpha=0.3)
    axes[0].legend(ncol=len(trainers))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------------


def measure_timing(shape, trainers, config, cache_dir, partial):
    print(f"[bench_step] {shape.name}: timing {trainers} ({config['rounds']} rounds)", file=sys.stderr, flush=True)
    if os.path.exists(partial):
        os.remove(partial)
    job = common.job(
        "time",
        shape,
        trainers=trainers,
        rounds=config["rounds"],
        steps=config["steps"],
        cache_dir=cache_dir,
        partial=partial,
    )
    timing = common.run_worker(__file__, job)
    if "error" in timing and os.path.exists(partial):  # keep the runs that finished before the failure
        with open(partial) as f:
            timing = {**json.load(f), "error": timing["error"]}
    return timing


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser, default_out=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument(
        "--trainers", default=",".join(common.TRAINERS), help="comma-separated subset of tv,raw,distill,gkd"
    )
    common.add_grid_arguments(parser, "A B A B rounds per grid point")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="reuse the timings and memories already in --cache-dir (whole rounds only) instead of measuring again: "
        "a grid split over several invocations, then reported by one",
    )
    cli = parser.parse_args()
    config = common.grid_config(cli, QUICK, FULL)
    trainers = cli.trainers.split(",")
    out, cache_dir, started, info = common.start(cli)
    shapes = common.grid(config["vocabs"], config["hiddens"], config["completions"], config["prompt"], config["batch"])
    results = []
    for shape in shapes:
        partial = os.path.join(cache_dir, f"timing-{shape.name}.json")
        memory_file = os.path.join(cache_dir, f"memory-{shape.name}.json")
        if cli.resume and os.path.exists(partial):
            print(f"[bench_step] {shape.name}: reusing {partial}", file=sys.stderr, flush=True)
            timing = whole_rounds(partial)
        else:
            timing = measure_timing(shape, trainers, config, cache_dir, partial)
        if cli.resume and os.path.exists(memory_file):
            with open(memory_file) as f:
                memory = json.load(f)
        elif cli.no_memory:
            memory = {}
        else:
            memory = common.measure_memories(__file__, shape, trainers, cache_dir, "bench_step")
            with open(memory_file, "w") as f:
                json.dump(memory, f)
        results.append({"shape": asdict(shape), "timing": timing, "memory": memory})

    label = " (--quick validation configuration)" if cli.quick else ""
    report = "\n\n".join(
        [
            "## Machine\n\n" + common.machine_markdown(info),
            f"## Step time and memory{label}\n\n"
            f"B={config['batch']} prompts of P={config['prompt']} tokens; medians over the timed steps of each trainer "
            f"and phase ({config['rounds']} rounds x {config['steps'] - WARMUP_STEPS} unless the column says "
            "otherwise).\n\n" + table(results, trainers),
            "## Targets\n\n" + (targets(results) or "- (need tv, raw and distill)"),
        ]
    )
    print(report)
    common.write_outputs(out, "bench_step", {"machine": info, "config": config, "results": results}, report)
    plot(results, trainers, os.path.join(out, "bench_step.png"))
    print(f"\nwrote {out}/bench_step.{{json,md,png}} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    if common.is_worker():
        common.serve_worker({"time": time_worker, "memory": memory_worker})
    else:
        main()
