"""The loss phase packed (`padding_free`) against padded: tokens per second and peak memory, on rollouts whose
completion lengths are distributed like a reasoning run's.

    OMP_NUM_THREADS=1 python benchmarks/bench_packing.py            # caps 512 and 2,048 (about 15 min on 2 free cores)
    OMP_NUM_THREADS=1 python benchmarks/bench_packing.py --quick    # a small validation run (a minute)

Rollout (`common.reasoning_lengths`, `common.ragged_rollout`): B = 8 prompts of P = 64 tokens; completion lengths
lognormal with median cap / 4 and sigma 1, clipped to [1, cap], one row cut off at the cap (so the padded width is
P + cap); token ids uniform, seeded. bench_step's models and trainer settings (common.py): a 2-layer Qwen2 pair, V =
32,000, H = 64, `sdpa` attention, float32, TVOPDTrainer(advantage_mode="tv"), one optimizer step per rollout of B
rows (one micro-batch). The loss phase: teacher scoring, the student's forward and backward, the optimizer step.

Layouts:

    padded     the default: every row padded to the longest
    packed     padding_free=True: the micro-batch's rows as one sequence of its real tokens
    budget     padding_free=True, max_tokens_per_micro_batch = P + cap: forwards of at most one longest row's tokens

Each (cap, layout) runs `--rounds` times, each time in a fresh process (`common.measure_trainer_memory`: `--steps`
loss-phase steps, the first dropped as warm-up; the peak RSS over the steps; the activation memory = peak - RSS after
setup - gradient and AdamW state), the layouts alternating (A B C A B C) so that machine drift hits all alike.
Reported per (cap, layout): median seconds per step over every timed step of every round, real completion tokens per
second (the tokens the loss trains on), the speed-up over padded, the issue's target (0.8 x padded tokens / real
tokens, tokens counted with the prompts), and the peak RSS and activation memory, with the activation's ratio to
padded beside the real / padded tokens ratio (memory that follows real tokens has the two about equal).
"""

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict

import common


FULL = dict(caps=[512, 2048], vocab=32000, hidden=64, prompt=64, batch=8, rounds=2, steps=3)
QUICK = dict(caps=[64, 128], vocab=1024, hidden=32, prompt=8, batch=8, rounds=1, steps=3)
LAYOUTS = common.PACKING_LAYOUTS
WARMUP_STEPS = 1


def measure_worker(job):
    shape = job["shape"]
    data = common.ragged_rollout(shape, job["lengths"])
    overrides = common.packing_overrides(job["layout"], shape)
    output_dir = common.scratch_dir(job["layout"])
    return common.measure_trainer_memory("tv", shape, data, job["steps"], output_dir, False, overrides)


def report(results):
    header = [
        "cap",
        "layout",
        "real / padded tokens",
        "timed steps",
        "s/step",
        "completion tok/s",
        "speed-up",
        "target speed-up",
        "peak RSS (MB)",
        "activation (MB)",
        "activation / padded",
    ]
    rows, verdicts = [], []
    for point in results:
        shape, lengths = common.Shape(**point["shape"]), point["lengths"]
        real, padded_tokens = common.token_counts(shape, lengths)
        target = 0.8 * padded_tokens / real
        runs = point["layouts"]
        seconds = {layout: _seconds(runs[layout]) for layout in LAYOUTS}
        memory = {layout: _memory(runs[layout]) for layout in LAYOUTS}
        for layout in LAYOUTS:
            median = statistics.median(seconds[layout]) if seconds[layout] else None
            base = statistics.median(seconds["padded"]) if seconds["padded"] else None
            speedup = base / median if median and base else None
            activation, base_activation = (
                memory[layout].get("loss_activation_mb"),
                memory["padded"].get("loss_activation_mb"),
            )
            rows.append(
                [
                    shape.completion,
                    layout,
                    common.fmt(real / padded_tokens),
                    len(seconds[layout]),
                    common.fmt(median) if median else _error(runs[layout]),
                    common.fmt(sum(lengths) / median) if median else "-",
                    common.fmt(speedup),
                    common.fmt(target) if layout != "padded" else "-",
                    common.fmt(memory[layout].get("loss_peak_rss_mb")),
                    common.fmt(activation),
                    common.fmt(activation / base_activation) if activation and base_activation else "-",
                ]
            )
            if layout != "padded" and speedup:
                met = "met" if speedup >= target else "missed"
                verdicts.append(
                    f"- cap {shape.completion}, {layout}: speed-up {speedup:.2f}x against the target {target:.2f}x "
                    f"(0.8 x {padded_tokens:,} padded / {real:,} real tokens): {met}"
                )
    return common.markdown_table(header, rows) + "\n\n" + "\n".join(verdicts)


def _seconds(runs):
    return [s for run in runs for s in run.get("loss_seconds", [])[WARMUP_STEPS:]]


def _memory(runs):
    """The first round's memory (every round measures the same process-fresh peak)."""
    return next((run for run in runs if "loss_peak_rss_mb" in run), {})


def _error(runs):
    errors = [run["error"] for run in runs if "error" in run]
    return f"failed: {errors[0][:60]}" if errors else "-"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser, default_out=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--caps", type=int, nargs="+", help="override the completion caps")
    parser.add_argument("--rounds", type=int, help="fresh processes per (cap, layout)")
    parser.add_argument("--steps", type=int, help="optimizer steps per process (the first is dropped as warm-up)")
    cli = parser.parse_args()
    config = dict(QUICK if cli.quick else FULL)
    config.update({key: value for key in ("caps", "rounds", "steps") if (value := getattr(cli, key)) is not None})
    out, _, started, info = common.start(cli)
    results = []
    for cap in config["caps"]:
        shape = common.Shape(config["vocab"], config["hidden"], cap, config["prompt"], config["batch"])
        lengths = common.reasoning_lengths(cap, shape.batch)
        point = {"shape": asdict(shape), "lengths": lengths, "layouts": {layout: [] for layout in LAYOUTS}}
        results.append(point)
        for round_index in range(config["rounds"]):
            for layout in LAYOUTS:
                print(f"[bench_packing] cap {cap}, {layout}, round {round_index + 1}", file=sys.stderr, flush=True)
                job = common.job("measure", shape, layout=layout, lengths=lengths, steps=config["steps"])
                point["layouts"][layout].append(common.run_worker(__file__, job))
        text = "## Machine\n\n" + common.machine_markdown(info) + "\n\n## Loss phase, packed against padded\n\n"
        text += report(results)
        common.write_outputs(out, "bench_packing", {"machine": info, "config": config, "results": results}, text)
    print(text)
    print(f"\nwrote {out}/bench_packing.{{json,md}} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    if common.is_worker():
        common.serve_worker({"measure": measure_worker})
    else:
        main()
