"""`benchmarks/probe_lm_head_precision.py --quick`: the probe behind `lm_head_precision`'s default runs, and with bf16
weights the `"model"` head gives the float32 head's log-probabilities exactly (bf16 values are exact in float32)."""

import json
import os
import subprocess
import sys

from .timeouts import time_limit


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "probe_lm_head_precision.py")


def test_quick_probe_compares_the_heads_on_every_backbone(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, SCRIPT, "--quick", "--out", str(tmp_path)]
    process = subprocess.run(command, capture_output=True, text=True, timeout=time_limit(180), env=env, cwd=ROOT)
    assert process.returncode == 0, process.stdout[-4000:] + process.stderr[-4000:]
    with open(tmp_path / "quick" / "probe_lm_head_precision.json") as f:
        rows = json.load(f)["rows"]
    assert [(row["rollouts"].split(",")[0], row["backbone"]) for row in rows] == [
        ("embedded tiny", "autocast"),
        ("embedded tiny", "bf16"),
        ("1.5B-shaped", "autocast"),
        ("1.5B-shaped", "bf16"),
    ]
    for row in rows:
        assert row["tokens"] > 0
        if row["backbone"] == "bf16":
            assert row["max_abs_logp_diff_model_vs_float32_head"] == 0.0
            assert row["flips_model_vs_float32_head"] == 0.0
        else:  # autocast: the operands' bf16 rounding moves the log-probabilities, by little
            assert 0.0 < row["max_abs_logp_diff_model_vs_float32_head"] < 0.1
