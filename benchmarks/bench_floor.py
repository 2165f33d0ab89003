"""The physical floor of a sampled-token OPD step, and TV-OPD's loss-phase step time as a ratio to it.

    OMP_NUM_THREADS=1 python benchmarks/bench_floor.py            # the full grid
    OMP_NUM_THREADS=1 python benchmarks/bench_floor.py --quick    # a small validation grid (about a minute)

The floor is a bare PyTorch loop over the same fixed rollout, models and optimizer as `bench_step.py`'s loss phase,
doing only the work that sampled-token OPD cannot avoid, once:

1. teacher: one no-grad backbone forward over the B x (P + T) tokens, then the log-probability of each of the B x T
   sampled completion tokens through its LM head;
2. student: the same with gradient, then the loss -mean(A * exp(logp - logp.detach())), A = teacher_logp -
   logp.detach() (the on-policy policy gradient of Raw OPD), and one backward;
3. one AdamW step (the class and arguments `transformers.Trainer` would use) and `zero_grad`.

The LM-head log-probabilities use the chunked log-softmax `TVOPDTrainer` runs on CPU
(`tvopd_trl.chunked_logprob`): the vocabulary is cut in chunks of 32,768 columns; going forward each chunk's logits are
folded into a running logsumexp and the sampled token's logit is gathered; going backward each chunk's logits are
recomputed to form d logp / d logits = 1[target] - softmax. Only the B x T completion positions are projected (the
prompt's positions predict no sampled token). No gradient clipping, no metrics, no trainer.

Each grid point runs in one fresh process that alternates the floor and each trainer (floor, tv, floor, tv, ...),
`--steps` steps each per round, the first dropped as warm-up; memory is measured for each in its own fresh process
(peak RSS over 2 steps after setup, and the activation memory: peak - setup RSS - gradient and AdamW state).
Prints the machine and a Markdown table; writes bench_floor.{json,md,png} to `--out`.
"""

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict

import common
import torch

from tvopd_trl.chunked_logprob import sampled_token_logprobs


FULL = dict(vocabs=[32000, 151936], hiddens=[64, 256], completions=[128, 512], prompt=64, batch=4, rounds=4, steps=3)
QUICK = dict(vocabs=[1024, 4096], hiddens=[32], completions=[16], prompt=8, batch=4, rounds=2, steps=2)
MEMORY_STEPS = 2
WARMUP_STEPS = 1


# ----------------------------------------------------------------------------------------------------------------------
# The floor
# ----------------------------------------------------------------------------------------------------------------------


def completion_logps(model, input_ids, prompt_length):
    """Float32 log-probabilities of the completion tokens `input_ids[:, prompt_length:]` under `model`, flattened."""
    hidden = model.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)
    hidden = hidden.last_hidden_state[:, prompt_length - 1 : -1]  # the positions that predict the completion
    targets = input_ids[:, prompt_length:].reshape(-1)
    return sampled_token_logprobs(hidden.reshape(-1, hidden.size(-1)), model.lm_head.weight, None, targets)


class Floor:
    """The bare loop on fresh seed-0 / seed-1 models and the Trainer's optimizer."""

    def __init__(self, shape, data):
        from transformers import Trainer, TrainingArguments

        self.student = common.build_model(shape, common.STUDENT_SEED).train()
        self.teacher = common.build_model(shape, common.TEACHER_SEED)
        args = TrainingArguments(output_dir=common.scratch_dir("floor"), use_cpu=True, learning_rate=1e-5)
        optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, self.student)
        self.optimizer = optimizer_cls(self.student.parameters(), **optimizer_kwargs)
        self.input_ids = torch.cat([data["prompt_ids"], data["completion_ids"]], dim=1)
        self.prompt_length = data["prompt_ids"].size(1)

    def step(self):
        """One step; returns the seconds of its parts."""
        start = time.perf_counter()
        with torch.no_grad():
            teacher_logps = completion_logps(self.teacher, self.input_ids, self.prompt_length)
        teacher_done = time.perf_counter()
        logps = completion_logps(self.student, self.input_ids, self.prompt_length)
        advantages = teacher_logps - logps.detach()
        loss = -(advantages * torch.exp(logps - logps.detach())).mean()
        forward_done = time.perf_counter()
        loss.backward()
        backward_done = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        return {
            "teacher_forward": teacher_done - start,
            "student_forward": forward_done - teacher_done,
            "backward": backward_done - forward_done,
            "optimizer": end - backward_done,
            "total": end - start,
        }


# ----------------------------------------------------------------------------------------------------------------------
# Workers (each in a fresh process)
# ----------------------------------------------------------------------------------------------------------------------


def time_worker(job):
    shape = job["shape"]
    data = common.rollout(shape, job["cache_dir"])
    floor_parts, trainer_seconds = [], {kind: [] for kind in job["trainers"]}
    for _ in range(job["rounds"]):
        floor = Floor(shape, data)
        floor_parts += [floor.step() for _ in range(job["steps"])][WARMUP_STEPS:]
        del floor
        common.settle()
        for kind in job["trainers"]:
            trainer = common.build_trainer(kind, shape, data, job["steps"], common.scratch_dir(kind))
            trainer_seconds[kind] += common.train_and_time(trainer)[WARMUP_STEPS:]
            del trainer
            common.settle()
    return {"floor": floor_parts, "trainers": trainer_seconds}


