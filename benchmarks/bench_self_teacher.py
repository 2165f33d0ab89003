"""The live self-teacher's scores (issue 50): a local no-grad forward of the student against prompt log-probabilities
from the vLLM rollout server that holds the same weights, side by side in one run.

    . .venv-vllm/bin/activate
    OMP_NUM_THREADS=1 python benchmarks/bench_self_teacher.py [--rows 128] [--rounds 5]

The vLLM-ready tiny student (`tvopd_trl.tiny.vllm_paths`, float32) scores a rollout of `--rows` completions of the
addition task after a hinted teacher prompt (a system turn with the answer), twice:
- **local**: `TVOPDTrainer._sampled_token_logps` of the trainer's student, as `self_distillation="live"` scores;
- **server**: the same rows as one scoring request to a real vLLM server of that checkpoint (vLLM's CPU build),
  through the served teacher's client (`TeacherServerPool.score`), as a rollout server right after its weight sync
  would answer it.
Each is timed over `--rounds` rounds after a warm-up (the median is reported), and the two are compared token by
token: their difference is the noise the server route would add to every delta, against the size of the deltas the
hint itself makes (mean |delta| between the hinted and the unhinted local scores). Writes
benchmarks/results/bench_self_teacher.{json,md}.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from tvopd_trl import TVOPDTrainer  # noqa: E402
from tvopd_trl.served_teacher import connect_teacher_pool  # noqa: E402
from tvopd_trl.testing import LocalVLLMServer, tiny_config  # noqa: E402
from tvopd_trl.tiny import prompt_dataset, vllm_paths  # noqa: E402


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def hinted_rows(rows):
    dataset = prompt_dataset("opd", rows, skill="addition")
    hints = [[{"role": "system", "content": f"The answer is {row['answer']}."}, *row["prompt"]] for row in dataset]
    return dataset.add_column("teacher_prompt", hints)


def timed(function, rounds):
    function()  # warm-up
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        value = function()
        seconds.append(time.perf_counter() - start)
    return value, statistics.median(seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    cli = parser.parse_args()
    torch.set_num_threads(1)
    student = vllm_paths()["student"]
    tokenizer = AutoTokenizer.from_pretrained(student, padding_side="left")
    dataset = hinted_rows(cli.rows)
    with tempfile.TemporaryDirectory() as scratch:
        args = tiny_config(scratch, self_distillation="live", per_device_train_batch_size=cli.rows, max_steps=1)
        trainer = TVOPDTrainer(model=student, args=args, train_dataset=dataset, processing_class=tokenizer)
        torch.manual_seed(0)
        batch = trainer.generate_completions(dataset.to_list())
        teacher = trainer.teachers["teacher"]
        hinted = {
            "prompt_ids": batch["teacher_prompt_ids"],
            "prompt_mask": batch["teacher_prompt_mask"],
            "completion_ids": batch["completion_ids"],
            "completion_mask": batch["completion_mask"],
        }
        ids = torch.cat([hinted["prompt_ids"], hinted["completion_ids"]], dim=1)
        mask = torch.cat([hinted["prompt_mask"], hinted["completion_mask"]], dim=1)
        width = hinted["completion_ids"].size(1)

        def local():
            with torch.no_grad(), teacher.scoring():
                return trainer._sampled_token_logps(teacher.model, ids, mask, width)

        local_logps, local_seconds = timed(local, cli.rounds)
        unhinted = trainer.score_completions({k: v for k, v in batch.items() if not k.startswith("teacher_prompt")})
        server = LocalVLLMServer(student, scratch).wait_ready()
        try:
            pool = connect_teacher_pool(server.url, 60, "the rollout server")
            server_logps, server_seconds = timed(lambda: pool.score(hinted, 1.0), cli.rounds)
        finally:
            server.stop()
    active = batch["completion_mask"].bool()
    gap = (server_logps - local_logps)[active].abs()
    moved = (local_logps - unhinted["teacher_logps"])[active].abs()
    row = {
        "rows": cli.rows,
        "completion_tokens": int(active.sum()),
        "local_seconds": local_seconds,
        "server_seconds": server_seconds,
        "server_over_local": server_seconds / local_seconds,
        "server_minus_local_abs_mean": gap.mean().item(),
        "server_minus_local_abs_max": gap.max().item(),
        "hint_delta_abs_mean": moved.mean().item(),
        "hint_delta_abs_median": moved.median().item(),
        "tokens_hint_moves_less_than_the_server_gap": (moved < gap.max()).float().mean().item(),
    }
    info = common.machine_info()
    header = [
        "rows",
        "tokens",
        "local s",
        "server s",
        "server / local",
        "mean |server - local|",
        "max |server - local|",
        "mean |delta| of the hint",
        "median |delta| of the hint",
    ]
    table = common.markdown_table(
        header,
        [
            [
                row["rows"],
                row["completion_tokens"],
                common.fmt(local_seconds),
                common.fmt(server_seconds),
                common.fmt(row["server_over_local"]),
                f"{row['server_minus_local_abs_mean']:.2e}",
                f"{row['server_minus_local_abs_max']:.2e}",
                common.fmt(row["hint_delta_abs_mean"]),
                common.fmt(row["hint_delta_abs_median"]),
            ]
        ],
    )
    report = f"{common.machine_markdown(info)}\n\n## The live self-teacher's scores: local forward against the rollout server\n\n{table}\n"
    print(report)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "bench_self_teacher.json"), "w") as f:
        json.dump({"machine": info, "results": [row]}, f, indent=2)
    with open(os.path.join(RESULTS, "bench_self_teacher.md"), "w") as f:
        f.write(report)


if __name__ == "__main__":
    main()
