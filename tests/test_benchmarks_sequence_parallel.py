"""`benchmarks/bench_sequence_parallel.py --quick` on CPU: two gloo processes under DeepSpeed Ulysses score one row
with the log-probabilities and the gradients of one process on the whole row, at both lengths of --quick, and the
report and its JSON come out whole, so that the benchmark is ready for a machine with two GPUs."""

import json
import os
import subprocess
import sys

import pytest

from .timeouts import time_limit


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_sequence_parallel.py")

pytest.importorskip("deepspeed")


@pytest.mark.long  # about 60 s on the 2-core CPU: 6 fresh processes, 4 of them importing DeepSpeed
def test_quick_run_matches_one_process_under_ulysses(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, SCRIPT, "--quick", "--json", str(tmp_path / "sp.json")]
    process = subprocess.run(command, capture_output=True, text=True, timeout=time_limit(240), env=env)
    assert process.returncode == 0, process.stdout[-4000:] + process.stderr[-4000:]
    check = next(line for line in process.stdout.splitlines() if line.startswith("Equality check"))
    assert check.endswith(": PASS"), check
    assert "Target (a)" in process.stdout and "Target (b)" in process.stdout
    with open(tmp_path / "sp.json") as f:
        results = json.load(f)
    assert results["verdicts"]["checks"] is True
    assert sorted(results["grid"]) == ["256", "512"]
    for length, point in results["grid"].items():
        assert point["check"]["logp_max_abs_diff"] <= 1e-5, (length, point["check"])
        assert point["check"]["grad_max_rel_diff"] <= 1e-4, (length, point["check"])
        # Both SP=2 processes reported, each on its own shard
        assert sorted(rank["rank"] for rank in point["2"]["ranks"]) == [0, 1], length
        assert point["1"]["seconds"] > 0 and point["2"]["seconds"] > 0, length
