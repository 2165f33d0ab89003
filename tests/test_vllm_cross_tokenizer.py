"""A teacher of another family served by a real vLLM server: it scores the teacher's own token ids, and its span
log-ratios equal the same teacher's in the training process."""

import pytest
import torch
from transformers import AutoTokenizer

from tvopd_trl.testing import LocalVLLMServer, tiny_config, tiny_pair_trainer
from tvopd_trl.tiny import prompt_dataset

from .other_family import save_other_family_teacher
from .test_vllm import (
    LOGP_TOLERANCE,
    pytestmark,  # noqa: F401  (the `vllm` marker, and skipped without vLLM, as its tests)
)
from .timeouts import time_limit


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """The other family's teacher (a Llama with heads of 32, its own tokenizer) on disk and on a vLLM server."""
    path = save_other_family_teacher(tmp_path_factory.mktemp("other_family") / "teacher")
    server = LocalVLLMServer(path, tmp_path_factory.mktemp("vllm-logs"), max_model_len=128)
    try:
        yield path, server.wait_ready(time_limit(600))
    finally:
        server.stop()


def test_a_served_teacher_of_another_family_gives_the_local_span_log_ratios(teacher, tmp_path):
    path, server = teacher
    local = tiny_pair_trainer(tiny_config(tmp_path / "local", cross_tokenizer=True), teacher_model=path)
    served = tiny_pair_trainer(
        # Two replicas of one server: a pool, whose chunks go to both
        tiny_config(tmp_path / "served", cross_tokenizer=True, teacher_model_server_url=[server.url, server.url]),
        teacher_model=None,
        teacher_processing_class=AutoTokenizer.from_pretrained(path),
    )
    batch = local.generate_completions(prompt_dataset("opd", 16).to_list())
    in_process = local.score_completions(dict(batch), old_logps=True)
    through_server = served.score_completions(dict(batch), old_logps=True)
    assert torch.equal(in_process["span_ids"], through_server["span_ids"])
    scored = in_process["span_ids"] >= 0
    assert scored.sum() > 40
    local_delta = (in_process["teacher_logps"] - in_process["old_logps"])[scored]
    served_delta = (through_server["teacher_logps"] - through_server["old_logps"])[scored]
    assert (local_delta - served_delta).abs().max() < LOGP_TOLERANCE

    served.train()
    logs = [entry for entry in served.state.log_history if "loss" in entry]
    assert len(logs) == 3 and all(entry["cross_tokenizer/student_tokens_per_span"] >= 1 for entry in logs)
