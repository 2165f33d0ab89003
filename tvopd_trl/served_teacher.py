# Copyright 2026 The tvopd-trl Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""A teacher served by vLLM (`teacher_model_server_url`): the sampled tokens' log-probabilities through TRL's client,
from one server or a pool of replicas."""

import math
import threading
import time
import warnings
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

import torch

from .checks import probe_server, server_unreachable, wait_for_server
from .tools import served_max_model_len


_BATCH_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
# Rows per request unless `chunk_rows` is set: it bounds the work that one request, and so its timeout, has to cover,
# whatever the size of the rollout
MAX_CHUNK_ROWS = 32
# Seconds past its deadline that start-up allows a replica for its last health check and for TRL's client, whose own
# requests have no timeout
_CONNECT_GRACE = 5.0


def served_teacher_logps(client, batch, temperature):
    """
    The teacher server's float32 `(B, T)` log-probabilities of the sampled completion tokens of `batch` (0 at padding),
    on the CPU.

    One prefill request (`client.get_sequence_logprobs`, a TRL `VLLMClient`) scores each unpadded prompt + completion;
    vLLM always returns the log-probability of the actual token beside the top-1, so `top_logprobs=1` suffices. TRL's
    client reports a value the server did not give, or gave as NaN, as -inf; that is a missing value, not the teacher
    ruling the token out, so it becomes NaN here: the loss and the TV estimate drop the token and `tv/nonfinite_tokens`
    counts it.
    """
    prompt_mask = batch["prompt_mask"].bool().cpu()
    completion_mask = batch["completion_mask"].bool().cpu()
    prompt_ids, completion_ids = batch["prompt_ids"].cpu(), batch["completion_ids"].cpu()
    sequences = [
        prompt[p_mask].tolist() + completion[c_mask].tolist()
        for prompt, p_mask, completion, c_mask in zip(
            prompt_ids, prompt_mask, completion_ids, completion_mask, strict=True
        )
    ]
    result = client.get_sequence_logprobs(
        sequences, prompt_mask.sum(dim=1).tolist(), top_logprobs=1, temperature=temperature
    )
    logps = torch.zeros(completion_ids.shape, dtype=torch.float32)
    for row, (values, length) in enumerate(zip(result["actual_logprobs"], completion_mask.sum(dim=1), strict=True)):
        if len(values) != length:
            raise RuntimeError(
                f"The teacher server returned {len(values)} log-probabilities for a completion of {int(length)} "
                "tokens; is it serving the same tokenizer as the student?"
            )
        logps[row, :length] = torch.tensor([value[0] for value in values], dtype=torch.float32)
    return torch.where(torch.isfinite(logps), logps, math.nan)


def _in_background(function, *args, **kwargs):
    """`function(*args, **kwargs)` on a daemon thread, as a future. A request that still hangs after the pool has given
    up (or after start-up has moved on) then holds neither its caller nor the interpreter's exit, as an executor's
    worker thread would until the request times out."""
    future = Future()

    def run():
        try:
            future.set_result(function(*args, **kwargs))
        except BaseException as error:
            future.set_exception(error)

    threading.Thread(target=run, daemon=True).start()
    return future


def _new_client(url):
    """TRL's client of the replica at `url`, which has just answered its health check."""
    import requests
    from trl.generation.vllm_client import VLLMClient

    try:
        # The health check with a deadline was ours; TRL's client checks once more and asks `/v1/models`, both
        # without a timeout, so the callers bound this call
        return VLLMClient(base_url=url, connection_timeout=0)
    except Exception as error:  # TRL raises a bare `Exception` when `/v1/models` answers with an error status
        raise requests.exceptions.ConnectionError(f"{url} is not ready: {error}") from error


def _connect(url, timeout, what):
    wait_for_server(url, timeout, what)
    return _new_client(url)


@dataclass(eq=False)
class _Replica:
    """One teacher server of a pool: its TRL client (`None` until it first answers) and its run of failures."""

    url: str
    client: Any = None
    failures: int = 0  # consecutive failed requests or probes
    down_until: float = 0.0  # `time.monotonic()` after which a replica set aside is probed again


