"""A bf16 student's loss-phase memory on CPU: peak allocated bytes of TV-OPD against `DistillationTrainer(beta=1)`.

    OMP_NUM_THREADS=2 python benchmarks/bench_memory_bf16.py                # T 2,048, 8,192 and 16,384 (see --help)
    OMP_NUM_THREADS=1 python benchmarks/bench_memory_bf16.py --quick        # tiny shapes, every path, seconds
    python benchmarks/bench_memory_bf16.py --estimate-only                  # the full run's time estimate, then exit

The committed results ran as four invocations with subsets of the trainers (`--trainers`, `--resume`; the commands
are in docs/performance.md, section 15), about 90 minutes on the 2-core CPU: every trainer at every T, as the plain
command does, would take hours there, and a warm `distill` at T >= 8,192 about 12 GB of RAM.

Models: a DeepSeek-R1-Distill-Qwen-1.5B-shaped Qwen2 pair (`bench_gpu.PAPER_PAIR`: hidden 1,536, 12 attention heads,
2 KV heads, MLP 8,960, vocabulary 151,936, untied LM head) with `--layers` blocks (default 2) instead of 28, random
weights (student seed 0, teacher seed 1), both in bfloat16 (`dtype=torch.bfloat16`: the weights, the gradients and
AdamW's moments are bf16). Settings as the 1.5B recipe's: `bf16=True` (on CPU, accelerate's bf16 autocast),
gradient checkpointing on, `optim="adamw_torch"`, B = 1 prompt of P = 256 tokens per optimizer step, no gradient
accumulation. Completions of T tokens drawn uniformly once per T (`bench_gpu.rollout`) and fed to every trainer
through `common.use_fixed_completions`: the loss phase of `common.py` (teacher scoring, student forward and backward,
clipping, `optimizer.step()`, the trainer's bookkeeping), generation excluded.

Trainers, each in a fresh process:

    tv            TVOPDTrainer(advantage_mode="tv") with its defaults: log_update_norm=True (update/norm logged, the
                  optimizer stepped in buckets of parameters) and lm_head_precision="model" (the LM head's operands
                  at the model's dtype, bf16, the products summed in float32)
    tv-fp32       the same with lm_head_precision="float32" (the head's operands in float32, the former default)
    tv-nonorm     the same as tv with log_update_norm=False (no update/norm, one optimizer.step())
    distill       trl.DistillationTrainer(beta=1.0): the reverse KL(student || teacher) over the full vocabulary, TRL's
                  chunked divergence (`trl.kernels.chunked_divergence`)
    distill-cold  the same, profiled on its first step, without the warm-up step (below)
    tv-cold       tv, the same way

Measured: each run does a warm-up step (its completion cut to `--warmup-tokens`, so that AdamW's moments exist before
the measured step without paying a second long step; 0 = warm up at full T), then one step of T tokens under
`torch.profiler.profile(activities=[CPU], profile_memory=True, record_shapes=False, with_stack=True)`, from
`on_step_begin` to `on_step_end`. The profiler reports every allocation and free of torch's CPU allocator made on the
main thread while it runs (a free of a block allocated before it started is not reported); their running sum, in time
order, is the bytes allocated above what was allocated at the step's start (the models, AdamW's moments and the
trainer's state). The reported peak is the maximum of that sum over the step: peak allocated - allocated at the step's
start. It counts tensors' bytes, not pages (RSS), so it does not depend on glibc's heap or on what else the machine
runs, and the same code on the same shapes gives the same bytes. Also reported: the peak of each phase (forward and
backward, with the teacher scoring and the clipping; `optimizer.step()` with the trainer's callbacks around it, where
`update/norm` copies each bucket of parameters; the rest), which phase holds the step's peak, what is alive at the
peak, grouped by the code that allocated it (the profiler's Python stack), the step's seconds (the profiler on;
secondary), and each worker's peak RSS.

The cold runs exist for RAM: where a trainer's peak lies in its forward and backward, which AdamW's moments do not
touch, profiling its first step gives the same forward and backward without the moments (2 bytes per parameter each,
bf16: 2.1 GiB here) in RAM. Its `optimizer.step()` then allocates the moments, so a cold run's peak stands for the
step's only where it lies in the forward and backward (the table marks the others). Where a warm and a cold run of a
trainer both ran at one T, the report compares their forward and backward peaks.

The smallest T runs the `--repeat-trainers` `--repeats` times (default 2), each in a fresh process, to show that the
bytes repeat.

Writes bench_memory_bf16.json (every raw number) and bench_memory_bf16.md (the printed report) to `--out` after every
run; `--resume` keeps the runs already in that JSON (e.g. T = 16,384 measured by a second invocation with fewer
trainers).
"""

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict

