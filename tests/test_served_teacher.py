"""A teacher served by vLLM (`teacher_model_server_url`), against a local HTTP stand-in of vLLM's completions API.

The stand-in answers `/health`, `/v1/models` and `/v1/completions` with `prompt_logprobs` the way vLLM documents them
(one entry per prompt position, `None` first; each maps token ids to `{"logprob", "rank"}` and always includes the
actual token). It scores with a real local teacher, so the trainer's teacher log-probabilities can be checked exactly.
TRL's own `VLLMClient` makes the requests; only its "is vLLM installed" gate is lifted. No real vLLM server ran.
"""

import json
import math
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import AutoModelForCausalLM

from tvopd_trl.served_teacher import MAX_CHUNK_ROWS
from tvopd_trl.testing import tiny_config

from .timeouts import time_limit


class _VLLMStandIn(BaseHTTPRequestHandler):
    teacher = None
    requests = []
    # With `fail_last_two`, each sequence's last position omits the actual token and the one before reports NaN: values
    # a server failed to give.
    fail_last_two = False

    def log_message(self, *args):
        pass

    def _reply(self, payload, status=200):
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self._reply({})
        elif self.path == "/v1/models":
            self._reply({"data": [{"id": "tiny-teacher"}]})
        else:
            self._reply({"error": self.path}, status=404)

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(request)
        choices = []
        for sequence in request["prompt"]:
            with torch.no_grad():
                logits = type(self).teacher(torch.tensor([sequence])).logits[0].float()
            logps = torch.log_softmax(logits / request["temperature"], dim=-1)
            entries = [None]
            for position in range(1, len(sequence)):
                row = logps[position - 1]
                ranks = torch.argsort(row, descending=True)
                top = {
                    int(t): {"logprob": row[t].item(), "rank": i + 1}
                    for i, t in enumerate(ranks[: request["prompt_logprobs"]])
                }
                actual = sequence[position]
                top.setdefault(actual, {"logprob": row[actual].item(), "rank": int((row > row[actual]).sum()) + 1})
                entries.append({str(token): value for token, value in top.items()})
            if type(self).fail_last_two:
                entries[-1] = {str(t): v for t, v in entries[-1].items() if int(t) != sequence[-1]} or None
                entries[-2][str(sequence[-2])]["logprob"] = math.nan
            choices.append({"text": "", "prompt_logprobs": entries})
        self._reply({"choices": choices})


class _EngineDied(_VLLMStandIn):
    """A vLLM server whose engine died: it accepts connections and answers every request with a 503."""

    def do_GET(self):
        self._reply({"error": "the engine died"}, status=503)


