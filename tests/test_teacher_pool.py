"""A pool of teacher servers (`teacher_model_server_url` as a list of replicas), against local stand-ins of vLLM.

Each replica is the stand-in of `test_served_teacher.py` on its own port, scoring with the same real tiny teacher, with
what a replica can do wrong added: answer slowly, answer 5xx from some request on, or stop listening. TRL's own
`VLLMClient` makes the requests. No real vLLM server ran.
"""

import contextlib
import hashlib
import json
import math
import subprocess
import sys
import threading
import time
import warnings
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

import tvopd_trl.served_teacher
from tests.test_served_teacher import _VLLMStandIn, black_hole, finishes_within
from tvopd_trl.checks import check_teacher_pools
from tvopd_trl.scoring import SERVED_TEACHER_STATS
from tvopd_trl.served_teacher import MAX_CHUNK_ROWS, TeacherServerPool, connect_teacher_pool, served_teacher_logps
from tvopd_trl.testing import tiny_config

from .timeouts import time_limit


class _Replica(_VLLMStandIn):
    delay = 0.0  # seconds each scoring request takes on top of the scoring
    slow = math.inf  # scoring requests, from the first, that `delay` applies to
    fail_after = math.inf  # scoring requests answered before the replica answers everything with a 503
    transient = 0  # scoring requests, from the first, answered with a 503 (an overloaded server) before it recovers
    refused = 0  # scoring requests it answered with a 503
    serial = None  # a lock: one request at a time, like a server whose accelerator is saturated
    arrivals = None  # `time.monotonic()` at each scoring request's arrival

    def do_GET(self):
        if len(type(self).requests) >= type(self).fail_after:
            self._reply({"error": "the engine died"}, status=503)
        else:
            super().do_GET()

    def do_POST(self):
        cls = type(self)
        cls.arrivals.append(time.monotonic())
        if len(cls.requests) >= cls.fail_after or cls.refused < cls.transient:
            cls.refused += 1
            self.rfile.read(int(self.headers["Content-Length"]))
            self._reply({"error": "the engine died"}, status=503)
            return
        with cls.serial or contextlib.nullcontext():
            time.sleep(cls.delay if len(cls.arrivals) <= cls.slow else 0.0)
            try:
                super().do_POST()
            except BrokenPipeError:  # the pool gave up on this request (its timeout) and closed the connection
                pass


class StandInServer:
    """A replica on its own port (or `port`, to restart one); `handler`'s class attributes (`requests`, `delay`,
    `fail_after`, ...) are its own."""

    def __init__(self, teacher, port=0, **behaviour):
        self.handler = type("Replica", (_Replica,), {"teacher": teacher, "requests": [], "arrivals": [], **behaviour})
        self.server = ThreadingHTTPServer(("127.0.0.1", port), self.handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        """Nothing listens on the port afterwards: every request is refused."""
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def start_replicas(model_dirs, monkeypatch):
    """`start_replicas(count, port=0, **behaviour)`: that many replicas of the on-disk teacher, stopped at the end."""
    import trl.generation.vllm_client

    # vLLM itself is not installed here; TRL's client only needs `requests` for these calls.
    monkeypatch.setattr(trl.generation.vllm_client, "is_vllm_available", lambda *args, **kwargs: True)
    monkeypatch.setattr("tvopd_trl.checks.is_vllm_available", lambda *args, **kwargs: True)
    teacher = AutoModelForCausalLM.from_pretrained(model_dirs["teacher"]).eval()
    started = []

    def start(count, port=0, **behaviour):
        servers = [StandInServer(teacher, port, **behaviour) for _ in range(count)]
        started.extend(servers)
        return servers

    yield start
    for server in started:
        server.stop()


def rollout(tokenizer, rows=12, prompt=6, completion=7, seed=0):
    """A rollout batch as TRL's generation returns it: left-padded prompts, right-padded completions."""
    generator = torch.Generator().manual_seed(seed)
    low = len(tokenizer.all_special_ids) + 1
    prompt_ids = torch.randint(low, len(tokenizer), (rows, prompt), generator=generator)
    completion_ids = torch.randint(low, len(tokenizer), (rows, completion), generator=generator)
    positions = torch.arange(prompt), torch.arange(completion)
    prompt_mask = (positions[0] >= torch.randint(0, prompt - 1, (rows, 1), generator=generator)).long()
    completion_mask = (positions[1] < torch.randint(1, completion + 1, (rows, 1), generator=generator)).long()
    return {
        "prompt_ids": prompt_ids * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids * completion_mask,
        "completion_mask": completion_mask,
    }


def local_logps(teacher, batch, temperature):
    """The teacher, in process, on each unpadded sequence: the reference every pool must reproduce."""
    expected = torch.zeros(batch["completion_ids"].shape)
    for row in range(len(expected)):
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()]
        completion = batch["completion_ids"][row][batch["completion_mask"][row].bool()]
        with torch.no_grad():
            logits = teacher(torch.cat([prompt, completion])[None]).logits[0].float()
        logps = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 : -1]
        expected[row, : len(completion)] = logps.gather(1, completion[:, None]).squeeze(1)
    return expected


