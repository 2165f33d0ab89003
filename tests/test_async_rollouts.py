"""Asynchronous rollouts (`max_staleness`, tvopd_trl/async_rollouts.py) without vLLM: the producer's ordering, staleness
bound, drops, waits and faults against a stand-in request function, the prompt order it draws, and what the trainer
refuses. The real server's side is tests/test_vllm_async.py."""

import threading
import time

import pytest
from datasets import Dataset

from tvopd_trl.async_rollouts import Rollout, RolloutProducer, RolloutServerError, rollout_batches, shareable
from tvopd_trl.testing import tiny_config

from .timeouts import time_limit


SERVER = "http://rollout-server:8000"


class StandIn:
    """A request function that records, for each request, its prompts, the producer's version and whether a weight
    sync overlapped it; each request takes `seconds`, unless `abort()` ends it first with a `ConnectionError`."""

    def __init__(self, seconds=0.0, fail_at=None):
        self.seconds, self.fail_at = seconds, fail_at
        self.producer = None
        self.calls = []
        self.started = []
        self.in_request = threading.Event()
        self.aborted = threading.Event()

    def __call__(self, prompt_ids):
        if len(self.calls) == self.fail_at:
            raise ConnectionError("Connection refused")
        self.in_request.set()
        self.calls.append((prompt_ids[0][0], self.producer.version))
        self.started.append(time.monotonic())
        aborted = self.aborted.wait(self.seconds)
        self.in_request.clear()
        if aborted:
            raise ConnectionError("Connection aborted")
        return [[1, 2]] * len(prompt_ids), [[[-0.5], [-0.25]]] * len(prompt_ids)

    def abort(self):
        self.aborted.set()


def start(max_staleness, version=0, abortable=True, **kwargs):
    request = StandIn(**kwargs)
    producer = RolloutProducer(
        request, max_staleness, version, server=SERVER, abort=request.abort if abortable else None
    )
    request.producer = producer
    return producer, request


def submit(producer, index):
    producer.submit(Rollout(index, rows=[{"index": index}], prompt_ids=[[index]]))


def sync_checking(request):
    def sync():
        assert not request.in_request.is_set(), "a weight sync ran during a request"

    return sync


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_rollouts_come_in_order_and_are_sampled_within_the_staleness_bound(max_staleness):
    producer, request = start(max_staleness, seconds=0.01)
    try:
        for index in range(max_staleness + 1):
            submit(producer, index)
        for index in range(8):
            rollout, statistics = producer.take(index)
            assert rollout.index == index and rollout.rows == [{"index": index}]
            assert rollout.completion_ids == [[1, 2]] and rollout.logprobs == [[[-0.5], [-0.25]]]
            assert statistics.staleness == index - rollout.version <= max_staleness
            assert statistics.dropped == 0
            submit(producer, index + max_staleness + 1)
            time.sleep(0.03)  # "training": the producer samples ahead meanwhile
            producer.update_weights(sync_checking(request))
    finally:
        producer.close()
    # Each rollout was requested as soon as the bound allowed, ahead of the trainer: with the weights of step k - s
    # (later only if the thread was slow to start it)
    versions = dict(request.calls)
    assert all(versions[index] >= max(index - max_staleness, 0) for index in range(8))
    assert sum(versions[index] == index - max_staleness for index in range(max_staleness, 8)) >= 8 - max_staleness - 2


def test_the_producer_samples_ahead_while_the_trainer_trains():
    producer, request = start(1, seconds=0.2)
    try:
        submit(producer, 0)
        submit(producer, 1)
        producer.take(0)
        time.sleep(0.5)  # train on rollout 0 while rollout 1 is sampled
        trained = time.monotonic()
        producer.update_weights(sync_checking(request))
        _, statistics = producer.take(1)
        assert request.started[1] < trained  # sampled during the training, with the weights before its step
        assert request.calls[1] == (1, 0)
        assert statistics.wait_seconds < 0.2  # less than a request: it was ready
    finally:
        producer.close()


def test_a_rollout_staler_than_the_bound_is_dropped_sampled_again_with_the_current_weights_and_counted():
    # The producer never starts a rollout that its bound would drop; `take` is what guarantees the bound. Sample
    # rollouts 0-2 under a bound of 2 (all with version 0), then take rollout 2 under a bound of 1.
    producer, request = start(2)
    try:
        for index in range(3):
            submit(producer, index)
        while len(request.calls) < 3:
            time.sleep(0.01)
        for index in range(2):
            producer.take(index)
            producer.update_weights(lambda: None)
        producer.max_staleness = 1
        rollout, statistics = producer.take(2)
        assert (statistics.dropped, statistics.staleness, rollout.version) == (1, 0, 2)
        assert request.calls == [(0, 0), (1, 0), (2, 0), (2, 2)]  # sampled again, with the current weights
    finally:
        producer.close()


