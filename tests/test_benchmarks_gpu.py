"""`benchmarks/bench_gpu.py --quick` on CPU: the GPU benchmark's every in-process path (the trainers' grid, the
profile, generation, the padding-free comparison, the report and its files) runs and reports finite step times, so
that the script is ready when a GPU is lent; so does the prepared call of issue 49 (`--preset precision`), whose time
estimate must fit one device call. Its FLOP floor is checked against the model's own parameter count and by hand."""

import json
import math
import os
import re
import subprocess
import sys

import pytest

from .timeouts import time_limit


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_gpu.py")
TRAINERS = ("tv", "raw", "distill", "tv-nonorm")


# The prepared call of docs/performance.md's "The next command (issues 49 and 60)": its deadline, and the device
# call's limit
PRESET_CALL = ("--preset", "precision", "--deadline-s", "330")
DEVICE_CALL_S = 420


def _run(tmp_path, *args, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, SCRIPT, "--quick", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache")]
    process = subprocess.run(
        command + list(args), capture_output=True, text=True, timeout=time_limit(timeout), env=env
    )
    assert process.returncode == 0, process.stderr[-4000:]
    with open(tmp_path / "quick" / "bench_gpu.json") as f:
        return process.stdout, json.load(f)


@pytest.mark.long  # 30 to 40 s on the 2-core CPU
def test_quick_run_times_every_trainer_and_writes_its_report(tmp_path):
    stdout, results = _run(tmp_path, "--generation", "--profile", "--packing")
    assert "## Estimated time" in stdout and "## Targets" in stdout
    table = stdout.split("## Loss phase", 1)[1].split("## Targets", 1)[0]
    for name in TRAINERS:
        assert f"| {name} |" in table, name
    assert len(results["results"]) == 2  # the two completion lengths of --quick
    for point in results["results"]:
        assert set(point["runs"]) == set(TRAINERS)
        for name, run in point["runs"].items():
            assert "error" not in run, (name, run)
            timed = run["seconds"][1:]
            assert len(timed) == 2 and all(math.isfinite(s) and s > 0 for s in timed), (name, run)
    extras = results["extras"]
    assert extras["profile"]["step_seconds"] > 0 and extras["profile"]["kernel_seconds_total"] > 0
    assert [g["batch"] for g in extras["generation"]] == [1, 2] and all(g["seconds"] > 0 for g in extras["generation"])
    packing = extras["packing"]
    assert set(packing["runs"]) == {"padded", "packed", "budget"} and len(packing["lengths"]) == 8
    for layout, run in packing["runs"].items():
        assert "error" not in run and all(s > 0 for s in run["seconds"]), (layout, run)
    assert "### Padding-free loss phase" in stdout
    assert (tmp_path / "quick" / "bench_gpu.md").read_text().startswith("## Machine")
    assert (tmp_path / "quick" / "bench_gpu_profile.txt").exists()
    # On CPU there is no peak to divide by: MFU and the memory target are reported as not measured, not invented.
    assert re.search(r"MFU of the tv \(lm_head_precision=\w+\) loss phase = n/a", stdout)
    assert re.search(r"peak GPU memory tv \(lm_head_precision=\w+\) / distill = - ", stdout)


def test_floor_flops_of_the_paper_pair():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_gpu
    finally:
        sys.path.pop(0)
    arch = bench_gpu.PAPER_PAIR
    # DeepSeek-R1-Distill-Qwen-1.5B: 1.78B parameters = blocks' matmuls + embedding + untied head + norms and biases.
    n = bench_gpu.block_matmul_params(arch)
    assert n == 28 * (2 * 1536**2 + 2 * 1536 * 256 + 3 * 1536 * 8960) == 1_310_195_712
    assert 1.77e9 < n + 2 * 151936 * 1536 < 1.78e9
    flops = bench_gpu.floor_flops(arch, batch=1, prompt=256, completion=8192)
    seq = 256 + 8192
    forward = 2 * n * seq + 2 * 28 * 1536 * seq * (seq + 1) + 2 * 1536 * 151936 * 8192
    assert flops["teacher"] == forward and flops["student"] == 3 * forward and flops["total"] == 4 * forward
    assert 120e12 < flops["total"] < 130e12  # about 126 TFLOP per 8,192-token step
    assert bench_gpu.bf16_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert bench_gpu.bf16_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bench_gpu.bf16_peak_tflops("NVIDIA H200") == 989.4
    assert bench_gpu.bf16_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert bench_gpu.bf16_peak_tflops("Some GPU") is None and bench_gpu.bf16_peak_tflops("Some GPU", 100.0) == 100.0


@pytest.mark.long
def test_quick_zero3_path_runs_on_the_cpu_stand_in(tmp_path):
    """The --zero3 path (accelerate launch with the recipe's zero3.yaml, one process), on DeepSpeed's CPU accelerator:
    the launch, the worker and the report line, not GPU behaviour."""
    pytest.importorskip("deepspeed")
    stdout, results = _run(tmp_path, "--zero3", "--trainers", "tv", "--completion", "32", timeout=600)
    zero3 = results["extras"]["zero3"]
    assert "error" not in zero3, zero3
    assert zero3["distributed_type"] == "DistributedType.DEEPSPEED" and zero3["zero_stage"] == 3
    assert zero3["num_processes"] == 1 and all(math.isfinite(s) for s in zero3["seconds"])
    assert "### Single-GPU ZeRO-3" in stdout


@pytest.mark.long  # about 40 s of CPU on the 2-core machine
def test_quick_precision_preset_runs_both_heads_and_reports_issue_49s_targets(tmp_path):
    """The prepared call itself on tiny shapes: both student dtypes, each with the bf16 and the float32 LM head side by
    side, TF32 and the recipes' fused AdamW set, both T, the targets' verdict lines, the profiles (padded and
    padding-free) and packing."""
    stdout, results = _run(tmp_path, *PRESET_CALL)
    cli = results["cli"]
    assert cli["tf32"] and cli["optim"] == "adamw_torch_fused" and cli["profile"] and cli["packing"]
    assert "no optional part skipped by the estimate" in stdout and not results["extras"]["skipped"]
    heads = {"tv-bf16head": "model", "tv-fp32head": "float32", "distill": None}
    points = [(p["shape"]["completion"], p["student_dtype"]) for p in results["results"]]
    assert points == [(64, "float32"), (64, "bfloat16"), (128, "float32"), (128, "bfloat16")]  # T-major
    for point in results["results"]:
        assert list(point["runs"]) == list(heads)
        for name, run in point["runs"].items():
            assert "error" not in run, (name, run)
            assert run["lm_head_precision"] == heads[name] and run["optim"] == "adamw_torch_fused", (name, run)
            assert all(s > 0 for s in run["seconds"][1:]), (name, run)
    targets = stdout.split("## Targets", 1)[1].split("## Also measured", 1)[0]
    for completion in (64, 128):
        for dtype, issue, speedup, mfu in (("float32", 39, 2, 40), ("bfloat16", 49, 1.2, 35)):
            where = f"T = {completion}, {dtype} student (issue {issue}): "
            for head in ("tv-bf16head (lm_head_precision=model)", "tv-fp32head (lm_head_precision=float32)"):
                pattern = rf"{re.escape(where + head)} loss-phase throughput / distill = [\d.]+x "
                pattern += rf"\(target >= {speedup}x\): (met|missed)"
                assert re.search(pattern, targets), (completion, dtype, head, targets)
                # No GPU: memory and MFU are reported as not measured, not invented
                assert f"{where}peak GPU memory {head} / distill = - (target <= 0.8): not measured" in targets
                assert f"{where}MFU of the {head} loss phase = n/a of - TFLOP/s (target >= {mfu}%)" in targets
    table = stdout.split("## Loss phase", 1)[1].split("## Targets", 1)[0]
    assert "| bfloat16 | 64 | tv-bf16head |" in table and "`optim=adamw_torch_fused`, TF32 on" in table
    extras = results["extras"]
    assert "tv-bf16head" in extras["profile"]["where"] and "T = 64" in extras["profile"]["where"]
    assert extras["packing"]["trainer"] == "tv-bf16head" and extras["packing"]["student_dtype"] == "bfloat16"
    assert all("error" not in run for run in extras["packing"]["runs"].values())
    # Issue 60: the padding-free step is profiled too, beside the padded one, each to its own file
    packed = extras["packing"]["profile"]
    assert "padding-free" in packed["where"] and "tv-bf16head" in packed["where"], packed
    assert packed["step_seconds"] > 0 and packed["kernel_seconds"]["attention"] > 0, packed
    assert f"### Profile of one tv step ({packed['where']})" in stdout
    for name in ("bench_gpu_profile.txt", "bench_gpu_profile_packed.txt"):
        assert (tmp_path / "quick" / name).read_text().count("Self CPU") >= 1, name


def test_the_prepared_precision_call_fits_one_device_call_and_the_docs_quote_its_estimate():
    """`--estimate-only` of the prepared call on the paper pair: every part within the deadline, the whole with a
    minute of room in the 420 s device call for the wheels' installation; docs/performance.md quotes this estimate."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, SCRIPT, "--estimate-only", *PRESET_CALL]
    process = subprocess.run(command, capture_output=True, text=True, timeout=time_limit(120), env=env)
    assert process.returncode == 0, process.stderr[-4000:]
    estimate = process.stdout.split("## Estimated time", 1)[1].strip().splitlines()[0]
    parts = {name: float(seconds) for name, seconds in re.findall(r"(\w+) (\d+) s", estimate.split(" (on ")[0])}
    assert set(parts) == {"startup", "grid", "profile", "packing", "total"}, estimate
    assert "no optional part skipped by the estimate" in process.stdout
    assert parts["total"] <= 330 <= DEVICE_CALL_S - 60, parts
    with open(os.path.join(ROOT, "docs", "performance.md")) as f:
        section = f.read().split("### The next command (issues 49 and 60)", 1)[1].split("\n### ", 1)[0]
    section = " ".join(section.replace("\\\n", " ").split())  # the prose's and the command's line breaks
    assert "python3 benchmarks/bench_gpu.py " + " ".join(PRESET_CALL) in section
    assert f"{parts['total']:.0f} s in all" in section, estimate
