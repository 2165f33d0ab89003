"""`benchmarks/bench_memory_bf16.py --quick` on CPU: every trainer's loss-phase step runs under torch.profiler on a bf16
student, the peak allocated bytes come out positive and the same in both runs of the smallest T, and the report's
table, target line and per-peak breakdowns come out whole."""

import json
import os
import re
import subprocess
import sys

import pytest

from .timeouts import time_limit


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_memory_bf16.py")
TRAINERS = ("tv", "tv-fp32", "tv-nonorm", "distill", "distill-cold", "tv-cold")
HEADER = (
    "| T | trainer | peak above step start (MiB) | / distill | peak phase | fwd+bwd peak (MiB) | optimizer.step() peak "
    "(MiB) | s/step | worker peak RSS (MiB) | runs | repeat identical |"
)


@pytest.mark.long  # about a minute on the 2-core CPU: 3 fresh processes, 18 profiled steps
def test_quick_run_reports_positive_repeatable_peaks(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, SCRIPT, "--quick", "--out", str(tmp_path)]
    process = subprocess.run(command, capture_output=True, text=True, timeout=time_limit(300), env=env)
    assert process.returncode == 0, process.stdout[-4000:] + process.stderr[-4000:]
    stdout = process.stdout
    assert "## Estimated time" in stdout and "## Target" in stdout and "## What is alive at each peak" in stdout
    table = stdout.split("## Loss-phase peak allocated memory", 1)[1].split("## Target", 1)[0]
    assert HEADER in table
    rows = [[cell.strip() for cell in line.strip("| ").split(" | ")] for line in table.splitlines()]
    rows = [row for row in rows if row[0] in ("32", "64")]
    assert [(row[0], row[1]) for row in rows] == [(str(t), name) for t in (32, 64) for name in TRAINERS]
    for row in rows:
        assert row[4] in ("forward_backward", "optimizer_step", "after"), row
        # A cold run whose peak holds AdamW's new moments is shown in brackets, without a ratio
        peak = re.fullmatch(r"\(?([0-9.,]+)(: AdamW's moments\))?", row[2])
        assert peak and float(peak.group(1).replace(",", "")) > 0, row
        assert (peak.group(2) is None) == (row[4] == "forward_backward" or not row[1].endswith("-cold")), row
    assert all(row[-1] == "yes" for row in rows if row[0] == "32"), rows  # both runs gave the same bytes
    assert all(row[3] == "1" for row in rows if row[1] == "distill"), rows
    assert "distill-cold" in table and "optimizer.step()" in table

    with open(tmp_path / "quick" / "bench_memory_bf16.json") as f:
        results = json.load(f)["results"]
    assert len(results) == 3 * len(TRAINERS)  # T = 32 twice, T = 64 once
    for run in results:
        assert "error" not in run, run
        assert run["student_dtypes"] == ["torch.bfloat16"], run
        # A short warm-up step, then the whole T; the cold run profiles its first step
        warm_up = [] if run["trainer"].endswith("-cold") else [[8]]
        assert run["completion_lengths"] == warm_up + [[run["completion"]]], run
        assert run["peak_bytes"] > 0 and run["events"] > 0 and run["state_bytes"] > 0, run
        assert run["peak_bytes"] == max(run["phase_peak_bytes"].values()), run
        assert run["live_at_peak"] and all(h["bytes"] > 0 for h in run["live_at_peak"]), run
        # The running sum counts only blocks allocated during the step, so at its peak it is exactly what is alive
        assert sum(h["bytes"] for h in run["live_at_peak"]) + run["live_at_peak_other_bytes"] == run["peak_bytes"]
        assert run["profiled_step_seconds"] > 0 and len(run["step_seconds"]) == len(warm_up) + 1, run
    twice = {}
    for run in results:
        if run["completion"] == 32:
            twice.setdefault(run["trainer"], []).append(run["peak_bytes"])
    assert all(len(set(peaks)) == 1 and len(peaks) == 2 for peaks in twice.values()), twice  # deterministic
    by_name = {run["trainer"]: run for run in results if run["completion"] == 64}
    # Only update/norm separates tv from tv-nonorm, in optimizer.step(): the bucketed step copies one slice at a time,
    # and the for-loop AdamW's own temporaries shrink to a slice too, so the step peaks lower than the plain one
    tv_step = by_name["tv"]["phase_peak_bytes"]["optimizer_step"]
    assert 0 < tv_step < by_name["tv-nonorm"]["phase_peak_bytes"]["optimizer_step"]
    # Without the warm-up step, the forward and backward allocate the same: a cold run stands in for their peak
    for completion in (32, 64):
        for name in ("tv", "distill"):
            line = f"- T = {completion}: forward and backward's peak of {name}-cold against {name}: the same bytes"
            assert line in stdout, stdout.split("## Target", 1)[1][:2000]
    assert "- T = 64, tv / distill = " in stdout
    assert by_name["tv"]["effective_config"]["log_update_norm"] is True
    assert by_name["tv-nonorm"]["effective_config"]["log_update_norm"] is False
    assert by_name["tv-fp32"]["effective_config"]["lm_head_precision"] == "float32"
    assert (tmp_path / "quick" / "bench_memory_bf16.md").read_text().startswith("## Machine")