class TeacherServerPool:
    """
    Replicas of one teacher's vLLM server, scoring a rollout together through TRL's `VLLMClient`, one per replica.

    [`~TeacherServerPool.score`] cuts the rollout's rows into chunks and sends them concurrently, at most
    `max_in_flight` requests per replica, each chunk to the least busy replica as a slot frees up, so that a slow
    replica ends up with a smaller share. A chunk whose request fails with a connection error, a timeout or a 5xx is
    retried after an exponential backoff, on another replica where there is one. A read timeout is no exception, even
    on the only replica: the chunk waits its backoff before it goes back (vLLM's `/v1/completions` aborts a request
    whose client hung up, so the copy does not queue behind the abandoned one), and a healthy server that needs longer
    per chunk needs a longer `request_timeout` or smaller chunks, not retries. A failed chunk keeps its slot through its
    backoff, so fresh chunks cannot push its retry behind theirs: from its first request, a chunk fails the step within
    [`~TeacherServerPool.give_up_seconds`]. A replica that failed `max_failures` times in a row is set aside for
    `cooldown` seconds and then probed on its health endpoint before it gets chunks again; while every replica is set
    aside, chunks go to them anyway, so that the retry budget still decides. A chunk that fails `retries + 1` times
    raises one `ConnectionError` naming every replica: the step never goes on with partial teacher values.

    Each sequence is a prompt of its own, so what it is scored on is its own tokens only; but vLLM's numerics can still
    differ in the last bits with the batch it is computed in (the chunking, the replica, other processes' requests),
    unless the servers run in vLLM's batch-invariant mode (`VLLM_BATCH_INVARIANT=1`). The difference measured against
    a real server is in docs/vllm.md.

    Build it with [`connect_teacher_pool`], which probes every replica first.

    Args:
        replicas (`list[_Replica]`):
            The replicas, those that did not answer at construction already set aside.
        what (`str`):
            What the pool serves, for messages (e.g. `"the teacher server 'teacher'"`).
        chunk_rows (`int`, *optional*):
            Rows per request. By default at most `MAX_CHUNK_ROWS` (32), and a pool cuts the rollout into at least 4
            chunks per replica, so that a slow replica's share can move.
        max_in_flight (`int`, *optional*, defaults to `2`):
            Requests in flight per replica, from this process.
        request_timeout (`float`, *optional*, defaults to `300.0`):
            Seconds a request may take before it counts as failed and is retried (TRL's client sets none).
        retries (`int`, *optional*, defaults to `4`):
            Retries per chunk before the step fails.
        backoff (`float`, *optional*, defaults to `1.0`):
            Seconds before a chunk's first retry, doubling with each further one.
        max_failures (`int`, *optional*, defaults to `2`):
            Consecutive failures that set a replica aside.
        cooldown (`float`, *optional*, defaults to `30.0`):
            Seconds a replica stays aside before it is probed again.

    After each `score` call, `last_stats` holds `request_seconds` (its wall time), `retries` (failed requests that were
    retried) and `replicas_down` (replicas set aside at its end), which the trainer logs as `teacher/...` metrics.
    """

    def __init__(
        self,
        replicas,
        what,
        chunk_rows=None,
        max_in_flight=2,
        request_timeout=300.0,
        retries=4,
        backoff=1.0,
        max_failures=2,
        cooldown=30.0,
    ):
        self.replicas, self.what = replicas, what
        self.chunk_rows, self.max_in_flight, self.request_timeout = chunk_rows, max_in_flight, request_timeout
        self.retries, self.backoff, self.max_failures, self.cooldown = retries, backoff, max_failures, cooldown
        self._given_up = Future()  # done once `score` fails: the requests it leaves in flight stop holding threads
        for replica in replicas:
            if replica.client is not None:
                self._attach(replica.client)
        self.last_stats = {}

    @property
    def urls(self):
        return [replica.url for replica in self.replicas]

    @property
    def give_up_seconds(self):
        """The longest a chunk takes from its first request to the `ConnectionError` when no replica answers it:
        `retries + 1` requests of up to `request_timeout` and the backoffs between them."""
        return (self.retries + 1) * self.request_timeout + self.backoff * (2**self.retries - 1)

    def max_model_len(self):
        """The teacher's context (the servers' smallest `--max-model-len`, as their `GET /v1/models` gives it) over the
        replicas that answer; `None` where none gives one."""
        import requests

        lengths = []
        for replica in self.replicas:
            try:
                lengths.append(served_max_model_len(self._probe(replica)))
            except requests.RequestException:  # a replica down now is the retries' business, not the context's
                continue
        return min(filter(None, lengths), default=None)

    def _attach(self, client):
        import requests
        from urllib3.util.retry import Retry

        pool, timeout = self, self.request_timeout

        class _PoolAdapter(requests.adapters.HTTPAdapter):
            def send(self, request, **kwargs):
                # TRL's client sets no timeout: a hung replica would hold its chunk forever
                sending = _in_background(super().send, request, **{**kwargs, "timeout": timeout})
                # The caller is a worker thread of TRL's client, which the interpreter joins at exit: once the pool
                # gives up, it returns at once and leaves the request to its daemon thread
                given_up = pool._given_up
                wait([sending, given_up], return_when=FIRST_COMPLETED)
                if given_up.done():
                    raise requests.exceptions.ConnectionError(f"{pool.what} gave up on this request")
                return sending.result()

        # No retries in the session (the pool retries, on another replica), and a 5xx raises `RetryError` instead of
        # reaching TRL's client, which would turn it into a bare `Exception` indistinguishable from a 4xx
        retry = Retry(total=0, status_forcelist=(500, 502, 503, 504), allowed_methods=None)
        adapter = _PoolAdapter(max_retries=retry, pool_maxsize=self.max_in_flight + 1)
        client.session.mount("http://", adapter)
        client.session.mount("https://", adapter)
        return client

    def _is_up(self, replica):
        return replica.client is not None and replica.failures < self.max_failures

    def _probe(self, replica):
        """The replica's client once its health check answers (built on the first answer); raises a `requests`
        exception otherwise, as a failed request does."""
        if replica.client is not None:
            replica.client.session.get(f"{replica.client.base_url}/health").raise_for_status()
            return replica.client
        probe_server(replica.url, self.request_timeout)
        return self._attach(_new_client(replica.url))

    def score(self, batch, temperature):
        """
        [`served_teacher_logps`] of `batch` over the pool: float32 `(B, T)` on the CPU, NaN where a server gave no
        value, 0 at padding. Raises a `ConnectionError` naming every replica when a chunk fails past the retry budget.
        """
        import requests

        start = time.perf_counter()
        rows = batch["completion_ids"].size(0)
        size = self.chunk_rows or min(
            MAX_CHUNK_ROWS, rows if len(self.replicas) == 1 else math.ceil(rows / (4 * len(self.replicas)))
        )
        chunks = [slice(first, first + size) for first in range(0, rows, max(size, 1))]
        logps = torch.empty(batch["completion_ids"].shape, dtype=torch.float32)
        pending, attempts = list(range(len(chunks))), [0] * len(chunks)
        # `avoid`: the replica where a pending chunk last failed, whose slot it holds until it is sent again
        not_before, avoid = [0.0] * len(chunks), [None] * len(chunks)
        running, in_flight, retried = {}, dict.fromkeys(self.replicas, 0), 0
        self._given_up = Future()
        try:
            while pending or any(chunk is not None for _, chunk in running.values()):
                now = time.monotonic()
                probing = {replica for replica, chunk in running.values() if chunk is None}
                for replica in self.replicas:
                    if not self._is_up(replica) and replica.down_until <= now and replica not in probing:
                        running[_in_background(self._probe, replica)] = (replica, None)
                for chunk in [chunk for chunk in pending if not_before[chunk] <= now]:
                    replica = self._pick(in_flight, avoid[chunk])
                    if replica is None:
                        continue
                    pending.remove(chunk)
                    if avoid[chunk] is not None:
                        in_flight[avoid[chunk]] -= 1
                    in_flight[replica] += 1
                    part = {key: batch[key][chunks[chunk]] for key in _BATCH_KEYS}
                    running[_in_background(served_teacher_logps, replica.client, part, temperature)] = (replica, chunk)
                events = [not_before[chunk] for chunk in pending] + [
                    replica.down_until for replica in self.replicas if not self._is_up(replica)
                ]
                later = [event - now for event in events if event > now]
                if running:
                    done, _ = wait(running, timeout=min(later, default=None), return_when=FIRST_COMPLETED)
                else:  # only backoffs to sit out: `wait` on no future returns at once, and the loop would spin
                    time.sleep(min(later))
                    done = ()
                for future in done:
                    replica, chunk = running.pop(future)
                    try:
                        result = future.result()
                    except requests.exceptions.RequestException as error:
                        self._failed(replica)
                        if chunk is None:
                            continue
                        attempts[chunk] += 1
                        if attempts[chunk] > self.retries:
                            raise ConnectionError(
                                f"{self.what[0].upper()}{self.what[1:]} failed to score rows {chunks[chunk].start}-"
                                f"{min(chunks[chunk].stop, rows) - 1} of the rollout {attempts[chunk]} times, across "
                                f"its replicas {', '.join(self.urls)}; the last "
                                f"error, from {replica.url}: {error}. The step stops here, before any update from "
                                "partial teacher values: bring the servers back (or fix the URLs) and resume from "
                                "the last checkpoint."
                            ) from error
                        retried += 1
                        not_before[chunk] = time.monotonic() + self.backoff * 2 ** (attempts[chunk] - 1)
                        # Its slot stays taken (`in_flight` unchanged) and it goes first once its backoff is over
                        avoid[chunk] = replica
                        pending.insert(0, chunk)
                        continue
                    replica.failures = 0
                    if chunk is None:
                        replica.client = result
                    else:
                        in_flight[replica] -= 1
                        logps[chunks[chunk]] = result
        except BaseException:
            # Requests still in flight are left to their daemon threads
            self._given_up.set_result(None)
            raise
        self.last_stats = {
            "request_seconds": time.perf_counter() - start,
            "retries": retried,
            "replicas_down": sum(not self._is_up(replica) for replica in self.replicas),
        }
        return logps

    def _pick(self, in_flight, avoid):
        """The replica for a chunk: the least busy up one, preferring one other than `avoid` (where the chunk just
        failed, and whose slot it holds); with none up, any that has a client. `None` while every candidate's slots
        are full."""
        up = [replica for replica in self.replicas if self._is_up(replica)]
        candidates = [
            replica
            for replica in (up or self.replicas)
            if replica.client is not None and in_flight[replica] - (replica is avoid) < self.max_in_flight
        ]
        return min(
            candidates,
            key=lambda replica: (replica is avoid, in_flight[replica], self.replicas.index(replica)),
            default=None,
        )

    def _failed(self, replica):
        replica.failures += 1
        if replica.failures >= self.max_failures:
            replica.down_until = time.monotonic() + self.cooldown