def test_a_server_failure_in_the_producer_is_one_clear_error_at_the_trainer():
    producer, request = start(1, fail_at=1)
    try:
        submit(producer, 0)
        submit(producer, 1)
        producer._thread.join(time_limit(5))  # the thread ends on the failed request for rollout 1
        producer.take(0)  # sampled before the failure: whole, it trains
        # the weight sync after its step does not reach the dead server, nor does the next rollout come
        with pytest.raises(RolloutServerError, match="No update used any batch it did not finish"):
            producer.update_weights(lambda: pytest.fail("synced to a failed server"))
        with pytest.raises(RolloutServerError, match=f"rollout server at {SERVER} failed.*Connection refused.*resume"):
            producer.take(1)
    finally:
        producer.close()


def test_a_slow_server_shows_in_the_trainers_wait(monkeypatch):
    from transformers.testing_utils import CaptureLogger

    from tvopd_trl import async_rollouts

    monkeypatch.setattr(async_rollouts, "WAIT_WARNING_INTERVAL", 0.1)
    producer, request = start(1, seconds=0.35)
    try:
        submit(producer, 0)
        with CaptureLogger(async_rollouts.logger) as captured:
            _, statistics = producer.take(0)
        assert 0.3 < statistics.wait_seconds < 3.0
        # ... and in the log while it lasts: not a silent hang
        assert f"s on the vLLM server at {SERVER}: rollout batch 0." in captured.out
        # the server was never idle for want of work: it sampled as soon as rollout 0 was submitted
        assert producer.collect_sampler_wait() < 0.1
    finally:
        producer.close()


def test_a_weight_sync_that_waits_for_the_request_in_flight_warns_while_it_waits(monkeypatch):
    """Steady state: the next batch is in flight when the step ends, so the trainer waits inside the weight sync."""
    from transformers.testing_utils import CaptureLogger

    from tvopd_trl import async_rollouts

    monkeypatch.setattr(async_rollouts, "WAIT_WARNING_INTERVAL", 0.1)
    producer, request = start(1, seconds=0.5)
    try:
        submit(producer, 0)
        submit(producer, 1)
        producer.take(0)
        assert request.in_request.wait(time_limit(5))  # rollout 1, sampled while step 1 trains
        with CaptureLogger(async_rollouts.logger) as captured:
            waited = producer.update_weights(sync_checking(request))
        assert 0.2 < waited < 3.0
        assert f"s on the vLLM server at {SERVER}: the end of the request in flight, before the weight sync." in (
            captured.out
        )
    finally:
        producer.close()


def test_the_server_failures_found_at_a_weight_sync_go_through_agree():
    """`agree` is where the trainer broadcasts the main process's failure to the others: it sees the failure found
    before the sync and the sync's own, and raising there stops the sync and the version."""
    producer, _ = start(1)
    seen = []

    def agree(failure):
        seen.append(failure)
        if failure is not None:
            raise failure

    def failing_sync():
        raise ConnectionError("Connection refused")

    try:
        with pytest.raises(RolloutServerError, match="failed while loading the weights.*Connection refused"):
            producer.update_weights(failing_sync, agree)
        assert seen[0] is None and isinstance(seen[1], RolloutServerError) and producer.version == 0
        producer.update_weights(lambda: None, agree)
        assert seen[2:] == [None, None] and producer.version == 1
    finally:
        producer.close()


def test_close_waits_for_the_request_in_flight():
    producer, request = start(1, seconds=0.5)
    submit(producer, 0)
    assert request.in_request.wait(time_limit(5))
    producer.close()
    assert not producer._thread.is_alive() and not request.in_request.is_set()


