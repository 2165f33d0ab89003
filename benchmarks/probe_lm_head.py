"""Time and memory of the LM-head kernels alone, on one vocabulary chunk: where the loss phase's time goes on CPU.

    OMP_NUM_THREADS=1 python benchmarks/probe_lm_head.py            # H 256, one 32,768-column chunk, 4 x (64 + 512)
    OMP_NUM_THREADS=1 python benchmarks/probe_lm_head.py --quick    # a small validation size (seconds)

Kernels, each forward then backward of sum(output) on random float32 inputs (hidden states N(0, 1), head weights
N(0, 0.02)):

    trl_fused_all        TRL's fused LM head (`ChunkedLogProbFunction` through `fused_lm_head=True`) as it runs
                         without Triton (CPU): every one of the B x (P + T - 1) positions is projected, prompt
                         positions included
    trl_fused_completion the same kernel on the B x T completion positions only (what its Triton path projects)
    lean_chunked         `tvopd_trl.chunked_logprob` (what `TVOPDTrainer._sampled_token_logps` runs on CPU, and
                         bench_floor.py's head) on the B x T completion positions
    lean_chunked_entropy the same, also returning each position's entropy (what the loss pass runs, for `entropy`)
    trl_fused_entropy    `trl_fused_completion` with `outputs=("log_probs", "entropy")` (the loss pass on GPU)
    trl_divergence       TRL's `ChunkedDivergenceFunction` (DistillationTrainer's loss), beta = 1, on B x T positions,
                         the teacher's hidden states and head without gradient

With V = the chunk width (32,768), the numbers are per chunk: a vocabulary of V' columns costs about V' / 32,768 times
as much time, while the memory above the baseline stays that of one chunk. Memory: peak RSS above the RSS just
before the call (the peak is reset before each kernel). Prints a Markdown table.
"""

import argparse
import statistics
import time

import common
import torch

from tvopd_trl.chunked_logprob import ChunkedSampledLogProb


FULL = dict(hidden=256, vocab=32768, batch=4, prompt=64, completion=512, repeats=2)
QUICK = dict(hidden=64, vocab=8192, batch=2, prompt=16, completion=64, repeats=2)
CHUNK = 32768


def kernels(hidden_size, vocab):
    from trl.kernels import ChunkedLogProbFunction
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    student_weight = (torch.randn(vocab, hidden_size) * 0.02).requires_grad_()
    teacher_weight = torch.randn(vocab, hidden_size) * 0.02

    def trl_fused(hidden, targets):
        return ChunkedLogProbFunction.apply(
            hidden, student_weight, None, targets, 1.0, CHUNK, None, 1.0, ("log_probs",)
        )[0]

    def trl_fused_entropy(hidden, targets):
        return ChunkedLogProbFunction.apply(
            hidden, student_weight, None, targets, 1.0, CHUNK, None, 1.0, ("log_probs", "entropy")
        )[0]

    def lean(hidden, targets):
        return ChunkedSampledLogProb.apply(hidden, student_weight, None, targets, 1.0, CHUNK)[0]

    def lean_entropy(hidden, targets):
        return ChunkedSampledLogProb.apply(hidden, student_weight, None, targets, 1.0, CHUNK, True)[0]

    def divergence(hidden, targets):
        teacher_hidden = torch.randn_like(hidden.detach())
        args = (hidden, student_weight, None, teacher_hidden, teacher_weight, None, 1.0, 1.0, 1.0, None, 1.0, None)
        return ChunkedDivergenceFunction.apply(*args)[0]

    return student_weight, {
        "trl_fused": trl_fused,
        "trl_fused_entropy": trl_fused_entropy,
        "lean_chunked": lean,
        "lean_chunked_entropy": lean_entropy,
        "trl_divergence": divergence,
    }


def measure(fn, weight, rows, hidden_size, vocab):
    hidden = torch.randn(rows, hidden_size).requires_grad_()
    targets = torch.randint(0, vocab, (rows,))
    weight.grad = None
    common.settle()
    before = common.rss_mb()
    common.reset_peak_rss()
    start = time.perf_counter()
    output = fn(hidden, targets)
    forward_done = time.perf_counter()
    output.sum().backward()
    end = time.perf_counter()
    return {"forward": forward_done - start, "backward": end - forward_done, "peak_mb": common.peak_rss_mb() - before}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, help="timed repeats of each kernel, after one untimed warm-up")
    cli = parser.parse_args()
    config = QUICK if cli.quick else FULL
    hidden_size, vocab, batch = config["hidden"], config["vocab"], config["batch"]
    all_rows = batch * (config["prompt"] + config["completion"] - 1)
    completion_rows = batch * config["completion"]
    torch.manual_seed(0)
    weight, fns = kernels(hidden_size, vocab)
    variants = [
        ("trl_fused_all", fns["trl_fused"], all_rows),
        ("trl_fused_completion", fns["trl_fused"], completion_rows),
        ("trl_fused_entropy", fns["trl_fused_entropy"], completion_rows),
        ("lean_chunked", fns["lean_chunked"], completion_rows),
        ("lean_chunked_entropy", fns["lean_chunked_entropy"], completion_rows),
        ("trl_divergence", fns["trl_divergence"], completion_rows),
    ]
    for _, fn, rows in variants:  # warm-up, untimed
        measure(fn, weight, rows, hidden_size, vocab)
    runs = {name: [] for name, _, _ in variants}
    for _ in range(cli.repeats or config["repeats"]):  # interleaved, so that drift hits every kernel alike
        for name, fn, rows in variants:
            runs[name].append(measure(fn, weight, rows, hidden_size, vocab))

    print("## Machine\n\n" + common.machine_markdown(common.machine_info()) + "\n")
    label = " (--quick validation configuration)" if cli.quick else ""
    print(
        f"## LM-head kernels{label}: H={hidden_size}, V={vocab}, B={batch}, P={config['prompt']}, T={config['completion']}\n"
    )
    rows = []
    lean = statistics.median(r["forward"] + r["backward"] for r in runs["lean_chunked"])
    for name, _, n in variants:
        forward = statistics.median(r["forward"] for r in runs[name])
        backward = statistics.median(r["backward"] for r in runs[name])
        peak = statistics.median(r["peak_mb"] for r in runs[name])
        rows.append(
            [
                name,
                n,
                common.fmt(forward),
                common.fmt(backward),
                common.fmt((forward + backward) / lean),
                common.fmt(peak),
            ]
        )
    header = ["kernel", "positions", "forward s", "backward s", "fwd+bwd / lean_chunked", "peak above baseline (MB)"]
    print(common.markdown_table(header, rows))


if __name__ == "__main__":
    main()