def memory_worker(job):
    shape = job["shape"]
    data = common.rollout(shape, job["cache_dir"])
    if job["kind"] != "floor":
        return common.measure_trainer_memory(
            job["kind"], shape, data, MEMORY_STEPS, common.scratch_dir(job["kind"]), full_step=False
        )
    import trl.experimental.gkd  # noqa: F401  (the libraries a trainer process holds, so that peak RSS compares)

    import tvopd_trl  # noqa: F401

    floor = Floor(shape, data)
    common.settle()
    state_mb = 3 * sum(p.numel() * p.element_size() for p in floor.student.parameters()) / 2**20
    result = {"setup_rss_mb": common.rss_mb(), "state_mb": state_mb, "peak_reset_supported": common.reset_peak_rss()}
    for _ in range(MEMORY_STEPS):
        floor.step()
    result["loss_peak_rss_mb"] = common.peak_rss_mb()
    result["loss_activation_mb"] = result["loss_peak_rss_mb"] - result["setup_rss_mb"] - state_mb
    result["lifetime_peak_rss_mb"] = common.lifetime_peak_rss_mb()
    return result


# ----------------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------------


def floor_median(timing, part):
    values = [parts[part] for parts in timing.get("floor", [])]
    return statistics.median(values) if values else None


def trainer_median(timing, kind):
    stats = common.summarize(timing.get("trainers", {}).get(kind, []))
    return stats["median"] if stats else None


def table(results, trainers):
    header = [
        "V",
        "H",
        "T",
        "floor s/step",
        "(teacher fwd / student fwd / bwd / optim)",
        "floor peak RSS (MB)",
        "floor activation (MB)",
    ]
    for kind in trainers:
        header += [f"{kind} s/step", f"{kind} / floor", f"{kind} peak RSS (MB)", f"{kind} activation (MB)"]
    rows = []
    for point in results:
        shape, timing, memory = common.Shape(**point["shape"]), point["timing"], point["memory"]
        if "error" in timing:
            rows.append([shape.vocab, shape.hidden, shape.completion, f"failed: {timing['error'][:60]}"])
            continue
        floor = floor_median(timing, "total")
        parts = " / ".join(
            common.fmt(floor_median(timing, p))
            for p in ("teacher_forward", "student_forward", "backward", "optimizer")
        )
        mem = memory.get("floor", {})
        row = [shape.vocab, shape.hidden, shape.completion, common.fmt(floor), parts]
        row += [common.fmt(mem.get("loss_peak_rss_mb")), common.fmt(mem.get("loss_activation_mb"))]
        for kind in trainers:
            seconds, kind_mem = trainer_median(timing, kind), memory.get(kind, {})
            row += [common.fmt(seconds), common.fmt(seconds / floor) if seconds and floor else "-"]
            row += [common.fmt(kind_mem.get("loss_peak_rss_mb")), common.fmt(kind_mem.get("loss_activation_mb"))]
        rows.append(row)
    return common.markdown_table(header, rows)


def plot(results, trainers, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"V{p['shape']['vocab']}\nH{p['shape']['hidden']} T{p['shape']['completion']}" for p in results]
    x = list(range(len(results)))
    fig, (ax_time, ax_ratio) = plt.subplots(2, 1, figsize=(max(7, 1.4 * len(results)), 7), constrained_layout=True)
    floors = [floor_median(p["timing"], "total") for p in results]
    ax_time.plot(x, floors, "ks-", label="floor")
    for kind in trainers:
        seconds = [trainer_median(p["timing"], kind) for p in results]
        ax_time.plot(x, seconds, "o-", label=f"{kind} (loss phase)")
        ratios = [s / f if s and f else float("nan") for s, f in zip(seconds, floors, strict=True)]
        ax_ratio.plot(x, ratios, "o-", label=kind)
    ax_time.set_yscale("log")
    ax_time.set_ylabel("median s/step")
    ax_time.legend()
    ax_ratio.axhline(1.15, color="grey", linestyle="--", label="target 1.15")
    ax_ratio.set_ylabel("loss-phase time / floor")
    ax_ratio.legend()
    for ax in (ax_time, ax_ratio):
        ax.set_xticks(x, names, fontsize=8)
        ax.grid(alpha=0.3, which="both")
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser, default_out=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--trainers", default="tv", help="comma-separated trainers compared with the floor")
    common.add_grid_arguments(parser, "floor / trainer rounds per grid point")
    cli = parser.parse_args()
    config = common.grid_config(cli, QUICK, FULL)
    trainers = cli.trainers.split(",")
    out, cache_dir, started, info = common.start(cli)
    shapes = common.grid(config["vocabs"], config["hiddens"], config["completions"], config["prompt"], config["batch"])
    results = []
    for shape in shapes:
        print(f"[bench_floor] {shape.name}: timing floor and {trainers}", file=sys.stderr, flush=True)
        timing = common.run_worker(
            __file__,
            common.job(
                "time", shape, trainers=trainers, rounds=config["rounds"], steps=config["steps"], cache_dir=cache_dir
            ),
        )
        memory = (
            {}
            if cli.no_memory
            else common.measure_memories(__file__, shape, ["floor", *trainers], cache_dir, "bench_floor")
        )
        results.append({"shape": asdict(shape), "timing": timing, "memory": memory})

    label = " (--quick validation configuration)" if cli.quick else ""
    report = "\n\n".join(
        [
            "## Machine\n\n" + common.machine_markdown(info),
            f"## Loss phase against the floor{label}\n\n"
            f"B={config['batch']} prompts of P={config['prompt']} tokens, {config['rounds']} rounds x "
            f"{config['steps'] - WARMUP_STEPS} timed steps each; medians. Target: loss phase <= 1.15 x floor.\n\n"
            + table(results, trainers),
        ]
    )
    print(report)
    common.write_outputs(out, "bench_floor", {"machine": info, "config": config, "results": results}, report)
    plot(results, trainers, os.path.join(out, "bench_floor.png"))
    print(f"\nwrote {out}/bench_floor.{{json,md,png}} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    if common.is_worker():
        common.serve_worker({"time": time_worker, "memory": memory_worker})
    else:
        main()