FAST = dict(backoff=0.01, cooldown=0.2, request_timeout=5)


def test_pool_scores_are_the_teachers_whatever_the_chunking(start_replicas, tokenizer):
    servers = start_replicas(3)
    batch = rollout(tokenizer)
    expected = local_logps(servers[0].handler.teacher, batch, 0.7)
    single = served_teacher_logps(
        connect_teacher_pool(servers[0].url, 0, "the teacher").replicas[0].client, batch, 0.7
    )
    torch.testing.assert_close(single, expected, atol=1e-5, rtol=0)
    for chunk_rows in (None, 1, 5, 12):
        pool = connect_teacher_pool([server.url for server in servers], 0, "the teacher", chunk_rows=chunk_rows)
        assert torch.equal(pool.score(batch, 0.7), single)  # each sequence is scored on its own, wherever
        assert pool.last_stats["retries"] == 0 and pool.last_stats["replicas_down"] == 0
    # The trainer pools each statistic over processes by a rule of its own: it has one for every statistic
    assert list(pool.last_stats) == list(SERVED_TEACHER_STATS)
    # Chunks of one row spread over every replica
    assert all(len(server.handler.requests) >= 2 for server in servers)

    # A pool of one sends a short rollout whole, and cuts a long one into chunks of at most MAX_CHUNK_ROWS rows: the
    # work one request, and so its timeout, has to cover does not grow with the rollout
    pool = connect_teacher_pool(servers[0].url, 0, "the teacher")
    servers[0].handler.requests = []
    assert torch.equal(pool.score(batch, 0.7), single)
    assert [len(request["prompt"]) for request in servers[0].handler.requests] == [len(single)]
    long = rollout(tokenizer, rows=2 * MAX_CHUNK_ROWS + 3)
    servers[0].handler.requests = []
    torch.testing.assert_close(
        pool.score(long, 0.7), local_logps(servers[0].handler.teacher, long, 0.7), atol=1e-5, rtol=0
    )
    assert sorted(len(request["prompt"]) for request in servers[0].handler.requests) == [
        3,
        MAX_CHUNK_ROWS,
        MAX_CHUNK_ROWS,
    ]


def test_a_replica_that_fails_mid_run_leaves_the_numbers_unchanged(start_replicas, tokenizer):
    first, second = start_replicas(2)
    batch = rollout(tokenizer)
    expected = local_logps(first.handler.teacher, batch, 1.0)
    pool = connect_teacher_pool([first.url, second.url], 0, "the teacher", chunk_rows=2, **FAST)
    torch.testing.assert_close(pool.score(batch, 1.0), expected, atol=1e-5, rtol=0)

    # The second replica's engine dies between two rollouts: the pool only learns it from 5xx answers
    second.handler.fail_after = len(second.handler.requests)
    torch.testing.assert_close(pool.score(batch, 1.0), expected, atol=1e-5, rtol=0)
    # Each 503 was a retry, on the first replica; two in a row set the second aside
    assert pool.last_stats["retries"] == second.handler.refused >= 2
    assert pool.last_stats["replicas_down"] == 1

    # Then its process is gone: set aside, it gets no chunk, and its health probe after the cooldown fails
    second.stop()
    time.sleep(FAST["cooldown"])
    torch.testing.assert_close(pool.score(batch, 1.0), expected, atol=1e-5, rtol=0)
    assert pool.last_stats["retries"] == 0 and pool.last_stats["replicas_down"] == 1

    # Restarted, it answers its next probe and takes chunks again
    (restarted,) = start_replicas(1, port=second.port)
    time.sleep(FAST["cooldown"])
    pool.score(batch, 1.0)  # probed during this rollout
    torch.testing.assert_close(pool.score(batch, 1.0), expected, atol=1e-5, rtol=0)
    assert pool.last_stats["replicas_down"] == 0 and restarted.handler.requests


