"""The loss phase of one long row under DeepSpeed Ulysses sequence parallelism (SP = 2 processes) against one process
(SP = 1): peak memory per process and seconds per step, T = 4k to 32k tokens, on the real vocabulary (151,936 ids).

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu python benchmarks/bench_sequence_parallel.py --layers 4 \\
        --json benchmarks/results/sequence_parallel_cpu.json          # about 20 min on a 2-core AMD EPYC
    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu python benchmarks/bench_sequence_parallel.py --quick   # under a minute

On a machine with 2 or more GPUs (one GPU cannot run SP; each process takes the GPU of its rank, NCCL, memory from
`torch.cuda.max_memory_allocated`), the paper's student shape (DeepSeek-R1-Distill-Qwen-1.5B) in bfloat16:

    python benchmarks/bench_sequence_parallel.py --bf16 --layers 28 --hidden 1536 --intermediate 8960 --heads 12 \\
        --kv-heads 2 --lengths 16384 32768 65536 131072 --steps 3 --json sequence_parallel_gpu.json

What each process does (what the trainer's loss phase does per process under SP): a randomly initialised Qwen2-shaped
student (`sdpa` attention, float32 unless `--bf16`, untied LM head, gradient checkpointing on, as the paper trains)
forwards its contiguous shard of one row of T uniform token ids (T / SP tokens, `position_ids` of the full row),
scores the sampled tokens with `tvopd_trl.chunked_logprob.sampled_token_logprobs` on the shard's last hidden states
(no (T, V) logits), the targets being the next token on the full row (shifted before the slicing), and takes the loss
-sum(logp * A) / (T - 1) with a fixed random advantage A (seeded; 0 on the last position, which predicts nothing),
then backward. With SP = 2, `UlyssesSPAttentionHF.register_with_transformers` replaces `sdpa` process-wide by the
Ulysses all-to-all around it (the attention mask is dropped, sdpa runs causal over the gathered row); there is no
DeepSpeed engine, only `deepspeed.init_distributed` (gloo on CPU) and Ulysses' SP group. After the measured step, and
outside it, the gradients are summed over the SP group (the per-rank loss is a partial sum) so that they can be
compared with SP = 1's.

Measured per process, each (T, SP) in fresh processes, the processes of one point running side by side and the points
one after another: the model is built, one warm-up step runs on a row of `--warmup-tokens` tokens (which also
allocates every `.grad`, zeroed in place from then on, so the gradients are not counted as the step's), then
`--steps` measured steps. Peak memory = the largest, over the steps, of (peak - level at the step's start) of the
bytes held by live tensors: on CUDA `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`; on CPU the
running sum of the allocation and free events of torch's CPU allocator, recorded by `torch.profiler.profile(
profile_memory=True)` around the step (its overhead is negligible next to these steps' operations). The targets use
it. Beside it on CPU, the kernel's exact high-water mark of the resident set (VmHWM, reset through
/proc/self/clear_refs), which also holds what glibc keeps of freed blocks: blocks under its mmap threshold (which
grows up to 32 MiB) go back to the heap on free, not to the kernel, so the RSS overstates the smaller (per-token
tensors under 32 MiB) process, SP = 2's more than SP = 1's. The peak is the step's activations plus transient
buffers: the head's vocabulary tile (T / SP x 32,768 float32) and the head's gradient before it is added to `.grad`
(V x H x 4 bytes). Seconds = the median step, forward and backward, both ranks starting after a barrier, the slower
rank's. Per process is the largest over the ranks. On CPU each process has one core (OMP_NUM_THREADS=1): SP = 1
computes on one core, SP = 2 on two, as one and two GPUs.

Checks: each rank's log-probabilities are written out and those of SP = 2 (concatenated) compared with SP = 1's on
the same row, at every T (max |difference| <= `--atol`, 1e-5 in float32), and the gradients after the SP sum (each
parameter's norm; with `--quick`, every element): relative difference <= 1e-4. The exit status is 1 when a check
fails or a point fails to run, not when a target is missed. Targets:
  (a) at the longest T, SP = 2's peak per process at most 0.6 x SP = 1's;
  (b) under a fixed per-process budget, SP = 1's peak at the second longest T (16k by default; `--budget-at`), the
      longest row SP = 2 fits is at least 1.8 x SP = 1's. The longest row is where the peak, linear in T between the
      measured points and extrapolated past the last two, reaches the budget (SP = 1's is the budget's T by
      construction); the largest measured T within the budget (doubling T) is printed beside it.
"""

