"""Seconds to score one rollout on a pool of K teacher servers, K = 1, 2, 4: the target is close to 1/K.

    OMP_NUM_THREADS=1 python benchmarks/bench_teacher_pool.py [--rows 64] [--chunk-rows 8] [--latency 0.2]

Each replica is the local stand-in of vLLM's completions API from tests/test_served_teacher.py (a real tiny teacher
scores every sequence), answering one request at a time and adding `--latency` seconds to each: the time a server
spends on its own accelerator, which K replicas spend in parallel. The stand-ins' own scoring, on the other hand, runs
in this process on its CPUs for every K alike, and does not get faster with more replicas; `--latency 0` measures it.
The rollout has `--rows` rows of an 8-token prompt and a 16-token completion, cut into chunks of `--chunk-rows`.
Every K scores the same rollout `--rounds` times (after one warm-up); the median is reported, and every pool's values
are checked equal to the first's. No real vLLM server runs.
"""

import argparse
import os
import statistics
import sys
import threading
import time


os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout, for `tests`

import common  # noqa: E402
import torch  # noqa: E402
import trl.generation.vllm_client  # noqa: E402

import tvopd_trl.checks  # noqa: E402
from tests.test_teacher_pool import StandInServer, rollout  # noqa: E402
from tvopd_trl.served_teacher import connect_teacher_pool  # noqa: E402
from tvopd_trl.testing import build_model, build_tokenizer  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--chunk-rows", type=int, default=8)
    parser.add_argument("--latency", type=float, default=0.2, help="seconds each replica adds to every request")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    cli = parser.parse_args()
    torch.set_num_threads(1)
    # vLLM itself is not installed here; TRL's client only needs `requests` for these calls.
    trl.generation.vllm_client.is_vllm_available = tvopd_trl.checks.is_vllm_available = lambda *args, **kwargs: True
    tokenizer = build_tokenizer()
    teacher = build_model(tokenizer, seed=1, hidden_size=48).eval()
    batch = rollout(tokenizer, rows=cli.rows, prompt=8, completion=16)
    servers = [StandInServer(teacher, delay=cli.latency, serial=threading.Lock()) for _ in range(max(cli.replicas))]

    results, reference = [], None
    for count in cli.replicas:
        pool = connect_teacher_pool(
            [server.url for server in servers[:count]], 0, "the benchmark's teacher", chunk_rows=cli.chunk_rows
        )
        pool.score(batch, 1.0)  # warm-up: connections, threads
        seconds = []
        for _ in range(cli.rounds):
            start = time.perf_counter()
            logps = pool.score(batch, 1.0)
            seconds.append(time.perf_counter() - start)
        reference = logps if reference is None else reference
        if not torch.equal(logps, reference):
            raise AssertionError(f"{count} replicas scored the rollout differently from {cli.replicas[0]}")
        results.append((count, statistics.median(seconds)))
    for server in servers:
        server.stop()

    chunks = -(-cli.rows // cli.chunk_rows)
    baseline = results[0][1]
    rows = [
        (count, common.fmt(seconds, 4), common.fmt(baseline / seconds), common.fmt(count / results[0][0]))
        for count, seconds in results
    ]
    print(
        f"# bench_teacher_pool.py\n\n`OMP_NUM_THREADS=1 python benchmarks/bench_teacher_pool.py --rows {cli.rows} "
        f"--chunk-rows {cli.chunk_rows} --latency {cli.latency} --rounds {cli.rounds}`: {cli.rows} rows in "
        f"{chunks} chunks, each replica adding {cli.latency * 1000:g} ms to every request and answering one at a "
        "time; median of the rounds.\n"
    )
    print(common.machine_markdown(common.machine_info()))
    print(common.markdown_table(["replicas", "s/rollout", "speedup", "ideal speedup"], rows))
    print("values: every pool's equal to the first's (torch.equal)")


if __name__ == "__main__":
    main()