def test_every_replica_down_is_one_error_naming_them_all(start_replicas, tokenizer):
    servers = start_replicas(2)
    urls = [server.url for server in servers]
    pool = connect_teacher_pool(urls, 0, "the teacher server 'teacher'", chunk_rows=3, **FAST)
    for server in servers:
        server.stop()
    start = time.perf_counter()
    with pytest.raises(ConnectionError, match=r"failed to score rows \d+-\d+ of the rollout 5 times") as error:
        pool.score(rollout(tokenizer), 1.0)
    assert all(url in str(error.value) for url in urls) and "resume from the last checkpoint" in str(error.value)
    assert time.perf_counter() - start < 5  # the retry budget, with this backoff; then it gives up


def test_replicas_are_probed_before_any_model_loads(start_replicas, tokenizer):
    dead = ["http://127.0.0.1:9", "http://127.0.0.1:11"]  # nothing listens there
    with pytest.raises(ConnectionError, match=r"None of the 2 replicas .* answered within 0 s") as error:
        connect_teacher_pool(dead, 0, "the teacher server 'teacher'")
    assert all(url in str(error.value) for url in dead)
    # A pool of one fails as a single server always did
    with pytest.raises(ConnectionError, match=r"The teacher server 'teacher' at http://127.0.0.1:9 did not answer"):
        connect_teacher_pool(dead[0], 0, "the teacher server 'teacher'")

    late, server = start_replicas(2, delay=0.05)  # slow enough that a probe fails while chunks are in flight
    late.stop()
    with pytest.warns(UserWarning, match=rf"1 of its 2 replicas did not answer within 0 s \({late.url}\)"):
        pool = connect_teacher_pool([late.url, server.url], 0, "the teacher server 'teacher'", **FAST)
    batch = rollout(tokenizer)
    expected = local_logps(server.handler.teacher, batch, 1.0)
    torch.testing.assert_close(pool.score(batch, 1.0), expected, atol=1e-5, rtol=0)
    assert pool.last_stats["retries"] == 0 and pool.last_stats["replicas_down"] == 1

    # While it stays down, its probes fail like requests do: the others go on scoring
    time.sleep(FAST["cooldown"])
    torch.testing.assert_close(pool.score(batch, 1.0), expected, atol=1e-5, rtol=0)
    time.sleep(FAST["cooldown"])
    torch.testing.assert_close(pool.score(batch, 1.0), expected, atol=1e-5, rtol=0)
    assert pool.replicas[0].client is None and pool.last_stats["replicas_down"] == 1

    # Back but failing (its engine died: 503 on every endpoint), it fails its probe and stays aside
    (late,) = start_replicas(1, port=late.port, fail_after=0)
    failures = pool.replicas[0].failures
    time.sleep(FAST["cooldown"])
    torch.testing.assert_close(pool.score(batch, 1.0), expected, atol=1e-5, rtol=0)
    assert pool.replicas[0].client is None and pool.replicas[0].failures > failures
    late.stop()

    # The replica that was down at the start gets its client once it answers a probe
    (late,) = start_replicas(1, port=late.port)
    time.sleep(FAST["cooldown"])
    pool.score(batch, 1.0)
    assert pool.replicas[0].client is not None
    torch.testing.assert_close(pool.score(batch, 1.0), expected, atol=1e-5, rtol=0)
    assert pool.last_stats["replicas_down"] == 0 and late.handler.requests


def test_a_slow_replica_gets_a_smaller_share(start_replicas, tokenizer):
    (fast,) = start_replicas(1)
    (slow,) = start_replicas(1, delay=0.4)
    batch = rollout(tokenizer, rows=16)
    expected = local_logps(fast.handler.teacher, batch, 1.0)
    pool = connect_teacher_pool([fast.url, slow.url], 0, "the teacher", chunk_rows=1, max_in_flight=1, **FAST)
    torch.testing.assert_close(pool.score(batch, 1.0), expected, atol=1e-5, rtol=0)
    assert len(slow.handler.requests) <= 3 and len(fast.handler.requests) >= 13

    # A replica slower than the request timeout is a failed one: its chunks move to the other
    slow.handler.delay = 2.0
    pool.request_timeout = 0.5
    for replica in pool.replicas:
        pool._attach(replica.client)
    torch.testing.assert_close(pool.score(batch, 1.0), expected, atol=1e-5, rtol=0)
    assert pool.last_stats["retries"] >= 1


class _SilentAfterHealth(_VLLMStandIn):
    """Answers its health check, then never again: TRL's client asks `/v1/models` without a timeout."""

    def do_GET(self):
        if self.path == "/health":
            self._reply({})
        else:
            time.sleep(3600)