def test_a_rollout_request_that_gets_no_answer_fails_in_time_naming_the_server():
    """A stand-in for a stuck server (it accepts the connection and never answers; tests/test_vllm_async.py stops a
    real one), behind the retrying session TRL's `VLLMClient` builds: a read that timed out is not sent again."""
    import socket
    import types

    import requests
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    from tvopd_trl.async_rollouts import bound_request_time

    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    session = requests.Session()
    session.mount(
        "http://", HTTPAdapter(max_retries=Retry(total=5, read=5, backoff_factor=2, allowed_methods=["POST"]))
    )
    client = types.SimpleNamespace(session=session, base_url=url)
    bound_request_time(client, 0.3)
    try:
        start_time = time.monotonic()
        with pytest.raises(RolloutServerError, match=f"rollout server at {url} did not answer POST .* within 0.3 s"):
            session.post(f"{url}/v1/completions", json={})
        assert time.monotonic() - start_time < 2.0
        # A request's own timeout stands, and its error: no setting of ours bounded it
        with pytest.raises(requests.Timeout, match="read timeout=0.1"):
            session.post(f"{url}/collective_rpc", json={}, timeout=0.1)
    finally:
        listener.close()


def trl_client(url):
    """The two attributes `bound_request_time` reads of TRL's `VLLMClient` for the server at `url`: its base URL, and
    its session with the retries `VLLMClient.__init__` mounts (TRL 1.16)."""
    import types

    import requests
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    retry = Retry(
        total=5,
        connect=5,
        read=5,
        status=3,
        status_forcelist=[500, 502, 503],
        backoff_factor=2,
        allowed_methods=["POST", "GET"],
    )
    session = requests.Session()
    session.mount("http://", HTTPAdapter(max_retries=retry))
    return types.SimpleNamespace(session=session, base_url=url)


@pytest.fixture
def flaky_server():
    """`flaky_server(drops=0, silent=False)`: the URL of a stand-in server that closes the connection of its first
    `drops` POSTs without answering (a keep-alive connection it closed, a restart: faults a real vLLM server does not
    show on demand) and answers the others with `{}`, or, `silent`, never answers; and the list of the POSTs it got."""
    import http.server

    servers, release = [], threading.Event()

    def start(drops=0, silent=False):
        posts = []

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                nonlocal drops
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                posts.append(self.path)
                if silent:
                    release.wait(30)
                    return
                if drops:
                    drops -= 1
                    self.close_connection = True
                    self.connection.close()
                    return
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def handle_one_request(self):
                try:
                    super().handle_one_request()
                except (OSError, ValueError):  # the connection it closed
                    self.close_connection = True

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", posts

    yield start
    release.set()
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_connection_the_server_dropped_before_answering_is_sent_again_once(flaky_server):
    """TRL's client retries a failed read; `bound_request_time` keeps one retry of a connection closed before any
    answer (urllib3 counts it a read error too), so that a keep-alive reset does not stop the run. Before: one dropped
    connection was a `ConnectionError`, after one POST."""
    import requests

    from tvopd_trl.async_rollouts import bound_request_time

    url, posts = flaky_server(drops=1)
    client = trl_client(url)
    bound_request_time(client, 5.0)
    assert client.session.post(f"{url}/v1/completions", json={}).json() == {}
    assert posts == ["/v1/completions"] * 2
    # Dropped again: once, not TRL's five times with a backoff
    url, posts = flaky_server(drops=5)
    client = trl_client(url)
    bound_request_time(client, 5.0)
    with pytest.raises(requests.ConnectionError, match="without response"):
        client.session.post(f"{url}/reset_prefix_cache")
    assert posts == ["/reset_prefix_cache"] * 2
    # A request that timed out is never sent again
    url, posts = flaky_server(silent=True)
    client = trl_client(url)
    bound_request_time(client, 0.3)
    with pytest.raises(RolloutServerError, match="within 0.3 s"):
        client.session.post(f"{url}/v1/completions", json={})
    time.sleep(0.2)  # a second POST would have arrived by now
    assert posts == ["/v1/completions"]