def connect_teacher_pool(urls, timeout, what, **kwargs):
    """
    A [`TeacherServerPool`] of the vLLM servers at `urls` (a URL or a list of replicas), each probed on its health check
    for up to `timeout` seconds, all at once, before any model loads. None answering is a `ConnectionError` that names
    every URL and the fix; some not answering (a refused connection, an error status such as a dead engine's 503, or
    no answer at all) is a warning that names them, and the pool starts with them set aside. `kwargs` go to the pool.
    """
    urls = [urls] if isinstance(urls, str) else list(urls)
    futures = [_in_background(_connect, url, timeout, what) for url in urls]
    wait(futures, timeout=timeout + _CONNECT_GRACE)
    replicas, errors = [], []
    for url, future in zip(urls, futures, strict=True):
        # Not done by then: hanging in one of the requests TRL's client makes without a timeout
        error = future.exception() if future.done() else server_unreachable(url, timeout, what)
        if error is not None and not isinstance(error, OSError):  # not about the server: a bug, raised as it is
            raise error
        replicas.append(_Replica(url, client=None if error else future.result()))
        if error is not None:
            errors.append(error)
    if len(errors) == len(urls):
        if len(urls) == 1:
            raise errors[0]
        raise ConnectionError(
            f"None of the {len(urls)} replicas of {what} answered within {timeout} s: {', '.join(urls)}. Start them "
            "first (`tvopd-trl vllm-serve --role teacher --model <model>` on each) or fix the URLs; `teacher_model_server_timeout` "
            "sets how long to wait."
        ) from errors[0]
    pool = TeacherServerPool(replicas, what, **kwargs)
    down = [replica for replica in replicas if replica.client is None]
    for replica in down:
        replica.failures, replica.down_until = pool.max_failures, time.monotonic() + pool.cooldown
    if down:
        warnings.warn(
            f"{what[0].upper()}{what[1:]}: {len(down)} of its {len(urls)} replicas did not answer within {timeout} s "
            f"({', '.join(replica.url for replica in down)}). Training starts on the others, which score their "
            f"share, and probes these again every {pool.cooldown:g} s.",
            stacklevel=2,
        )
    return pool