def black_hole():
    """A listening socket that accepts connections (the kernel's backlog does) and never answers, and its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def finishes_within(seconds, function, *args, **kwargs):
    """`function(*args, **kwargs)`, run on a daemon thread so that a hang (past `seconds` times
    `TVOPD_TEST_TIMEOUT_SCALE`) fails the test instead of holding it."""
    outcome = {}

    def run():
        try:
            outcome["result"] = function(*args, **kwargs)
        except Exception as error:
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(time_limit(seconds))
    if thread.is_alive():
        raise TimeoutError(f"still running after {time_limit(seconds):g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


@pytest.fixture
def teacher_server(model_dirs, monkeypatch):
    import trl.generation.vllm_client

    # vLLM itself is not installed here; TRL's client only needs `requests` for these calls.
    monkeypatch.setattr(trl.generation.vllm_client, "is_vllm_available", lambda *args, **kwargs: True)
    monkeypatch.setattr("tvopd_trl.checks.is_vllm_available", lambda *args, **kwargs: True)
    _VLLMStandIn.teacher = AutoModelForCausalLM.from_pretrained(model_dirs["teacher"]).eval()
    _VLLMStandIn.requests = []
    _VLLMStandIn.fail_last_two = False
    server = ThreadingHTTPServer(("127.0.0.1", 0), _VLLMStandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def served_trainer(make_trainer, url, tmp_path, tokenizer, **overrides):
    args = tiny_config(tmp_path, teacher_model_server_url=url, teacher_model_server_timeout=5, **overrides)
    return make_trainer(args, teacher_model=None, teacher_processing_class=tokenizer)


def test_served_teacher_log_probs_are_the_teachers(make_trainer, teacher_server, tmp_path, tokenizer):
    trainer = served_trainer(make_trainer, teacher_server, tmp_path, tokenizer, temperature=0.7)
    assert trainer.teacher_model is None
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))

    # The reference: the same teacher, in process, at the sampling temperature, on the unpadded sequences.
    teacher = _VLLMStandIn.teacher
    mask = batch["completion_mask"].bool()
    for row in range(batch["completion_ids"].size(0)):
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()]
        completion = batch["completion_ids"][row][mask[row]]
        sequence = torch.cat([prompt, completion])
        with torch.no_grad():
            logps = torch.log_softmax(teacher(sequence[None]).logits[0].float() / 0.7, dim=-1)
        expected = logps[len(prompt) - 1 : -1].gather(1, completion[:, None]).squeeze(1)
        torch.testing.assert_close(batch["teacher_logps"][row][mask[row]], expected, atol=1e-5, rtol=0)
        assert (batch["teacher_logps"][row][~mask[row]] == 0).all()
    (request,) = _VLLMStandIn.requests
    assert request["max_tokens"] == 1 and request["prompt_logprobs"] == 1 and request["temperature"] == 0.7
    assert request["model"] == "tiny-teacher" and len(request["prompt"]) == batch["completion_ids"].size(0)


def test_values_the_server_failed_to_give_are_dropped_and_counted(make_trainer, teacher_server, tmp_path, tokenizer):
    """TRL's client turns an omitted or NaN teacher log-probability into -inf; that is not the teacher ruling the
    token out (X = 1, A = -c_k) but a missing value: the token leaves the loss and the TV estimate, and is counted."""
    _VLLMStandIn.fail_last_two = True
    trainer = served_trainer(make_trainer, teacher_server, tmp_path, tokenizer, max_completion_length=6)
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    lengths = batch["completion_mask"].sum(1).tolist()
    assert min(lengths) >= 2, "the check below needs two completion tokens per row"
    missing = torch.zeros_like(batch["completion_mask"], dtype=torch.bool)
    for row, length in enumerate(lengths):
        missing[row, length - 2 : length] = True
    assert torch.isnan(batch["teacher_logps"][missing]).all()
    assert torch.isfinite(batch["teacher_logps"][~missing]).all()

    loss = trainer.compute_loss(trainer.model, batch)
    assert torch.isfinite(loss)
    kept = batch["completion_mask"].bool() & ~missing
    sums = trainer._step_statistics.sums
    assert sums["nonfinite"] == missing.sum() and sums["tokens"] == kept.sum()
    delta = (
        batch["teacher_logps"]
        - trainer._sampled_token_logps(
            trainer.model,
            torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
            batch["completion_ids"].size(1),
        ).detach()
    )
    ((u, n, _),) = trainer._rollout_tv.tolist()  # the one pooled scale's
    assert n == kept.sum() and u == pytest.approx((-torch.expm1(delta[kept].clamp(max=0))).sum().item(), rel=1e-5)


def test_training_with_a_served_teacher(make_trainer, teacher_server, tmp_path, tokenizer):
    trainer = served_trainer(make_trainer, teacher_server, tmp_path, tokenizer, max_steps=3)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "tv/scale" in entry]
    assert len(logs) == 3 and all(math.isfinite(entry["tv/estimate"]) and entry["tv/estimate"] > 0 for entry in logs)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert len(_VLLMStandIn.requests) == 3  # one prefill request per rollout batch


def test_the_request_settings_reach_the_teacher_pool(make_trainer, teacher_server, tmp_path, tokenizer):
    trainer = served_trainer(
        make_trainer,
        teacher_server,
        tmp_path,
        tokenizer,
        teacher_model_server_request_timeout=7.0,
        teacher_model_server_retries=1,
        teacher_model_server_chunk_rows=3,
        teacher_model_server_max_in_flight=1,
    )
    pool = trainer.teachers["teacher"].client
    assert (pool.request_timeout, pool.retries, pool.chunk_rows, pool.max_in_flight) == (7.0, 1, 3, 1)
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    sizes = [len(request["prompt"]) for request in _VLLMStandIn.requests]
    assert max(sizes) == 3 and sum(sizes) == batch["completion_ids"].size(0)


def test_evaluation_requests_are_logged_as_evaluation_metrics(make_trainer, teacher_server, tmp_path, tokenizer):
    from tvopd_trl.tiny import prompt_dataset

    trainer = served_trainer(
        make_trainer, teacher_server, tmp_path, tokenizer, max_steps=1, per_device_eval_batch_size=4
    )
    trainer.eval_dataset = prompt_dataset("test", 4)
    trainer.train()
    train_requests = sum(1 for entry in trainer.state.log_history if "teacher/request_seconds" in entry)
    metrics = trainer.evaluate()
    assert metrics["eval_teacher/request_seconds"] > 0 and metrics["eval_teacher/replicas_down"] == 0
    assert sum(1 for entry in trainer.state.log_history if "teacher/request_seconds" in entry) == train_requests
    assert len(_VLLMStandIn.requests) == 2  # one rollout, one evaluation batch


def test_an_unreachable_server_fails_before_any_model_loads(monkeypatch, tmp_path):
    import trl.generation.vllm_client

    from tvopd_trl import TVOPDTrainer

    monkeypatch.setattr(trl.generation.vllm_client, "is_vllm_available", lambda *args, **kwargs: True)
    monkeypatch.setattr("tvopd_trl.checks.is_vllm_available", lambda *args, **kwargs: True)
    args = tiny_config(tmp_path, teacher_model_server_url="http://127.0.0.1:9", teacher_model_server_timeout=0)
    # A student path that does not exist: loading it would raise an OSError, not the connection error.
    with pytest.raises(
        ConnectionError, match=r"The teacher server .* at http://127.0.0.1:9 did not answer within 0 s"
    ):
        TVOPDTrainer(model="does/not/exist", args=args)
    # The same for the rollout server of `vllm_mode="server"`.
    args = tiny_config(
        tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url="http://127.0.0.1:9", vllm_server_timeout=0
    )
    with pytest.raises(ConnectionError, match=r"The rollout server \(vllm_server_base_url\) at http://127.0.0.1:9"):
        TVOPDTrainer(model="does/not/exist", teacher_model="also/missing", args=args)

    # A server that accepts the connection and never answers, or whose engine died (503), fails by the deadline too:
    # TRL's health check has no request timeout, and asks again forever on an error status
    dead = ThreadingHTTPServer(("127.0.0.1", 0), _EngineDied)
    threading.Thread(target=dead.serve_forever, daemon=True).start()
    hole, silent = black_hole()
    for url in (silent, f"http://127.0.0.1:{dead.server_address[1]}"):
        args = tiny_config(tmp_path, teacher_model_server_url=url, teacher_model_server_timeout=1)
        with pytest.raises(ConnectionError, match=rf"The teacher server .* at {url} did not answer within 1 s"):
            finishes_within(15, TVOPDTrainer, model="does/not/exist", args=args)
        args = tiny_config(
            tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=1
        )
        with pytest.raises(ConnectionError, match=rf"The rollout server \(vllm_server_base_url\) at {url} did not"):
            finishes_within(15, TVOPDTrainer, model="does/not/exist", teacher_model="also/missing", args=args)
    dead.shutdown()
    hole.close()


def test_served_teacher_bad_configurations(tmp_path, model_dirs):
    from tvopd_trl import TVOPDTrainer

    with pytest.raises(ValueError, match="full next-token distribution"):
        tiny_config(tmp_path, teacher_model_server_url="http://x", advantage_mode="vopd")
    with pytest.raises(ValueError, match="teacher_model_server_chunk_rows must be >= 1, got 0"):
        tiny_config(tmp_path, teacher_model_server_url="http://x", teacher_model_server_chunk_rows=0)
    with pytest.raises(ValueError, match="teacher_model_server_request_timeout must be > 0"):
        tiny_config(tmp_path, teacher_model_server_url="http://x", teacher_model_server_request_timeout=0)
    args = tiny_config(tmp_path, teacher_model_server_url="http://127.0.0.1:9")
    with pytest.raises(ValueError, match="not both"):
        TVOPDTrainer(model="does/not/exist", teacher_model=model_dirs["teacher"], args=args)
    # Without vLLM installed (as here), the error comes before any model loads.
    with pytest.raises(ImportError, match=r'teacher_model_server_url needs vLLM.*pip install -e "\.\[vllm\]"'):
        TVOPDTrainer(model="does/not/exist", args=args)
    with pytest.raises(ImportError, match=r"use_vllm=True needs vLLM"):
        TVOPDTrainer(model="does/not/exist", teacher_model="also/missing", args=tiny_config(tmp_path, use_vllm=True))


def test_main_job_with_a_served_teacher(teacher_server, tmp_path):
    import json
    from pathlib import Path

    from tvopd_trl import tiny
    from tvopd_trl.scripts.train import run

    _VLLMStandIn.teacher = AutoModelForCausalLM.from_pretrained(tiny.teacher_path()).eval()
    recipe = Path(__file__).resolve().parent.parent / "recipes" / "tiny" / "tvopd.yaml"
    short = ["--max_steps", "3", "--eval_problems", "8", "--eval_k", "2", "--eval_every_steps", "3"]
    run(["--config", str(recipe), "--output_dir", str(tmp_path), "--teacher_model_server_url", teacher_server, *short])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["teacher"] == teacher_server and summary["steps"] == 3
    assert "teacher_accuracy" not in summary and summary["gap_closed"] is None  # no local teacher to evaluate
    # Each rollout's 128 rows, in chunks of at most MAX_CHUNK_ROWS
    sizes = [len(request["prompt"]) for request in _VLLMStandIn.requests]
    assert sum(sizes) == 3 * 128 and max(sizes) == MAX_CHUNK_ROWS


def test_main_job_with_a_local_and_a_served_teacher(teacher_server, tmp_path):
    import json
    from pathlib import Path

    from tvopd_trl import tiny
    from tvopd_trl.scripts.train import run

    family = tiny.multi_teacher_paths()
    _VLLMStandIn.teacher = AutoModelForCausalLM.from_pretrained(family["teachers"]["subtraction"]).eval()
    recipe = Path(__file__).resolve().parent.parent / "recipes" / "tiny" / "multi_teacher.yaml"
    flags = ["--model_name_or_path", family["student"], "--output_dir", str(tmp_path)]
    flags += ["--teacher_model_name_or_path", json.dumps(family["teachers"])]  # the served one: its tokenizer
    flags += ["--teacher_model_server_url", json.dumps({"subtraction": teacher_server})]
    flags += ["--max_steps", "2", "--per_device_train_batch_size", "16", "--eval_problems", "4", "--eval_k", "1"]
    run(["--config", str(recipe), *flags, "--eval_every_steps", "0", "--logging_steps", "1"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["teacher"] == {"addition": family["teachers"]["addition"], "subtraction": teacher_server}
    assert set(summary["teachers"]) == {"addition", "addition_greedy"}  # the local teacher is evaluated
    assert len(_VLLMStandIn.requests) == 2  # one request a rollout, for the subtraction rows
    assert set(summary["final_tv_scales"]) == {"tv/addition/scale", "tv/subtraction/scale"}


def test_a_served_and_a_local_teacher_each_score_their_own_rows(make_trainer, teacher_server, model_dirs, tmp_path):
    from tvopd_trl.tiny import prompt_dataset

    dataset = prompt_dataset("opd", 8).add_column("teacher_id", ["served", "local"] * 4)
    args = tiny_config(tmp_path, teacher_model_server_url={"served": teacher_server}, teacher_model_server_timeout=5)
    trainer = make_trainer(args, teacher_model={"local": model_dirs["student"]}, train_dataset=dataset)
    assert [(name, t.served) for name, t in trainer.teachers.items()] == [("local", False), ("served", True)]
    batch = trainer.score_completions(trainer.generate_completions([dataset[i] for i in range(8)]))
    # The server saw only its own rows, in one request
    assert len(_VLLMStandIn.requests) == 1 and len(_VLLMStandIn.requests[0]["prompt"]) == 4
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    keep = batch["completion_ids"].size(1)
    served = batch["teacher_index"] == 1  # "local" comes first: local teachers, then served ones
    expected = trainer._sampled_token_logps(trainer.teachers["local"].model, ids, mask, keep)
    torch.testing.assert_close(batch["teacher_logps"][~served], expected[~served], rtol=0, atol=0)
    wide = AutoModelForCausalLM.from_pretrained(model_dirs["teacher"])  # the model behind the stand-in
    expected = trainer._sampled_token_logps(wide, ids, mask, keep)
    torch.testing.assert_close(batch["teacher_logps"][served], expected[served], rtol=1e-5, atol=1e-5)