def test_a_weight_reload_without_an_answer_names_the_setting_that_bounds_it_once(flaky_server, tmp_path):
    """The weight sync of a trainer without CUDA (its `POST /collective_rpc`) is bounded, as every request to the
    rollout server, by `vllm_server_request_timeout`, which its error names; in an asynchronous run's weight sync the
    producer reports it once. Before: the reload used `vllm_server_timeout` (TRL's start-up wait) while the error
    named the other, and the producer's error nested the request's, advice and all."""
    import torch
    from accelerate import Accelerator

    from tvopd_trl.async_rollouts import bound_request_time
    from tvopd_trl.vllm_weight_sync import CPUWeightSyncGeneration

    url, posts = flaky_server(silent=True)
    client = trl_client(url)
    bound_request_time(client, 0.3)  # vllm_server_request_timeout
    generation = CPUWeightSyncGeneration.__new__(CPUWeightSyncGeneration)
    generation.mode, generation.accelerator = "server", Accelerator(cpu=True)
    generation.vllm_client, generation.weights_dir = client, str(tmp_path)
    generation.server_timeout = 0.1  # vllm_server_timeout
    generation._iter_named_params = lambda: iter([("w", torch.zeros(2))])
    generation._tied_names = lambda: []

    with pytest.raises(RolloutServerError) as raised:
        generation.sync_weights()
    assert f"did not answer POST {url}/collective_rpc within 0.3 s (vllm_server_request_timeout)" in str(raised.value)

    producer = RolloutProducer(lambda prompt_ids: ([], []), max_staleness=1, version=0, server=url)
    try:
        with pytest.raises(RolloutServerError) as raised:
            producer.update_weights(generation.sync_weights)
    finally:
        producer.close()
    message = str(raised.value)
    assert message.startswith(
        f"The vLLM rollout server at {url} did not answer POST {url}/collective_rpc within 0.3 s "
        "(vllm_server_request_timeout) while loading the weights of the last optimizer step. No update used"
    )
    assert message.count(url) == 2 and message.count("--resume_from_checkpoint last") == 1
    assert "raise vllm_server_request_timeout if its answers take this long" in message
    assert posts == ["/collective_rpc"] * 2  # one per sync: none sent again


def test_the_sampler_wait_is_the_servers_idle_time():
    producer, request = start(1)
    try:
        submit(producer, 0)
        producer.take(0)
        time.sleep(0.2)  # nothing submitted: the server idles
        submit(producer, 1)
        producer.take(1)
        assert 0.15 < producer.collect_sampler_wait() < 2.0
        assert producer.collect_sampler_wait() == 0.0  # read and reset
    finally:
        producer.close()


def test_close_stops_a_waiting_producer():
    producer, _ = start(1)
    submit(producer, 5)  # not startable before version 4: the thread waits
    producer.close()
    assert not producer._thread.is_alive()


def wait_until(condition, timeout=5.0):
    deadline = time.monotonic() + time_limit(timeout)
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_producer_closed_while_its_thread_waits_for_the_lock_starts_no_request():
    """The thread takes the next rollout, then waits for the lock (a weight sync, a callback's request holds it); a
    `close()` meanwhile must stop it once it has the lock. Before: it started one more request."""
    producer, request = start(1)
    with producer.lock:  # a weight sync
        submit(producer, 0)
        assert wait_until(lambda: not producer._pending)  # taken: the thread waits for the lock
        closing = threading.Thread(target=producer.close)
        closing.start()
        assert wait_until(lambda: producer._stopped)
    closing.join(time_limit(5))
    assert not closing.is_alive() and not producer._thread.is_alive()
    assert request.calls == []


def test_a_producer_closed_on_an_error_aborts_the_request_in_flight_instead_of_waiting_for_it():
    """Training left on an exception or a Ctrl-C (`close(abandon=True)`): the batch in flight will train no step, and
    the request may take up to `vllm_server_request_timeout`. Before: `close` waited for it."""
    producer, request = start(1, seconds=60)
    submit(producer, 0)
    submit(producer, 1)
    assert request.in_request.wait(time_limit(5))
    start_time = time.monotonic()
    producer.close(abandon=True)
    assert time.monotonic() - start_time < 10  # not the request's 60 s
    assert request.aborted.is_set() and not producer._thread.is_alive()
    assert request.calls == [(0, 0)]  # nothing requested after the aborted one


def test_a_request_an_abort_cannot_reach_is_left_to_end_and_nothing_follows_it(monkeypatch):
    from transformers.testing_utils import CaptureLogger

    from tvopd_trl import async_rollouts

    monkeypatch.setattr(async_rollouts, "ABANDON_WAIT", 0.1)
    producer, request = start(1, seconds=1.0, abortable=False)
    submit(producer, 0)
    submit(producer, 1)
    assert request.in_request.wait(time_limit(5))
    with CaptureLogger(async_rollouts.logger) as captured:
        producer.close(abandon=True)
    assert f"The request in flight to the vLLM server at {SERVER} did not end when training stopped" in captured.out
    producer._thread.join(time_limit(10))
    assert not producer._thread.is_alive()
    assert request.calls == [(0, 0)]  # once its request ended, the thread stopped: rollout 1 was never requested