import bench_gpu
import common
import torch


PAIR = {**bench_gpu.PAPER_PAIR, "layers": 2}  # --layers sets the blocks
FULL = dict(arch=PAIR, prompt=256, batch=1, completions=[2048, 8192, 16384], warmup_tokens=256, repeats=2)
FULL.update(shared_process=False)
QUICK = dict(FULL, arch=bench_gpu.TINY_PAIR, prompt=16, completions=[32, 64], warmup_tokens=8, shared_process=True)
RUNS = {  # name: (common.TRAINERS key, config overrides, warm-up step)
    "tv": (*bench_gpu.RUNS["tv"], True),
    "tv-fp32": ("tv", {"lm_head_precision": "float32"}, True),
    "tv-nonorm": (*bench_gpu.RUNS["tv-nonorm"], True),
    "distill": (*bench_gpu.RUNS["distill"], True),
    "distill-cold": (*bench_gpu.RUNS["distill"], False),
    "tv-cold": (*bench_gpu.RUNS["tv"], False),
}


def settings(optim=None):
    """Every trainer's config overrides: gradient checkpointing, `optim` (default `adamw_torch`), CPU bf16 autocast."""
    return {**bench_gpu.trainer_settings({"optim": optim}), "bf16": True}


TARGET = dict(completion=8192, trainer="tv", ratio=0.8)  # the target: tv / distill <= 0.8 at T = 8,192
WARMUP_STEPS = 1
AVAILABLE_GB = 11  # what a run at the real vocabulary waits for: its peak RSS (up to 10 GB) and a margin
NAME = "bench_memory_bf16"
MIB = 2**20
MARKER = "bench_memory_bf16::optimizer_step"  # a record_function around optimizer.step() and its callbacks
# The code whose version the results belong to (its SHA-256 is recorded: other work edits it while a run goes on)
SOURCES = (
    "tvopd_trl/chunked_logprob.py",
    "tvopd_trl/scoring.py",
    "tvopd_trl/callbacks.py",
    "tvopd_trl/bucketed_step.py",
    "tvopd_trl/trainer.py",
)
# Where a live block at the peak is attributed: its innermost Python frame in one of these (else the aten op)
OWN_CODE = ("tvopd_trl/", "trl/", "transformers/", "torch/optim/", "torch/utils/checkpoint", "accelerate/")


# ----------------------------------------------------------------------------------------------------------------------
# The measured step
# ----------------------------------------------------------------------------------------------------------------------


def shape_of(config, completion):
    return common.Shape(completion=completion, prompt=config["prompt"], batch=config["batch"], **config["arch"])


def warm_up_short(trainer, tokens):
    """With `tokens`, the trainer's first generation call returns the fixed completions cut to `tokens` (the warm-up
    step), later ones the whole completions; returns the list of the lengths each call returned."""
    lengths = []
    fixed = trainer._generate_single_turn  # common.use_fixed_completions's

    def generate(prompt_ids, *args, **kwargs):
        completions = fixed(prompt_ids, *args, **kwargs)
        if tokens and not lengths:
            completions = [completion[:tokens] for completion in completions]
        lengths.append([len(completion) for completion in completions])
        return completions

    trainer._generate_single_turn = generate
    return lengths