@pytest.mark.compat_skip
def test_start_up_sets_aside_replicas_that_never_answer_or_answer_503(start_replicas, tokenizer):
    """TRL's health check has no request timeout and asks again forever on an error status: start-up must not hang on
    a replica that accepts the connection and never answers, nor on one whose engine died (503 on `/health`)."""
    good, dead = start_replicas(2)
    dead.handler.fail_after = 0  # 503 on every endpoint
    hole, silent = black_hole()
    start = time.monotonic()
    with pytest.warns(UserWarning, match=rf"2 of its 3 replicas did not answer within 1 s \({silent}, {dead.url}\)"):
        pool = finishes_within(15, connect_teacher_pool, [good.url, silent, dead.url], 1, "the teacher", **FAST)
    assert time.monotonic() - start < 5  # the deadline, not TRL's loop
    assert [replica.client is not None for replica in pool.replicas] == [True, False, False]
    batch = rollout(tokenizer)
    expected = local_logps(good.handler.teacher, batch, 1.0)
    torch.testing.assert_close(pool.score(batch, 1.0), expected, atol=1e-5, rtol=0)
    assert pool.last_stats["replicas_down"] == 2

    with pytest.raises(ConnectionError, match=r"None of the 2 replicas of the teacher answered within 1 s"):
        finishes_within(15, connect_teacher_pool, [silent, dead.url], 1, "the teacher")
    with pytest.raises(ConnectionError, match=rf"The teacher at {silent} did not answer within 1 s. Start it first"):
        finishes_within(15, connect_teacher_pool, silent, 1, "the teacher")

    # One that answers its health check and then hangs (in TRL's client) is set aside once the grace is over
    hung = ThreadingHTTPServer(("127.0.0.1", 0), _SilentAfterHealth)
    threading.Thread(target=hung.serve_forever, daemon=True).start()
    hung_url = f"http://127.0.0.1:{hung.server_address[1]}"
    with pytest.warns(UserWarning, match=rf"1 of its 2 replicas did not answer within 0 s \({hung_url}\)"):
        pool = finishes_within(15, connect_teacher_pool, [good.url, hung_url], 0, "the teacher", **FAST)
    assert pool.replicas[1].client is None
    hung.shutdown()
    hole.close()


def test_a_retry_backoff_sleeps_instead_of_spinning(start_replicas, tokenizer, monkeypatch):
    (server,) = start_replicas(1, transient=2)  # two 503s (an overloaded server), then answers
    pool = connect_teacher_pool(server.url, 0, "the teacher", backoff=0.3)
    waits, real_wait = [], tvopd_trl.served_teacher.wait

    def counted_wait(*args, **kwargs):
        waits.append(args)
        return real_wait(*args, **kwargs)

    monkeypatch.setattr(tvopd_trl.served_teacher, "wait", counted_wait)
    batch = rollout(tokenizer)
    expected = local_logps(server.handler.teacher, batch, 1.0)
    torch.testing.assert_close(pool.score(batch, 1.0), expected, atol=1e-5, rtol=0)
    assert pool.last_stats["retries"] == 2
    # 0.9 s of backoff with nothing in flight: a few wake-ups, not a loop spinning on `wait({})` (10^5 calls)
    assert len(waits) < 20


def test_a_timed_out_chunk_waits_its_backoff_and_keeps_its_place_on_the_only_replica(start_replicas, tokenizer):
    (server,) = start_replicas(1, delay=1.5, slow=1)  # the first request outlasts the timeout, the others are quick
    batch = rollout(tokenizer, rows=4)
    pool = connect_teacher_pool(
        server.url, 0, "the teacher", chunk_rows=2, max_in_flight=1, request_timeout=0.5, backoff=0.4
    )
    expected = local_logps(server.handler.teacher, batch, 1.0)
    torch.testing.assert_close(pool.score(batch, 1.0), expected, atol=1e-5, rtol=0)
    assert pool.last_stats["retries"] == 1
    # The first chunk went back only after its timeout and its backoff, and before the second chunk, which did not
    # take its slot meanwhile
    first, again, second = server.handler.arrivals
    assert again - first >= 0.85 and second > again
    assert server.handler.requests[0]["prompt"] == served_prompts(batch)[:2]


def served_prompts(batch):
    """The unpadded prompt + completion of each row, as a scoring request sends them."""
    return [
        prompt[prompt_mask.bool()].tolist() + completion[completion_mask.bool()].tolist()
        for prompt, prompt_mask, completion, completion_mask in zip(
            batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"], strict=True
        )
    ]