def test_abort_ends_the_request_in_flight_on_a_session_and_the_session_stays_usable():
    """`abortable_requests` on a session with TRL's retries: the request in flight fails at once, is not sent again
    (its pool is closed before its socket), and the session's later requests connect anew."""
    import requests
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    from tvopd_trl.async_rollouts import abortable_requests

    from .distributed_scripts.async_stand_in import StandInClient, StandInServer

    server = StandInServer([1, 2], hang_from=1, hang_seconds=60)
    try:
        client = StandInClient(server.url)
        retry = Retry(total=5, connect=5, read=5, backoff_factor=2, allowed_methods=["POST", "GET"])
        client.session.mount("http://", HTTPAdapter(max_retries=retry))
        abort = abortable_requests(client.session)
        errors = []

        def generate():
            try:
                client.generate([[3]])
            except requests.RequestException as error:
                errors.append(error)

        thread = threading.Thread(target=generate)
        thread.start()
        assert server.wait_for_request(1, time_limit(10))
        start_time = time.monotonic()
        abort()
        thread.join(time_limit(10))
        assert not thread.is_alive() and time.monotonic() - start_time < 10
        assert len(errors) == 1 and isinstance(errors[0], requests.ConnectionError)
        server.hang_from = None
        assert client.generate([[3]])["completion_ids"] == [[1, 2]]
        assert server.requests == 2  # the aborted request, once, and the later one
    finally:
        server.stop()


# ----------------------------------------------------------------------------------------------------------------------
# The prompt order, and the trainer
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [{}, {"gradient_accumulation_steps": 2, "num_generations": 2}])
def test_rollout_batches_are_the_dataloaders_batches_epoch_after_epoch(make_trainer, tmp_path, settings):
    args = tiny_config(tmp_path, per_device_train_batch_size=4, **settings)
    trainer = make_trainer(args, train_dataset=make_trainer.keywords["train_dataset"].select(range(20)))
    per_rollout = args.per_device_train_batch_size * args.gradient_accumulation_steps
    # Over 3 epochs of 20 prompts (5 rollout batches of distinct prompts each), as `Trainer` iterates
    # one dataloader; each batch comes once per micro-step that uses it
    dataloader = trainer.get_train_dataloader()
    loaded = [batch for _ in range(3) for batch in list(dataloader)[:: args.gradient_accumulation_steps]]
    assert len(loaded) == 3 * (20 // (per_rollout // args.num_generations))
    stream = rollout_batches(trainer.train_dataset, trainer._get_train_sampler(), per_rollout)
    assert [next(stream) for _ in loaded] == loaded
    resumed = rollout_batches(trainer.train_dataset, trainer._get_train_sampler(), per_rollout, start=3)
    assert next(resumed) == loaded[3]


def test_staleness_zero_builds_no_asynchronous_machinery(make_trainer, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_config(tmp_path, max_steps=2))
    monkeypatch.setattr(trainer, "_start_rollouts", lambda: pytest.fail("asynchronous rollouts started"))
    trainer.train()
    assert trainer._rollouts is None and trainer._rollout_stream is None
    logs = [entry for entry in trainer.state.log_history if "tv/scale" in entry]
    assert len(logs) == 2 and not any(key.startswith("async/") for entry in logs for key in entry)


def test_a_callback_that_samples_at_an_optimizer_step_adds_no_weight_sync(make_trainer, tmp_path):
    """The weight sync after each optimizer step has loaded the weights under the producer's lock; a callback that
    samples in `on_optimizer_step` (where `global_step` does not count the step yet) must not load them again, outside
    the lock, in the middle of the producer's request. Before: 7 syncs for 3 steps."""
    from transformers import TrainerCallback

    from .distributed_scripts.async_stand_in import use_stand_in

    trainer = make_trainer(tiny_config(tmp_path, max_steps=3))
    server = use_stand_in(trainer, delay=0.3)

    class Sample(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            trainer.generate_completions([trainer.train_dataset[0]])

    trainer.add_callback(Sample())
    try:
        trainer.train()
    finally:
        server.stop()
    generation = trainer.vllm_generation
    assert generation.syncs == 4  # before the first rollout, and after each optimizer step
    assert generation.syncs_during_requests == 0
    assert server.requests == 6  # three rollout batches, three callback samplings


def test_an_interrupt_during_training_aborts_the_request_in_flight(make_trainer, tmp_path):
    """A Ctrl-C reaches the caller within seconds, not after the request in flight (60 s here; with a stuck server,
    up to `vllm_server_request_timeout`): its connection is closed, and the producer's thread ends with it. Before: the
    KeyboardInterrupt waited for the request."""
    import requests
    from transformers import TrainerCallback

    from .distributed_scripts.async_stand_in import use_stand_in

    trainer = make_trainer(tiny_config(tmp_path, max_steps=6))
    server = use_stand_in(trainer, hang_from=3, hang_seconds=60)  # rollout batches 0 and 1 come, 2 takes 60 s
    seen = {}

    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                assert server.wait_for_request(3, time_limit(30))  # rollout batch 2's, sampled after step 1's sync
                seen["producer"], seen["raised"] = trainer._rollouts, time.monotonic()
                raise KeyboardInterrupt

    trainer.add_callback(Interrupt())
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
        assert time.monotonic() - seen["raised"] < 10
        producer = seen["producer"]
        assert not producer._thread.is_alive() and isinstance(producer._error, requests.ConnectionError)
        assert server.requests == 3 and trainer._rollouts is None
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "needs use_vllm=True and vllm_mode='server'"),
        ({"use_vllm": True, "vllm_mode": "colocate"}, "needs use_vllm=True and vllm_mode='server'"),
        ({"use_vllm": True, "vllm_mode": "server", "steps_per_generation": 2}, "steps_per_generation=2"),
        ({"use_vllm": True, "vllm_mode": "server", "num_iterations": 2}, "num_iterations=2"),
    ],
)
def test_unsupported_settings_are_refused_before_any_model_loads(tmp_path, settings, message):
    from tvopd_trl.async_rollouts import check_async_setup

    args = tiny_config(tmp_path, max_staleness=1, **settings)
    with pytest.raises(ValueError, match=message):
        check_async_setup(args, Dataset.from_list([{"prompt": "1 + 1"}]))


