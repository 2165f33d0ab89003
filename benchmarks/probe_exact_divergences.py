"""Peak memory of the exact reverse KL and TV (`TVOPDTrainer._exact_divergences`, used by advantage_mode="vopd" and
log_exact_tv=True) as the rollout grows: row-chunked, as the trainer runs it now, against one call over the whole
rollout, as it ran before.

    OMP_NUM_THREADS=1 python benchmarks/probe_exact_divergences.py            # V 151,936, H 256, T 256, 4 to 32 rows
    OMP_NUM_THREADS=1 python benchmarks/probe_exact_divergences.py --quick    # a small validation size (2 to 4 min)
    OMP_NUM_THREADS=1 python benchmarks/probe_exact_divergences.py --vocab 32000 --completion 1024 \
        --name probe_exact_divergences_v32000_t1024                          # where the rows' own state shows

Models as in common.py (2-layer Qwen2, hidden H, untied head, float32, random weights; student seed 0, teacher seed
1) and the `tv` trainer of `common.build_trainer`, built with per_device_train_batch_size = B and
gradient_accumulation_steps = M, so that one rollout is M micro-batches of B rows. The rollout is fixed and
pre-generated: B x max(M) prompts of P random tokens and completions of T random tokens (seeded, no padding); the point
with M micro-batches takes its first M x B rows. For M = 1, 2, 4, 8 and each of two modes, in a fresh process per
(M, mode): build the trainer, warm up with the same call on the first row alone (what any first call pages in once:
kernels' code, thread pools), settle, read the RSS, reset the peak, then one call under `torch.no_grad()` (as
`_score_completions` makes it):

    chunked  `trainer._exact_divergences(teacher, input_ids, attention_mask, logits_to_keep)`: both models' backbones and
             `exact_reverse_kl_and_tv` on B rows at a time (`TVOPDTrainer._row_chunks`)
    whole    the former behaviour (`whole_rollout` below): both models' `_get_last_hidden_state` over all M x B rows at
             once, then one `exact_reverse_kl_and_tv` call on them

The workers run with glibc's `MALLOC_MMAP_THRESHOLD_=131072` (`--glibc-default-malloc` leaves it unset): every
allocation of 128 KiB or more gets its own mapping, returned to the system when freed, so that the RSS follows the live
tensors rather than what glibc's heap keeps resident from earlier allocations (which made repeated measurements of the
same cell differ by hundreds of MB once the warm-up call had run).

Reported: the peak RSS increase of the call (peak - RSS before it), its seconds, the ratio chunked / whole, and the
exponent of each peak against the rollout rows (least-squares slope on log-log axes: 0 is flat, 1 linear). The
chunked process then also runs the whole-rollout call and reports the largest difference between the two results.
"""

import argparse
import os
import sys
import time

import common
import torch


FULL = dict(vocab=151936, hidden=256, completion=256, prompt=64, batch=4, micro_batches=[1, 2, 4, 8])
QUICK = dict(vocab=4096, hidden=32, completion=16, prompt=8, batch=2, micro_batches=[1, 2, 4, 8])
MODES = ("chunked", "whole")
MMAP_THRESHOLD = 131072  # bytes; glibc's default is dynamic, from 128 KiB up to 32 MiB
DATA_SEED = 3