import os


os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from common import RESULT_PREFIX, fmt, machine_info, machine_markdown, markdown_table, peak_rss_mb, reset_peak_rss  # noqa: E402


FULL = dict(lengths=[4096, 8192, 16384, 32768], vocab=151936, hidden=256, intermediate=1024, layers=8, heads=4)
QUICK = dict(lengths=[256, 512], vocab=512, hidden=64, intermediate=128, layers=2, heads=4)
MODEL_SEED, ROW_SEED = 0, 1
MEMORY_TARGET, LENGTH_TARGET = 0.6, 1.8
GRAD_RTOL = 1e-4


# ----------------------------------------------------------------------------------------------------------------------
# One process of one (T, SP) point
# ----------------------------------------------------------------------------------------------------------------------


def build_student(job, device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=job["vocab"],
        hidden_size=job["hidden"],
        intermediate_size=job["intermediate"],
        num_hidden_layers=job["layers"],
        num_attention_heads=job["heads"],
        num_key_value_heads=job["kv_heads"],
        max_position_embeddings=max(32768, job["length"]),
        tie_word_embeddings=False,
        use_cache=False,
    )
    # Ulysses wraps `sdpa`; eager would build the (T, T) mask that SP exists to avoid
    config._attn_implementation = "sdpa"
    torch.manual_seed(MODEL_SEED)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model.to(torch.bfloat16 if job["bf16"] else torch.float32).train()
    # transformers >= 5.21 renamed it; both default to use_reentrant=False
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    return model


def make_row(length, vocab):
    """One row of `length` uniform token ids, the next token of each position (on the full row, before any sharding)
    and a fixed random advantage, 0 on the last position, whose target (0) is a placeholder."""
    generator = torch.Generator().manual_seed(ROW_SEED)
    input_ids = torch.randint(0, vocab, (1, length), generator=generator)
    advantages = torch.randn(length, generator=generator)
    advantages[-1] = 0.0
    targets = torch.cat([input_ids[0, 1:], input_ids.new_zeros(1)])
    return input_ids, targets, advantages


def loss_step(model, ids, positions, targets, advantages, tokens):
    """The loss phase of one shard: its last hidden states, the sampled tokens' log-probabilities through the chunked
    head, the shard's part of -sum(logp * A) / tokens, backward."""
    from tvopd_trl.chunked_logprob import sampled_token_logprobs

    hidden = model.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    logps = sampled_token_logprobs(hidden[0], head.weight, head.bias, targets, temperature=1.0)
    loss = -(logps * advantages).sum() / tokens
    loss.backward()
    return logps.detach(), loss.detach()