def test_a_streamed_dataset_is_refused(tmp_path):
    from tvopd_trl.async_rollouts import check_async_setup

    args = tiny_config(tmp_path, max_staleness=1, use_vllm=True, vllm_mode="server")
    streamed = Dataset.from_list([{"prompt": "1 + 1"}]).to_iterable_dataset()
    with pytest.raises(ValueError, match="map-style dataset"):
        check_async_setup(args, streamed)


def test_staleness_without_the_importance_correction_is_allowed_with_a_warning(tmp_path):
    from transformers.testing_utils import CaptureLogger

    from tvopd_trl import async_rollouts

    args = tiny_config(
        tmp_path, max_staleness=1, use_vllm=True, vllm_mode="server", vllm_importance_sampling_correction=False
    )
    with CaptureLogger(async_rollouts.logger) as captured:
        async_rollouts.check_async_setup(args, Dataset.from_list([{"prompt": "1 + 1"}]))
    assert "max_staleness=1 without vllm_importance_sampling_correction" in captured.out
    with CaptureLogger(async_rollouts.logger) as captured:
        args.vllm_importance_sampling_correction = True
        async_rollouts.check_async_setup(args, Dataset.from_list([{"prompt": "1 + 1"}]))
    assert captured.out == ""


def test_a_negative_staleness_is_refused(tmp_path):
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        tiny_config(tmp_path, max_staleness=-1)


def test_an_error_crosses_to_the_other_processes_as_itself_or_as_its_text():
    """What `_take_rollout` broadcasts: the error itself where it can be rebuilt on the other side, else a
    `RuntimeError` with its type and text, never a broadcast that fails on it."""

    class NeedsTwo(Exception):  # pickles, but cannot be rebuilt from its args
        def __init__(self, first, second):
            super().__init__(f"{first} and {second}")

    plain = shareable(ValueError("A prompt tokenized to no token at all"))
    assert type(plain) is ValueError and str(plain) == "A prompt tokenized to no token at all"
    server = shareable(RolloutServerError("timed out", reason="did not answer", fix="raise it"))
    assert type(server) is RolloutServerError and (str(server), server.reason, server.fix) == (
        "timed out",
        "did not answer",
        "raise it",
    )
    rebuilt = shareable(NeedsTwo("one", "two"))
    assert type(rebuilt) is RuntimeError and str(rebuilt) == "NeedsTwo: one and two"
    unpicklable = shareable(ValueError(threading.Lock()))
    assert type(unpicklable) is RuntimeError and str(unpicklable).startswith("ValueError: <unlocked _thread.lock")