def fixed_rollout(shape, rows):
    """The first `rows` rows of a seeded rollout of B x max(M) rows: prompts and completions of random token ids."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    prompt_ids = torch.randint(3, shape.vocab, (rows, shape.prompt), generator=generator)
    completion_ids = torch.randint(3, shape.vocab, (rows, shape.completion), generator=generator)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids}


def whole_rollout(trainer, input_ids, attention_mask, logits_to_keep):
    """The former behaviour: the two models' last hidden states over every row of the rollout at once, then one
    `exact_reverse_kl_and_tv` call over all of them."""
    from tvopd_trl.divergences import exact_reverse_kl_and_tv

    hidden_states, heads = [], []
    for model in (trainer.model, trainer.teacher_model):
        unwrapped = trainer.accelerator.unwrap_model(model)
        hidden_states.append(trainer._get_last_hidden_state(unwrapped, input_ids, attention_mask, logits_to_keep))
        heads.append(unwrapped.get_output_embeddings())
    return exact_reverse_kl_and_tv(*hidden_states, *heads, temperature=trainer.temperature)


def chunked(trainer, input_ids, attention_mask, logits_to_keep):
    return trainer._exact_divergences(trainer.teacher_model, input_ids, attention_mask, logits_to_keep)


def point_worker(job):
    shape, micro_batches = job["shape"], job["micro_batches"]
    rows = micro_batches * shape.batch
    # Every row of the largest rollout is drawn, so a smaller rollout is a prefix of a larger one
    data = fixed_rollout(shape, shape.batch * job["max_micro_batches"])
    data = {key: value[:rows] for key, value in data.items()}
    overrides = {"gradient_accumulation_steps": micro_batches, "log_exact_tv": True}
    trainer = common.build_trainer("tv", shape, data, 1, common.scratch_dir("tv"), overrides)
    input_ids = torch.cat([data["prompt_ids"], data["completion_ids"]], dim=1)
    attention_mask = torch.ones_like(input_ids)
    assert (
        len(trainer._row_chunks(attention_mask, trainer.model_wrapped)) == micro_batches
    )  # one chunk per micro-batch of B rows
    run = {"chunked": chunked, "whole": whole_rollout}[job["mode"]]
    common.settle()
    setup = common.rss_mb()
    # One-row warm-up (the same work in both modes): pages in what any first call costs once (kernels' code, thread
    # pools), so that the measurement holds only this call's own allocations
    with torch.no_grad():
        run(trainer, input_ids[:1], attention_mask[:1], shape.completion)
    common.settle()
    before = common.rss_mb()
    peak_reset = common.reset_peak_rss()
    started = time.perf_counter()
    with torch.no_grad():
        reverse_kl, tv = run(trainer, input_ids, attention_mask, shape.completion)
    seconds = time.perf_counter() - started
    peak = common.peak_rss_mb()
    result = {
        "rows": rows,
        "rss_after_setup_mb": setup,
        "rss_before_mb": before,
        "peak_rss_mb": peak,
        "peak_increase_mb": peak - before,
        "seconds": seconds,
        "peak_reset_supported": peak_reset,
        "mean_reverse_kl": reverse_kl.mean().item(),
        "mean_tv": tv.mean().item(),
    }
    if job["mode"] == "chunked" and job.get("check", True):
        with torch.no_grad():
            whole_kl, whole_tv = whole_rollout(trainer, input_ids, attention_mask, shape.completion)
        result["max_abs_diff_vs_whole"] = max(
            (reverse_kl - whole_kl).abs().max().item(), (tv - whole_tv).abs().max().item()
        )
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser, default_out=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--no-check", action="store_true", help="skip the chunked-against-whole comparison")
    parser.add_argument("--micro-batches", type=int, nargs="+", help="override the rollout sizes, in micro-batches")
    parser.add_argument("--completion", type=int, help="override the completion length T")
    parser.add_argument("--vocab", type=int, help="override the vocabulary size V")
    parser.add_argument("--name", default="probe_exact_divergences", help="base name of the JSON and Markdown outputs")
    parser.add_argument(
        "--glibc-default-malloc", action="store_true", help=f"do not set MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}"
    )
    cli = parser.parse_args()
    if not cli.glibc_default_malloc:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # inherited by the worker processes
    config = dict(QUICK if cli.quick else FULL)
    for key in ("micro_batches", "completion", "vocab"):
        config[key] = getattr(cli, key) or config[key]
    shape = common.Shape(
        vocab=config["vocab"],
        hidden=config["hidden"],
        completion=config["completion"],
        prompt=config["prompt"],
        batch=config["batch"],
    )
    out, _, started, info = common.start(cli)
    results = []
    for micro_batches in config["micro_batches"]:
        for mode in MODES:  # alternated, each in its own process
            print(
                f"[probe_exact_divergences] {micro_batches} x {shape.batch} rows: {mode}", file=sys.stderr, flush=True
            )
            job = common.job(
                "point",
                shape,
                mode=mode,
                micro_batches=micro_batches,
                max_micro_batches=max(config["micro_batches"]),
                check=not cli.no_check,
            )
            results.append({"micro_batches": micro_batches, "mode": mode, "result": common.run_worker(__file__, job)})

    def value(micro_batches, mode, key):
        entry = next(r["result"] for r in results if r["micro_batches"] == micro_batches and r["mode"] == mode)
        return entry.get(key)

    rows, series = [], {mode: [] for mode in MODES}
    for micro_batches in config["micro_batches"]:
        peaks = {mode: value(micro_batches, mode, "peak_increase_mb") for mode in MODES}
        for mode in MODES:
            series[mode].append(peaks[mode])
        ratio = peaks["chunked"] / peaks["whole"] if peaks["chunked"] and peaks["whole"] else None
        errors = [value(micro_batches, mode, "error") for mode in MODES]
        rows.append(
            [
                micro_batches,
                micro_batches * shape.batch,
                *(
                    common.fmt(peaks[mode]) if peaks[mode] is not None else f"failed: {error[:60]}"
                    for mode, error in zip(MODES, errors, strict=True)
                ),
                common.fmt(ratio),
                *(common.fmt(value(micro_batches, mode, "seconds")) for mode in MODES),
                common.fmt(value(micro_batches, "chunked", "max_abs_diff_vs_whole")),
            ]
        )
    row_counts = [m * shape.batch for m in config["micro_batches"]]
    slopes = {mode: common.exponent(row_counts, series[mode]) for mode in MODES}
    table = common.markdown_table(
        [
            "micro-batches",
            "rollout rows",
            "peak MB chunked",
            "peak MB whole",
            "chunked / whole",
            "s chunked",
            "s whole",
            "max abs diff",
        ],
        rows,
    )
    exponents = common.markdown_table(
        ["mode", "peak exponent against rollout rows"],
        [[mode, f"{slopes[mode]:.2f}" if slopes[mode] is not None else "-"] for mode in MODES],
    )
    label = " (--quick validation configuration)" if cli.quick else ""
    tile_mb = 256 * shape.vocab * 4 / 1e6  # one (chunk_size positions, V) float32 tile of exact_reverse_kl_and_tv
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    malloc_note = f", workers with MALLOC_MMAP_THRESHOLD_={threshold}" if threshold else ", glibc's default malloc"
    report = "\n\n".join(
        [
            "## Machine\n\n" + common.machine_markdown(info),
            f"## Peak memory of one exact-divergence call{label}\n\n"
            f"V={shape.vocab}, H={shape.hidden}, prompts of P={shape.prompt} and completions of T={shape.completion} "
            f"tokens, per_device_train_batch_size={shape.batch}, gradient_accumulation_steps = micro-batches; peak "
            "RSS increase of one call under torch.no_grad() above the RSS before it (after a one-row warm-up call), one "
            f"fresh process per cell{malloc_note}. "
            f"One 256-position float32 tile of the vocabulary is {tile_mb:,.0f} MB. 'max abs diff': the largest "
            "difference between the chunked and the whole-rollout reverse KL and TV, in the chunked process.\n\n"
            + table,
            "## Exponents (least-squares slope of log peak on log rollout rows)\n\n" + exponents,
        ]
    )
    print(report)
    common.write_outputs(
        out,
        cli.name,
        {
            "machine": info,
            "config": config,
            "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
            "exponents": slopes,
            "results": results,
        },
        report,
    )
    print(f"\nwrote {out}/{cli.name}.{{json,md}} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    if common.is_worker():
        common.serve_worker({"point": point_worker})
    else:
        main()