class StepPeak:
    """Memory of a span above its level at the start, in MiB: `allocated`, the peak of the bytes held by live
    tensors (CUDA's allocator peak; on CPU the running sum of the allocation and free events that the profiler
    records from torch's CPU allocator), and on CPU `rss`, the kernel's exact high-water mark of the resident set
    (VmHWM, reset at the start), which also holds what glibc keeps of freed blocks."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def start(self):
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated() / 2**20
            return
        if not reset_peak_rss():
            raise RuntimeError("/proc/self/clear_refs refused: the peak RSS cannot be reset on this kernel")
        self.base = peak_rss_mb()  # = the current RSS right after the reset
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self.profiler.__enter__()

    def stop(self):
        if self.cuda:
            torch.cuda.synchronize()
            return {"allocated": torch.cuda.max_memory_allocated() / 2**20 - self.base, "rss": None}
        rss = peak_rss_mb() - self.base
        self.profiler.__exit__(None, None, None)
        events = [e for e in self.profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
        live = peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            live += event.nbytes()  # negative for a free
            peak = max(peak, live)
        return {"allocated": peak / 2**20, "rss": rss}


def measure(job):
    sp = job["sp"]
    cuda = torch.cuda.is_available()
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    group, sp_rank = None, 0
    if sp > 1:
        import deepspeed

        # Ulysses' groups come from deepspeed.comm, which needs its own init (no engine: no extension is built)
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    model = build_student(job, device)
    if sp > 1:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model,
            core_attn_implementation="sdpa",
            sequence_parallel_size=sp,
            micro_batch_size=1,
            seq_length_is_variable=True,
        )
        group, sp_rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()

    def shard(length):
        input_ids, targets, advantages = make_row(length, job["vocab"])
        width = length // sp
        part = slice(sp_rank * width, (sp_rank + 1) * width)
        positions = torch.arange(length).unsqueeze(0)
        tensors = (input_ids[:, part], positions[:, part], targets[part], advantages[part])
        return *(t.to(device) for t in tensors), length - 1

    def barrier():
        if sp > 1:
            torch.distributed.barrier(group=group)

    loss_step(model, *shard(min(job["warmup_tokens"], job["length"])))
    row = shard(job["length"])
    peak, seconds, peaks = StepPeak(device), [], []
    for _ in range(job["steps"]):
        # In place, so that the gradients stay allocated and out of the step's peak
        for p in model.parameters():
            p.grad.zero_()
        barrier()
        peak.start()
        start = time.perf_counter()
        logps, loss = loss_step(model, *row)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        peaks.append(peak.stop())
    result = {"rank": rank, "seconds": seconds, "device": str(device)}
    result |= {"peak_mb": [p["allocated"] for p in peaks], "rss_peak_mb": [p["rss"] for p in peaks]}
    if sp > 1:
        start = time.perf_counter()
        for p in model.parameters():
            torch.distributed.all_reduce(p.grad, group=group)
        torch.distributed.all_reduce(loss, group=group)
        result["grad_sum_seconds"] = time.perf_counter() - start
    result["loss"] = loss.item()
    torch.save(logps.float().cpu(), os.path.join(job["out"], f"logps-sp{sp}-rank{sp_rank}.pt"))
    if sp_rank == 0:
        grads = {name: p.grad.float().cpu() for name, p in model.named_parameters()}
        norms = {name: g.double().norm().item() for name, g in grads.items()}
        torch.save(grads if job["save_grads"] else norms, os.path.join(job["out"], f"grads-sp{sp}.pt"))
    if sp > 1:
        torch.distributed.destroy_process_group()
    return result


# ----------------------------------------------------------------------------------------------------------------------
# The grid: processes, checks, report
# ----------------------------------------------------------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_point(job, timeout):
    """Runs the `job["sp"]` processes of one point side by side; their results, or `{"error": ...}`."""
    sp, port, procs = job["sp"], free_port(), []
    for rank in range(sp):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if not torch.cuda.is_available():
            env.setdefault("DS_ACCELERATOR", "cpu")
        if sp > 1:
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(sp),
                LOCAL_WORLD_SIZE=str(sp),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        log = open(os.path.join(job["out"], f"log-sp{sp}-rank{rank}.txt"), "w+")
        command = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job)]
        procs.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    deadline, results, errors = time.monotonic() + timeout, [], []
    for proc, log in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            errors.append(f"timed out after {timeout} s")
        log.seek(0)
        lines = log.read().splitlines()
        log.close()
        reported = [line for line in lines if line.startswith(RESULT_PREFIX)]
        if reported:
            results.append(json.loads(reported[-1][len(RESULT_PREFIX) :]))
        elif proc.returncode:
            killed = " (killed, likely out of memory)" if proc.returncode == -9 else ""
            errors.append(f"exit {proc.returncode}{killed}: {(lines or [''])[-1][-300:]}")
    if errors:
        return {"error": "; ".join(errors)}
    rss = [m for r in results for m in r["rss_peak_mb"] if m is not None]
    return {
        "peak_mb": max(max(r["peak_mb"]) for r in results),
        "rss_peak_mb": max(rss) if rss else None,
        "seconds": max(statistics.median(r["seconds"]) for r in results),
        "ranks": results,
    }


def compare(tmp, sp, save_grads):
    """Max |logp difference| of SP = `sp` against SP = 1 on the same row, and the gradients' worst relative
    difference (per element with `save_grads`, else per parameter norm)."""
    reference = torch.load(os.path.join(tmp, "logps-sp1-rank0.pt"))
    sharded = torch.cat([torch.load(os.path.join(tmp, f"logps-sp{sp}-rank{r}.pt")) for r in range(sp)])
    logp_diff = (sharded.double() - reference.double()).abs().max().item()
    ref_grads = torch.load(os.path.join(tmp, "grads-sp1.pt"))
    grads = torch.load(os.path.join(tmp, f"grads-sp{sp}.pt"))
    worst = 0.0
    for name, ref in ref_grads.items():
        if save_grads:
            scale = ref.double().abs().max().clamp(min=1e-30)
            worst = max(worst, ((grads[name].double() - ref.double()).abs().max() / scale).item())
        else:
            worst = max(worst, abs(grads[name] - ref) / max(abs(ref), 1e-30))
    return logp_diff, worst


def longest_within(points, budget):
    """(estimate, largest measured T) of the longest row whose peak stays within `budget`: the peak linear in T
    between the measured points `[(T, peak)]`, extrapolated past the last two."""
    points = sorted(points)
    measured = max((t for t, m in points if m <= budget), default=None)
    if points[0][1] > budget:
        return points[0][0] * budget / points[0][1], measured
    for (t0, m0), (t1, m1) in zip(points, points[1:], strict=False):
        if m1 >= budget:
            return t0 + (t1 - t0) * (budget - m0) / (m1 - m0), measured
    if len(points) < 2:
        return float("inf"), measured
    (t0, m0), (t1, m1) = points[-2:]
    slope = (m1 - m0) / (t1 - t0)
    return (t1 + (budget - m1) / slope if slope > 0 else float("inf")), measured


def tokens(value):
    return f"{value / 1024:.1f}k" if value != float("inf") else "inf"


def targets(config, grid, sp, key, label):
    """The lines of targets (a) and (b) on the peak `key` of each point, and their verdicts."""
    lines, verdicts = [], {}
    note = " (informative only at --quick sizes: fixed buffers dominate)" if config["quick"] else ""
    longest, budget_at = max(grid), config["budget_at"]
    one, many = grid[longest][1].get(key), grid[longest][sp].get(key)
    if one and many:
        ratio = many / one
        verdicts["memory"] = ratio <= MEMORY_TARGET
        lines.append(
            f"Target (a), {label}, at T={longest:,}: SP={sp} peak per process / SP=1's = {ratio:.3f} <= "
            f"{MEMORY_TARGET}: {'PASS' if verdicts['memory'] else 'FAIL'}{note}"
        )
    curves = {s: [(t, p[s][key]) for t, p in grid.items() if p[s].get(key)] for s in (1, sp)}
    budget = grid[budget_at][1].get(key) if budget_at in grid else None
    if budget and curves[sp]:
        (est1, grid1), (est_sp, grid_sp) = longest_within(curves[1], budget), longest_within(curves[sp], budget)
        ratio = est_sp / est1
        verdicts["length"] = ratio >= LENGTH_TARGET
        doubling = f"{grid_sp / grid1:.1f}x" if grid1 and grid_sp else "-"
        bound = " (at least: the longest measured T fits)" if grid_sp == longest else ""
        lines.append(
            f"Target (b), {label}, budget = SP=1 peak at T={budget_at:,} = {budget:,.0f} MiB per process: longest "
            f"row SP=1 {tokens(est1)}, SP={sp} {tokens(est_sp)} (peak linear in T between the measured points, "
            f"extrapolated past the last two) = {ratio:.2f}x >= {LENGTH_TARGET}: "
            f"{'PASS' if verdicts['length'] else 'FAIL'}{note}; largest measured T within it (doubling T): SP=1 "
            f"{grid1 and f'{grid1:,}'}, SP={sp} {grid_sp and f'{grid_sp:,}'} = {doubling}{bound}"
        )
    return lines, verdicts


def report(config, grid, sp, atol):
    with_rss = any(p[s].get("rss_peak_mb") for p in grid.values() for s in (1, sp))
    keys = ("peak_mb", "rss_peak_mb", "seconds") if with_rss else ("peak_mb", "seconds")
    rows, checks_ok = [], True
    for length, point in grid.items():
        one, many = point[1], point[sp]
        cells = [f"{length:,}"]
        for key in keys:
            a, b = one.get(key), many.get(key)
            cells += [fmt(a), fmt(b), fmt(b / a if a and b else None)]
        check = point.get("check")
        if check:
            ok = check["logp_max_abs_diff"] <= atol and check["grad_max_rel_diff"] <= GRAD_RTOL
            checks_ok &= ok
            cells += [f"{check['logp_max_abs_diff']:.1e}", f"{check['grad_max_rel_diff']:.1e}"]
        else:
            checks_ok = False
            cells += ["error", "error"]
        rows.append(cells)
    names = {"peak_mb": "peak MiB", "rss_peak_mb": "RSS peak MiB", "seconds": "s/step"}
    header = ["T"]
    for key in keys:
        header += [f"SP=1 {names[key]}", f"SP={sp} {names[key]}/proc", f"SP{sp}/SP1"]
    lines = [markdown_table(header + ["max abs logp diff", "grad max rel diff"], rows), ""]
    for length, point in grid.items():
        for s in (1, sp):
            if "error" in point[s]:
                lines.append(f"- T={length:,} SP={s}: {point[s]['error']}")
    grad_kind = "every element" if config["save_grads"] else "each parameter's norm"
    lines.append(
        f"Equality check SP={sp} vs SP=1 (logp max abs diff <= {atol:g}, gradients after the SP sum, {grad_kind}, "
        f"rel diff <= {GRAD_RTOL:g}, at every T): {'PASS' if checks_ok else 'FAIL'}"
    )
    primary, verdicts = targets(config, grid, sp, "peak_mb", "live tensors")
    lines += primary
    if with_rss:
        lines += [f"  informative: {line}" for line in targets(config, grid, sp, "rss_peak_mb", "RSS")[0]]
    return "\n".join(lines), {"checks": checks_ok, **verdicts}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and rows: the equality check, < 1 min on CPU")
    parser.add_argument("--lengths", type=int, nargs="+", help="tokens per row (each divisible by --sp)")
    parser.add_argument("--layers", type=int, help="decoder layers (default 8; --quick 2)")
    parser.add_argument("--hidden", type=int, help="hidden size (default 256; --quick 64)")
    parser.add_argument("--intermediate", type=int, help="MLP width (default 1024; --quick 128)")
    parser.add_argument("--heads", type=int, help="attention heads (default 4), divisible by --sp")
    parser.add_argument("--kv-heads", type=int, default=2, help="key-value heads (default 2)")
    parser.add_argument("--vocab", type=int, help="vocabulary size (default 151,936, Qwen2's; --quick 512)")
    parser.add_argument("--sp", type=int, default=2, help="the SP size compared with SP=1 (default 2)")
    parser.add_argument("--bf16", action="store_true", help="the student in bfloat16 (the head's softmax stays fp32)")
    parser.add_argument("--steps", type=int, default=1, help="measured steps per point (median; default 1)")
    parser.add_argument("--warmup-tokens", type=int, default=512, help="the warm-up row's tokens (default 512)")
    parser.add_argument("--budget-at", type=int, help="the T whose SP=1 peak is target (b)'s budget (2nd longest)")
    parser.add_argument("--atol", type=float, help="logp tolerance SP vs SP=1 (default 1e-5; 5e-2 with --bf16)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per point (default 3600)")
    parser.add_argument("--json", help="write every number to this path")
    cli = parser.parse_args()

    base = QUICK if cli.quick else FULL
    overrides = {"lengths": cli.lengths, "layers": cli.layers, "hidden": cli.hidden, "vocab": cli.vocab}
    overrides |= {"intermediate": cli.intermediate, "heads": cli.heads}
    config = base | {k: v for k, v in overrides.items() if v is not None}
    config["lengths"] = sorted(config["lengths"])
    config |= {
        "quick": cli.quick,
        "kv_heads": cli.kv_heads,
        "sp": cli.sp,
        "bf16": cli.bf16,
        "steps": cli.steps,
        "warmup_tokens": cli.warmup_tokens,
        # every element is cheap to keep only for a small head
        "save_grads": config["vocab"] * config["hidden"] <= 2**20,
        "budget_at": cli.budget_at or config["lengths"][-2 if len(config["lengths"]) > 1 else -1],
    }
    atol = cli.atol if cli.atol is not None else (5e-2 if cli.bf16 else 1e-5)
    if any(t % cli.sp for t in config["lengths"]) or config["heads"] % cli.sp:
        parser.error(f"every length and --heads must be divisible by --sp {cli.sp}")
    if torch.cuda.is_available() and torch.cuda.device_count() < cli.sp:
        parser.error(f"SP={cli.sp} needs {cli.sp} GPUs, {torch.cuda.device_count()} visible")

    started = time.perf_counter()
    command = " ".join(
        [f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "DS_ACCELERATOR") if k in os.environ]
        + ["python", os.path.relpath(__file__), *map(shlex.quote, sys.argv[1:])]
    )
    info = machine_info()
    info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    model = {k: config[k] for k in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads")}
    memory = (
        "torch.cuda.max_memory_allocated"
        if torch.cuda.is_available()
        else "live tensors' peak (torch profiler's CPU allocator events; beside it the RSS high-water mark, VmHWM)"
    )
    print(f"## Command\n\n    {command}\n\n## Machine\n\n{machine_markdown(info)}\n", flush=True)
    print(
        f"Model: Qwen2 {model}, {'bf16' if cli.bf16 else 'fp32'}, sdpa, untied head, gradient checkpointing. Memory: "
        f"{memory} over the forward and backward of one row, per process, after the model and a "
        f"{cli.warmup_tokens}-token warm-up step. Time: median of {cli.steps} step(s), the slower rank.\n",
        flush=True,
    )
    grid = {}
    with tempfile.TemporaryDirectory(prefix="tvopd-bench-sp-") as tmp:
        for length in config["lengths"]:
            grid[length] = {}
            for sp in (1, cli.sp):
                job = {**config, "length": length, "sp": sp, "out": tmp}
                grid[length][sp] = point = run_point(job, cli.timeout)
                shown = point.get("error") or f"{point['peak_mb']:,.0f} MiB, {point['seconds']:.2f} s"
                print(f"T={length:,} SP={sp}: {shown}", flush=True)
            if "error" not in grid[length][1] and "error" not in grid[length][cli.sp]:
                logp_diff, grad_diff = compare(tmp, cli.sp, config["save_grads"])
                grid[length]["check"] = {"logp_max_abs_diff": logp_diff, "grad_max_rel_diff": grad_diff}
    table, verdicts = report(config, grid, cli.sp, atol)
    print(f"\n{table}\n\nTotal {time.perf_counter() - started:.0f} s.\n", flush=True)
    print(
        "On 2 or more GPUs (nccl, torch.cuda.max_memory_allocated), e.g. the paper's student shape:\n\n    python "
        "benchmarks/bench_sequence_parallel.py --bf16 --layers 28 --hidden 1536 --intermediate 8960 --heads 12 "
        "--kv-heads 2 --lengths 16384 32768 65536 131072 --steps 3 --json sequence_parallel_gpu.json",
        flush=True,
    )
    if cli.json:
        os.makedirs(os.path.dirname(os.path.abspath(cli.json)), exist_ok=True)
        with open(cli.json, "w") as f:
            results = {"command": command, "machine": info, "config": config, "atol": atol, "verdicts": verdicts}
            json.dump(results | {"grid": {str(t): p for t, p in grid.items()}}, f, indent=1)
    sys.exit(0 if verdicts["checks"] else 1)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        print(RESULT_PREFIX + json.dumps(measure(json.loads(sys.argv[2]))), flush=True)
    else:
        main()