def _callbacks(step):
    """Two TrainerCallbacks: the first (put ahead of every other callback) starts torch.profiler at `on_step_begin` of
    optimizer step `step` (0-based) and opens MARKER at `on_pre_optimizer_step`; the second (put after every other)
    closes MARKER at `on_optimizer_step` and stops the profiler at `on_step_end`, so that the `update/norm` copy,
    taken and freed by the trainer's own callbacks, falls inside MARKER."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    class Begin(TrainerCallback):
        def __init__(self):
            self.profiler = self.marker = None
            self.seconds = None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step != step:
                return
            common.settle()
            self.profiler = profile(
                activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False, with_stack=True
            )
            self.profiler.__enter__()
            self.started = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if self.profiler is not None and self.seconds is None:
                self.marker = torch.autograd.profiler.record_function(MARKER)
                self.marker.__enter__()

    class End(TrainerCallback):
        def __init__(self, begin):
            self.begin = begin

        def on_optimizer_step(self, args, state, control, **kwargs):
            if self.begin.marker is not None:
                self.begin.marker.__exit__(None, None, None)
                self.begin.marker = None

        def on_step_end(self, args, state, control, **kwargs):
            if self.begin.profiler is not None and self.begin.seconds is None:
                self.begin.seconds = time.perf_counter() - self.begin.started
                self.begin.profiler.__exit__(None, None, None)

    begin = Begin()
    return begin, End(begin)


def _label(node):
    """Where an allocation was made: the innermost Python frame of OWN_CODE above it, and the aten op."""
    from torch._C._profiler import _EventType

    op = node.parent.name if node.parent is not None else "(outside any op)"
    frame = None
    parent = node.parent
    while parent is not None:
        if parent.tag == _EventType.PyCall and any(part in parent.name for part in OWN_CODE):
            frame = parent.name
            break
        parent = parent.parent
    op = re.sub(r" at 0x[0-9a-f]+", "", op)  # "<built-in method mul_ of Tensor object at 0x7f…>"
    if frame is None:
        return op
    # "…/site-packages/trl/kernels/chunked_divergence.py(418): forward" -> "trl/kernels/chunked_divergence.py(418): forward"
    for part in OWN_CODE:
        if part in frame:
            frame = part + frame.split(part, 1)[1]
            break
    return f"{frame} [{op}]"


def analyse(profiler, top=8):
    """The step's allocation timeline from the profiler's event tree: the peak of the running sum of allocations and
    frees (bytes above the step's start), the peak of each phase, and the blocks alive at the peak by label."""
    from torch._C._profiler import _EventType

    allocations, markers = [], []
    stack = list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu" and fields.alloc_size:
                allocations.append((node.start_time_ns, fields.alloc_size, fields.ptr, node))
        elif node.name == MARKER:
            markers.append((node.start_time_ns, node.end_time_ns))
        stack.extend(node.children)
    allocations.sort(key=lambda event: event[0])
    window = markers[0] if markers else (None, None)

    def phase(time_ns):
        if window[0] is None or time_ns < window[0]:
            return "forward_backward"
        return "optimizer_step" if time_ns <= window[1] else "after"

    # Only blocks allocated during the step count: a free of any other (one allocated under an earlier profiler in
    # this process, which torch's allocator still reports) is left out, so that the sum is the step's own
    running = peak = 0
    phase_peaks = {"forward_backward": 0, "optimizer_step": 0, "after": 0}
    live, live_at_peak, foreign_frees = {}, {}, 0
    for time_ns, size, ptr, node in allocations:
        if size > 0:
            live[ptr] = (size, node)
        elif ptr in live:
            del live[ptr]
        else:
            foreign_frees += 1
            continue
        running += size
        name = phase(time_ns)
        phase_peaks[name] = max(phase_peaks[name], running)
        if running > peak:
            peak, peak_time, live_at_peak = running, time_ns, None
        elif live_at_peak is None and size < 0:  # the first free after a new peak: what was alive at it
            live_at_peak = dict(live)
            live_at_peak[ptr] = (-size, node)
    if live_at_peak is None:
        live_at_peak = dict(live)
    by_label = {}
    for size, node in live_at_peak.values():
        entry = by_label.setdefault(_label(node), [0, 0])
        entry[0] += size
        entry[1] += 1
    holders = sorted(by_label.items(), key=lambda item: (-item[1][0], item[0]))
    return {
        "peak_bytes": peak,
        "end_bytes": running,
        "peak_phase": phase(peak_time) if peak else None,
        "phase_peak_bytes": phase_peaks,
        "events": len(allocations),
        "frees_of_earlier_blocks": foreign_frees,
        "live_at_peak": [{"label": label, "bytes": b, "blocks": n} for label, (b, n) in holders[:top]],
        "live_at_peak_other_bytes": sum(b for _, (b, _) in holders[top:]),
    }


def state_bytes(trainer):
    """Bytes of what every step starts with: the student's and the teacher's weights and the optimizer's state."""
    tensors = list(trainer.model.parameters()) + list(trainer.teacher_model.parameters())
    tensors += [v for state in trainer.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def point_worker(job):
    """The trainers `job["trainers"]` at one T, one after the other in this fresh process (one each in the full run),
    each on fresh models: a warm-up step (unless cold), then the profiled step. At the real vocabulary each first
    waits until the machine has AVAILABLE_GB available: the machine is shared, and one run needs up to 10 GB."""
    results = []
    for name in job["trainers"]:
        waited = wait_for_memory(AVAILABLE_GB if job["shape"].vocab > 100_000 else 0)
        result = measure(job["shape"], name, job["warmup_tokens"], job.get("optim"))
        results.append({**result, "waited_for_memory_s": waited})
        common.settle()
    return results


def wait_for_memory(gigabytes, poll_s=30, timeout_s=3600):
    """Seconds waited until /proc/meminfo's MemAvailable reached `gigabytes` (at most `timeout_s`, then it goes on)."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) * 1024
        if available >= gigabytes * 1e9:
            break
        print(
            f"[{NAME}] waiting for {gigabytes} GB available ({available / 1e9:.1f} now)", file=sys.stderr, flush=True
        )
        time.sleep(poll_s)
    return time.perf_counter() - started


def measure(shape, name, warmup_tokens, optim=None):
    from transformers.trainer_callback import PrinterCallback

    kind, overrides, warm = RUNS[name]
    warmup_steps = WARMUP_STEPS if warm else 0
    started = time.perf_counter()
    data = bench_gpu.rollout(shape, False, None)  # uniform tokens, seeded
    models = bench_gpu.build_pair(shape, "bfloat16", "bfloat16")
    trainer = common.build_trainer(
        kind,
        shape,
        data,
        warmup_steps + 1,
        common.scratch_dir(name),
        config_overrides={**settings(optim), **overrides},
        models=models,
    )
    models = None
    trainer.remove_callback(PrinterCallback)
    lengths = warm_up_short(trainer, warmup_tokens if warm else 0)
    begin, end = _callbacks(warmup_steps)
    trainer.callback_handler.callbacks.insert(0, begin)
    trainer.add_callback(end)
    build_seconds = time.perf_counter() - started
    seconds = common.train_and_time(trainer)
    result = analyse(begin.profiler)
    begin.profiler = None
    dtypes = {str(p.dtype) for p in trainer.model.parameters()}
    fields = ("lm_head_precision", "log_update_norm", "update_norm_interval", "bf16", "optim", "beta")
    result["effective_config"] = {f: getattr(trainer.args, f) for f in fields if hasattr(trainer.args, f)}
    result.update(
        trainer=name,
        completion=shape.completion,
        warmup_steps=warmup_steps,
        step_seconds=seconds,
        profiled_step_seconds=begin.seconds,
        build_seconds=build_seconds,
        completion_lengths=lengths,
        student_dtypes=sorted(dtypes),
        state_bytes=state_bytes(trainer),
        student_parameters=sum(p.numel() for p in trainer.model.parameters()),
        lifetime_peak_rss_mb=common.lifetime_peak_rss_mb(),
        threads=torch.get_num_threads(),
        config_overrides={**settings(optim), **overrides},
        sources=source_hashes(),
    )
    assert len(lengths) == warmup_steps + 1 and lengths[-1] == [shape.completion], lengths  # the whole T profiled
    trainer = begin = None
    return result


def source_hashes():
    import hashlib
    import subprocess

    root = bench_gpu.common_root()
    hashes = {path: hashlib.sha256(open(os.path.join(root, path), "rb").read()).hexdigest()[:12] for path in SOURCES}
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root)
        hashes["HEAD"] = head.stdout.strip()
    except OSError:
        pass
    return hashes


# ----------------------------------------------------------------------------------------------------------------------
# Estimate and report
# ----------------------------------------------------------------------------------------------------------------------


def matmul_rates():
    """GFLOP/s of this process's float32 and bfloat16 matmuls, measured on one (1,024 x 1,536) x (1,536 x 8,192)
    product each: the rates of the estimate."""
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(1024, 1536, dtype=dtype), torch.randn(1536, 8192, dtype=dtype)
        torch.mm(a, b)
        start = time.perf_counter()
        torch.mm(a, b)
        rates[str(dtype).split(".")[1]] = 2 * 1024 * 1536 * 8192 / (time.perf_counter() - start) / 1e9
    return rates


def estimated_seconds(shape, name, rates):
    """A run's seconds: the LM-head projections in float32 (tv: the teacher's forward, the student's forward, its
    backward's recomputed tile and two gradient products; distill: both heads forward, both again backward and two
    gradient products; `lm_head_precision="model"` upcasts each chunk on CPU, the same float32 products) and 5 forwards
    of the backbone in bf16 (the teacher, the student, checkpointing's recompute, a backward of 2), for the profiled
    step and the warm-up step, plus 30 s to build the models."""
    flops = bench_gpu.floor_flops(asdict(shape), shape.batch, shape.prompt, shape.completion)
    head = 2 * shape.hidden * shape.vocab * shape.batch * shape.completion
    backbone = flops["teacher"] - head
    kind, _, warm = RUNS[name]
    step = (6 if kind == "distill" else 5) * head / (rates["float32"] * 1e9) + 5 * backbone / (rates["bfloat16"] * 1e9)
    build = 30 if shape.vocab > 100_000 else 2
    return build + step * (1 + 1 / 8 if warm else 1)  # the warm-up: about an eighth of a T = 2,048 step, a bound


def mib(value):
    return common.fmt(value / MIB) if value is not None else "-"


def point_runs(results, completion):
    """{trainer: [runs]} of `completion`, in measurement order."""
    runs = {}
    for run in results:
        if run.get("completion") == completion:
            runs.setdefault(run["trainer"], []).append(run)
    return runs


def step_peak(runs, name):
    """(run name, peak bytes) of trainer `name` at one T: its warm run's, else its cold run's if that run's peak lies
    in the forward and backward (a cold run's optimizer.step() allocates AdamW's moments, which a warm step has)."""
    for candidate in (name, f"{name}-cold"):
        for run in runs.get(candidate, []):
            if "error" not in run and "peak_bytes" in run and (RUNS[candidate][2] or cold_peak_valid(run)):
                return candidate, run["peak_bytes"]
    return None, None


def cold_peak_valid(run):
    return run.get("peak_phase") == "forward_backward"


def table(results, completions, trainers):
    header = ["T", "trainer", "peak above step start (MiB)", "/ distill", "peak phase", "fwd+bwd peak (MiB)"]
    header += ["optimizer.step() peak (MiB)", "s/step", "worker peak RSS (MiB)", "runs", "repeat identical"]
    rows = []
    for completion in completions:
        runs = point_runs(results, completion)
        _, base = step_peak(runs, "distill")
        for name in trainers:
            for_name = runs.get(name)
            if not for_name:
                continue
            run = for_name[0]
            if "error" in run:
                rows.append([f"{completion:,}", name, f"failed: {run['error'][:100]}"] + ["-"] * (len(header) - 3))
                continue
            peaks = {r.get("peak_bytes") for r in for_name}
            phases = run["phase_peak_bytes"]
            valid = RUNS[name][2] or cold_peak_valid(run)
            ratio = common.fmt(run["peak_bytes"] / base) if base and valid else "-"
            rows.append(
                [
                    f"{completion:,}",
                    name,
                    mib(run["peak_bytes"]) if valid else f"({mib(run['peak_bytes'])}: AdamW's moments)",
                    ratio,
                    run["peak_phase"],
                    mib(phases["forward_backward"]),
                    mib(phases["optimizer_step"]),
                    common.fmt(run["step_seconds"][-1]),
                    common.fmt(run["lifetime_peak_rss_mb"]),
                    len(for_name),
                    ("yes" if len(peaks) == 1 else "NO: " + ", ".join(mib(p) for p in sorted(peaks)))
                    if len(for_name) > 1
                    else "-",
                ]
            )
    return common.markdown_table(header, rows)


def holders_markdown(results, completions, trainers):
    parts = []
    for completion in completions:
        runs = point_runs(results, completion)
        for name in trainers:
            run = (runs.get(name) or [{}])[0]
            if "live_at_peak" not in run:
                continue
            rows = [[h["label"], mib(h["bytes"]), h["blocks"]] for h in run["live_at_peak"]]
            rows.append(["everything else", mib(run["live_at_peak_other_bytes"]), "-"])
            parts.append(
                f"#### T = {completion:,}, {name}: {mib(run['peak_bytes'])} MiB at the peak ({run['peak_phase']})\n\n"
                + common.markdown_table(["allocated by", "MiB", "blocks"], rows)
            )
    return "\n\n".join(parts)


def verdicts(results):
    lines = []
    completions = sorted({r["completion"] for r in results if "completion" in r})
    for completion in completions:  # the cold runs against the warm ones, where both ran
        runs = point_runs(results, completion)
        for name in (n for n in RUNS if RUNS[n][2] and runs.get(n) and runs.get(f"{n}-cold")):
            warm, cold = (
                runs[n][0].get("phase_peak_bytes", {}).get("forward_backward") for n in (name, f"{name}-cold")
            )
            same = "the same bytes" if warm == cold else f"DIFFERENT: {mib(warm)} against {mib(cold)} MiB"
            lines.append(f"- T = {completion:,}: forward and backward's peak of {name}-cold against {name}: {same}")
    for completion in completions:
        runs = point_runs(results, completion)
        base_name, base = step_peak(runs, "distill")
        for name in ("tv", "tv-fp32", "tv-nonorm"):
            run_name, peak = step_peak(runs, name)
            if not peak or not base:
                continue
            ratio = peak / base
            line = f"- T = {completion:,}, {name} / distill = {ratio:.3f} ({mib(peak)} MiB of {run_name} against "
            line += f"{mib(base)} MiB of {base_name})"
            if completion == TARGET["completion"]:
                met = "met" if ratio <= TARGET["ratio"] else "missed"
                target = ", the target" if name == TARGET["trainer"] else ""
                line += f": <= {TARGET['ratio']}{target}: {met}"
            lines.append(line)
    return "\n".join(lines) or f"- (needs tv and distill at T = {TARGET['completion']:,})"


def report(info, config, cli, results, started):
    label = " (--quick validation configuration)" if cli.quick else ""
    arch = ", ".join(f"{k} {v}" for k, v in config["arch"].items())
    completions = sorted({r["completion"] for r in results if "completion" in r})
    trainers = [name for name in RUNS if any(r.get("trainer") == name for r in results)]
    text = [
        "## Machine\n\n" + common.machine_markdown(info),
        f"## Loss-phase peak allocated memory, bf16 student{label}\n\n"
        f"Qwen2 pair ({arch}), student and teacher bfloat16; B = {config['batch']} prompt of P = {config['prompt']} "
        f"tokens; `bf16=True`, gradient checkpointing, `{cli.optim or 'adamw_torch'}`. Peak = the maximum over one "
        f"loss-phase step (after a warm-up step of {config['warmup_tokens'] or 'T'} completion tokens) of the running sum of torch's "
        "CPU allocations and frees, i.e. peak allocated - allocated at the step's start; MiB = 2^20 bytes. "
        "`-cold`: profiled on its first step, without the warm-up, AdamW's moments allocated in its "
        "optimizer.step(): its peak stands for the step's only where it lies in the forward and backward. "
        "`/ distill`: to distill's peak at that T (distill-cold's where distill did not run). "
        "s/step: the profiled step, profiler on. `repeat identical`: the same bytes in every run of that row (fresh "
        "processes).\n\n" + table(results, completions, trainers),
        "## Target\n\n" + verdicts(results),
        "## What is alive at each peak\n\nBlocks allocated during the step and not yet freed at its peak, by the "
        "innermost Python frame of the library code that allocated them [and the aten op]; the first run of each "
        "row.\n\n" + holders_markdown(results, completions, trainers),
        f"Wall time: {time.perf_counter() - started:.0f} s.",
    ]
    return "\n\n".join(text)


# ----------------------------------------------------------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser, default_out=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--trainers", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    parser.add_argument("--completion", type=int, nargs="+", help="override the completion lengths")
    parser.add_argument("--layers", type=int, help="transformer blocks of both models (default 2)")
    parser.add_argument("--warmup-tokens", type=int, help="completion tokens of the warm-up step (0: T)")
    parser.add_argument("--repeats", type=int, help="runs of each --repeat-trainers at the smallest T (default 2)")
    parser.add_argument("--repeat-trainers", help="the trainers that --repeats applies to (default: every one)")
    parser.add_argument(
        "--replace", default="", help="with --resume, measure these trainers again at this invocation's T"
    )
    parser.add_argument(
        "--optim", help="every trainer's optimizer (default adamw_torch; the recipes' adamw_torch_fused)"
    )
    parser.add_argument("--resume", action="store_true", help="keep the runs already in --out's JSON")
    parser.add_argument("--name", default=NAME, help="the outputs' base name")
    parser.add_argument("--estimate-only", action="store_true", help="print the time estimate and exit")
    cli = parser.parse_args()
    cli.trainers = cli.trainers.split(",")
    cli.repeat_trainers = cli.repeat_trainers.split(",") if cli.repeat_trainers else cli.trainers
    cli.replace = [name for name in cli.replace.split(",") if name]
    unknown = set(cli.trainers + cli.repeat_trainers + cli.replace) - set(RUNS)
    if unknown:
        parser.error(f"unknown trainers {sorted(unknown)}; choose from {list(RUNS)}")
    return cli


def runs_of(config, cli, completion, name):
    """How many runs of trainer `name` at `completion`: `--repeats` at the smallest T for `--repeat-trainers`, else 1."""
    repeated = completion == min(config["completions"]) and name in cli.repeat_trainers
    return config["repeats"] if repeated else 1


def main():
    cli = parse_args()
    config = dict(QUICK if cli.quick else FULL)
    config["arch"] = {**config["arch"], **({"layers": cli.layers} if cli.layers else {})}
    config["completions"] = cli.completion or config["completions"]
    for key, flag in (("warmup_tokens", cli.warmup_tokens), ("repeats", cli.repeats)):
        config[key] = config[key] if flag is None else flag
    rates = matmul_rates()
    plan = {
        f"T={t} {name}": estimated_seconds(shape_of(config, t), name, rates) * runs_of(config, cli, t, name)
        for t in config["completions"]
        for name in cli.trainers
    }
    print(
        f"## Estimated time\n\n{sum(plan.values()) / 60:.1f} min ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in plan.items())
        + f"; measured float32 {rates['float32']:.0f} and bf16 {rates['bfloat16']:.0f} GFLOP/s at "
        f"{torch.get_num_threads()} threads)\n",
        flush=True,
    )
    if cli.estimate_only:
        return
    out, _, started, info = common.start(cli)
    path = os.path.join(out, f"{cli.name}.json")
    results = []
    if cli.resume and os.path.exists(path):
        with open(path) as f:
            results = [
                r
                for r in json.load(f)["results"]
                if "error" not in r
                and (r["trainer"] not in cli.replace or r["completion"] not in config["completions"])
            ]
    text = report(info, config, cli, results, started)
    for completion in config["completions"]:
        shape = shape_of(config, completion)
        repeats = max(runs_of(config, cli, completion, name) for name in cli.trainers)
        for repeat in range(repeats):
            todo = [
                name
                for name in cli.trainers
                if repeat < runs_of(config, cli, completion, name)
                and sum(1 for r in results if r.get("completion") == completion and r.get("trainer") == name) <= repeat
            ]
            # One process per run; with --quick, one per T and repeat (the bytes are the same either way)
            for names in [todo] if config["shared_process"] and todo else [[name] for name in todo]:
                print(
                    f"[{NAME}] T={completion}: {','.join(names)} (run {repeat + 1}/{repeats})",
                    file=sys.stderr,
                    flush=True,
                )
                job = common.job(
                    "point", shape, trainers=names, warmup_tokens=config["warmup_tokens"], optim=cli.optim
                )
                runs = common.run_worker(__file__, job)
                if isinstance(runs, dict):  # the worker failed: every run it had is marked so
                    runs = [{"trainer": name, **runs} for name in names]
                for run in runs:
                    results.append({"completion": completion, **run})
                    keys = ("trainer", "peak_bytes", "peak_phase", "error")
                    print(f"[{NAME}]   {json.dumps({k: run.get(k) for k in keys})}", file=sys.stderr, flush=True)
                text = report(info, config, cli, results, started)
                raw = {"machine": info, "config": config, "cli": vars(cli), "matmul_gflops": rates, "results": results}
                common.write_outputs(out, cli.name, raw, text)
    print(text)
    print(f"\nwrote {out}/{cli.name}.{{json,md}} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    if common.is_worker():
        common.serve_worker({"point": point_worker})
    else:
        main()