def test_a_give_up_slower_than_ddp_timeout_is_a_warning():
    slow = {"teacher": TeacherServerPool([], "the teacher", retries=5, request_timeout=600)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # The defaults give up within 1515 s; a single process has no collective to time out
        check_teacher_pools(SimpleNamespace(world_size=8, ddp_timeout=1800), {"teacher": TeacherServerPool([], "t")})
        check_teacher_pools(SimpleNamespace(world_size=1, ddp_timeout=1800), slow)
    with pytest.warns(UserWarning, match=r"can take 3631 s to give up .* longer than ddp_timeout=1800 s"):
        check_teacher_pools(SimpleNamespace(world_size=8, ddp_timeout=1800), slow)


_GIVES_UP = """
import threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import trl.generation.vllm_client

from tvopd_trl.served_teacher import connect_teacher_pool

trl.generation.vllm_client.is_vllm_available = lambda *args, **kwargs: True


class Replica(BaseHTTPRequestHandler):
    hang = False  # scoring requests hang (for 10 min); otherwise they get a 503

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = b'{"data": [{"id": "teacher"}]}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.hang:
            time.sleep(600)
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()


urls = []
for hang in (True, False):
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("R", (Replica,), {"hang": hang}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    urls.append(f"http://127.0.0.1:{server.server_address[1]}")
pool = connect_teacher_pool(urls, 5, "the teacher", chunk_rows=1, max_in_flight=1, retries=1, backoff=0.01)
ones = torch.ones(2, 3, dtype=torch.long)
try:
    pool.score({"prompt_ids": ones, "prompt_mask": ones, "completion_ids": ones, "completion_mask": ones}, 1.0)
except ConnectionError:
    print("GAVE_UP", time.time(), flush=True)
"""


@pytest.mark.compat_skip
def test_a_process_exits_at_once_after_the_pool_gives_up(tmp_path):
    """The first replica hangs on its chunk while the second fails the other one past its retries: the process must
    not wait at exit for the hung request (until its 300 s timeout), as it did for an executor's worker thread."""
    script = tmp_path / "gives_up.py"
    script.write_text(_GIVES_UP)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=time_limit(120))
    ended = time.time()
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("GAVE_UP")]
    assert ended - float(line.split()[1]) < 30  # the interpreter's own teardown, not the request's timeout


# ----------------------------------------------------------------------------------------------------------------------
# The trainer on a pool (`teacher_model_server_url=[...]`)
# ----------------------------------------------------------------------------------------------------------------------


class _LoseTheServersAfterSaving(TrainerCallback):
    """At the checkpoint of `step`: its files' digests and the weights, then every replica stops."""

    def __init__(self, servers, step):
        self.servers, self.step, self.digests, self.weights = servers, step, None, None

    def on_save(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            self.digests = _digests(Path(args.output_dir) / f"checkpoint-{self.step}")
            self.weights = [p.detach().clone() for p in model.parameters()]
            for server in self.servers:
                server.stop()


def _digests(folder):
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in folder.iterdir() if path.is_file()}


def test_training_on_a_pool_stops_cleanly_when_every_replica_is_lost(
    start_replicas, make_trainer, tmp_path, tokenizer
):
    servers = start_replicas(2)
    urls = [server.url for server in servers]
    args = tiny_config(
        tmp_path,
        teacher_model_server_url=urls,
        teacher_model_server_timeout=5,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
    )
    lose = _LoseTheServersAfterSaving(servers, step=2)
    trainer = make_trainer(args, teacher_model=None, teacher_processing_class=tokenizer, callbacks=[lose])
    pool = trainer.teachers["teacher"].client
    assert pool.urls == urls
    pool.backoff = 0.01
    with pytest.raises(ConnectionError, match="failed to score rows") as error:
        trainer.train()
    assert all(url in str(error.value) for url in urls)

    # Every logged step scored on the pool, with its statistics
    logs = [entry for entry in trainer.state.log_history if "tv/scale" in entry]
    assert len(logs) == 2 and all(entry["teacher/request_seconds"] > 0 for entry in logs)
    assert all(entry["teacher/retries"] == 0 and entry["teacher/replicas_down"] == 0 for entry in logs)
    # Step 3 never trained on partial teacher values, and the checkpoint of step 2 is the last one, untouched
    assert all(torch.equal(a, b) for a, b in zip(lose.weights, trainer.model.parameters(), strict=True))
    assert sorted(path.name for path in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]
    assert _digests(tmp_path / "checkpoint-2") == lose.digests
    state = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2
