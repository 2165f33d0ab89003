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
"""Asynchronous rollouts with bounded staleness (`max_staleness`): the vLLM server samples the next rollout batches
while the trainer scores and trains on this one.

The weight version is the number of optimizer steps applied to the weights the server holds. Rollout k is first updated
on at version k (one optimizer step per rollout batch), so it may be sampled with any version >= k - max_staleness: the
producer starts it as soon as that holds and the rollout before it has left the server. The trainer's weight sync after
each optimizer step and every request hold one lock, so that no request runs on half-updated weights.
"""

import collections
import contextlib
import copy
import functools
import inspect
import pickle
import socket
import threading
import time
from dataclasses import dataclass

from accelerate.utils import broadcast_object_list
from datasets import IterableDataset
from transformers.utils import logging


logger = logging.get_logger(__name__)

# Seconds between the warnings of a trainer that waits on the rollout server
WAIT_WARNING_INTERVAL = 60.0
# Seconds a producer closed on an error or a Ctrl-C gives its thread to end, once the request in flight was aborted
ABANDON_WAIT = 3.0


def check_async_setup(args, train_dataset):
    """Refuses, before any model loads, the settings asynchronous rollouts (`max_staleness > 0`) do not support."""
    if args.max_staleness == 0:
        return
    fix = "Set max_staleness=0 (synchronous rollouts), or"
    if not (args.use_vllm and args.vllm_mode == "server"):
        raise ValueError(
            f"max_staleness={args.max_staleness} overlaps generation on a vLLM server with training, so it needs "
            f"use_vllm=True and vllm_mode='server'. {fix} sample on a vLLM server (docs/vllm.md)."
        )
    if args.steps_per_generation > 1 or args.num_iterations > 1:
        raise ValueError(
            f"max_staleness={args.max_staleness} is supported with one optimizer step per rollout batch only, got "
            f"steps_per_generation={args.steps_per_generation} and num_iterations={args.num_iterations}. {fix} set "
            "both to 1."
        )
    if isinstance(train_dataset, IterableDataset):
        raise ValueError(
            f"max_staleness={args.max_staleness} needs to know the prompts of the next rollout batches, which it "
            f"draws from a map-style dataset with the trainer's sampler. {fix} load the dataset without streaming."
        )
    if not args.vllm_importance_sampling_correction:
        logger.warning(
            f"max_staleness={args.max_staleness} without vllm_importance_sampling_correction: tokens sampled with "
            "weights up to that many steps old enter the loss as if pi_old had sampled them, uncorrected (in the "
            "staleness study such runs collapsed faster, docs/replication.md part four). Set "
            "vllm_importance_sampling_correction=True unless this is an ablation."
        )


def timeout_is_final(retry, **changes):
    """`retry` (urllib3's `Retry`) with `changes`, except that a request whose answer timed out (or whose sending did)
    is not sent again. urllib3 counts a timeout a read error, as it counts a connection the server closed before
    answering, which a read retry still sends again."""
    retry_class = _timeout_is_final_class()
    settings = {name: getattr(retry, name) for name in inspect.signature(retry_class).parameters}
    return retry_class(**{**settings, **changes})


@functools.cache
def _timeout_is_final_class():
    # Built on first use: urllib3 comes with the vLLM client's `requests`, not with this package
    from urllib3.exceptions import ProtocolError, ReadTimeoutError
    from urllib3.util.retry import Retry

    class TimeoutIsFinal(Retry):
        def increment(self, method=None, url=None, response=None, error=None, _pool=None, _stacktrace=None):
            cause = error.args[-1] if isinstance(error, ProtocolError) and error.args else None
            if isinstance(error, ReadTimeoutError) or isinstance(cause, TimeoutError):
                raise error.with_traceback(_stacktrace)
            return super().increment(method, url, response, error, _pool, _stacktrace)

    return TimeoutIsFinal


def bound_request_time(client, timeout):
    """Gives every request of TRL's `VLLMClient` `client` (to the rollout server: a rollout's generation, the weight
    sync, the prefix-cache reset) at most `timeout` seconds, `vllm_server_request_timeout`, after which it raises a
    [`RolloutServerError`] naming the server and that setting. TRL's client sets none, so a server that stops
    answering would hang the run. A request that sets its own timeout keeps it, and its `requests.Timeout`.

    Of TRL's 5 retries of a failed read, one is kept, for a connection the server closed before answering (a
    keep-alive connection it had dropped, a restart): such a request is sent once more. A request that timed out is
    not sent again ([`timeout_is_final`]): it would generate the batch anew, each time for as long."""
    import requests

    adapter = client.session.get_adapter(client.base_url)
    adapter.max_retries = timeout_is_final(adapter.max_retries, read=1)
    send = client.session.request

    def request(method, url, **kwargs):
        if kwargs.get("timeout") is not None:
            return send(method, url, **kwargs)
        kwargs["timeout"] = timeout
        try:
            return send(method, url, **kwargs)
        except requests.Timeout as error:
            reason = f"did not answer {method} {url} within {timeout} s (vllm_server_request_timeout)"
            fix = (
                "Check that it runs and is not overloaded (or raise vllm_server_request_timeout if its answers take "
                "this long)"
            )
            raise RolloutServerError(
                f"The vLLM rollout server at {client.base_url} {reason}. {fix} and resume from the last checkpoint "
                "(`--resume_from_checkpoint last`).",
                reason=reason,
                fix=fix,
            ) from error

    client.session.request = request


def sample_on_server(generation, prompt_ids):
    """One completion per prompt of `prompt_ids` from the server of `generation` (TRL's `VLLMGeneration`), with the
    sampling parameters TRL's `VLLMGeneration.generate` sends. Unlike it, no collective runs, so that a background
    thread of the main process can call it: the prompts are the whole rollout batch, every process's. Returns
    `(completion_ids, logprobs)` as it does."""
    output = generation.vllm_client.generate(
        prompts=prompt_ids,
        n=1,
        repetition_penalty=generation.repetition_penalty,
        temperature=generation.temperature,
        top_p=generation.top_p,
        top_k=generation.top_k,
        min_p=0.0 if generation.min_p is None else generation.min_p,
        max_tokens=generation.max_completion_length,
        logprobs=generation.logprobs,
        structured_outputs_regex=generation.structured_outputs_regex,
        generation_kwargs=generation.generation_kwargs,
    )
    return output["completion_ids"], output["logprobs"]


def rollout_batches(dataset, sampler, rows_per_rollout, start=0):
    """The rows of each rollout batch, in the order `sampler` (the trainer's `RepeatSampler`, which repeats each
    batch's indices once per micro-step that uses it) draws them, epoch after epoch, from rollout `start` on."""
    index, indices = 0, []
    while True:
        for position in sampler:
            indices.append(position)
            if len(indices) < rows_per_rollout * sampler.repeat_count:
                continue
            if index >= start:
                yield [dataset[position] for position in indices[:rows_per_rollout]]
            index, indices = index + 1, []


@functools.cache
def _recording_pool(pool_class):
    """`pool_class` (a urllib3 connection pool class) recording, per thread, the connection it handed out."""

    class RecordingPool(pool_class):
        records_connections = True

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.in_use = {}  # thread id -> its connection; a thread's next request replaces a stale one

        def _get_conn(self, timeout=None):
            connection = super()._get_conn(timeout)
            self.in_use[threading.get_ident()] = connection
            return connection

        def _put_conn(self, connection):
            self.in_use.pop(threading.get_ident(), None)
            super()._put_conn(connection)

    return RecordingPool


def abortable_requests(session):
    """Returns `abort()`, which ends the requests in flight on `session` (a `requests.Session`) from another thread:
    it shuts their sockets down, and each fails at once with a `ConnectionError`. Closing the session would only close
    its idle connections, not the one a request waits on. The session stays usable: later requests connect anew."""
    managers = [adapter.poolmanager for adapter in session.adapters.values() if hasattr(adapter, "poolmanager")]
    for manager in managers:
        classes = manager.pool_classes_by_scheme
        if not all(getattr(pool_class, "records_connections", False) for pool_class in classes.values()):
            manager.pool_classes_by_scheme = {scheme: _recording_pool(cls) for scheme, cls in classes.items()}
            manager.clear()  # the pools opened so far record nothing

    def abort():
        for manager in managers:
            pools = [manager.pools.get(key) for key in manager.pools.keys()]
            manager.clear()
            for pool in filter(None, pools):
                pool.close()  # first: a retry of the aborted request finds its pool closed, and fails too
                for connection in list(getattr(pool, "in_use", {}).values()):
                    with contextlib.suppress(OSError, AttributeError):
                        connection.sock.shutdown(socket.SHUT_RDWR)

    return abort


def shareable(error):
    """`error`, or a `RuntimeError` with its text where it does not survive pickling: what a broadcast can carry."""
    try:
        pickle.dumps(error)
        return copy.deepcopy(error)  # rebuilt as unpickling would rebuild it, without unpickling anything
    except Exception:  # noqa: BLE001  (any exception can fail to pickle in its own way)
        return RuntimeError(f"{type(error).__name__}: {error}")


class RolloutServerError(RuntimeError):
    """The rollout server failed while it sampled ahead: the rollout batch is lost, and no update used any of it.

    `reason` and `fix`, where given (a request that timed out), say what the server did and what to do, so that a
    message that reports the failure in its own context ([`RolloutProducer`]'s) says them once."""

    def __init__(self, message, reason=None, fix=None):
        super().__init__(message)
        self.reason, self.fix = reason, fix


@dataclass
class Rollout:
    """One rollout batch: its rows, their prompt ids and, once sampled, the completions, the sampler's log-probability
    of each token and the weight version that sampled them."""

    index: int
    rows: list
    prompt_ids: list
    completion_ids: list | None = None
    logprobs: list | None = None
    version: int | None = None


@dataclass
class TakeStatistics:
    """What [`RolloutProducer.take`] measured: the rollout's staleness (optimizer steps between its sampling and its
    first update), the rollouts dropped as too stale before it, and the seconds the trainer waited for it."""

    staleness: int
    dropped: int
    wait_seconds: float


class RolloutProducer:
    """
    Samples submitted rollout batches in order on a daemon thread, each as soon as the staleness bound allows.

    Args:
        request (`Callable[[list[list[int]]], tuple[list, list]]`):
            Samples one completion per prompt: `(completion_ids, logprobs)` (see [`sample_on_server`]). Called with
            the producer's lock held, by the thread, or by the trainer to regenerate a dropped rollout.
        max_staleness (`int`):
            s >= 1: rollout k, first updated on at version k, is sampled with a version >= k - s.
        version (`int`):
            The weight version the server holds now (the trainer's `global_step`, after syncing).
        server (`str`):
            The server's URL, for error messages.
        abort (`Callable[[], None]`, *optional*):
            Ends the request in flight from another thread (see [`abortable_requests`]), when the producer is closed
            with `abandon=True`.
    """

    def __init__(self, request, max_staleness, version, server, abort=None):
        self.request = request
        self.max_staleness = max_staleness
        self.version = version
        self.server = server
        self.abort = abort
        # Held around each request and each weight sync: the server never samples with half-updated weights
        self.lock = threading.Lock()
        self._condition = threading.Condition()
        self._pending = collections.deque()  # submitted, not sampled yet
        self._ready = collections.deque()  # sampled, not taken yet
        self._error = None
        self._stopped = False
        self._sampler_wait = 0.0
        self._thread = threading.Thread(target=self._run, name="tvopd-rollout-producer", daemon=True)
        self._thread.start()

    def submit(self, rollout):
        """Queues `rollout` (its `index`: the version of its first update) for sampling, after those submitted."""
        with self._condition:
            self._pending.append(rollout)
            self._condition.notify_all()

    def _startable(self):
        return self._pending and self._pending[0].index - self.max_staleness <= self.version

    def _run(self):
        idle_since = time.monotonic()
        while True:
            with self._condition:
                while not self._stopped and not self._startable():
                    self._condition.wait()
                if self._stopped:
                    return
                rollout = self._pending.popleft()
            with self.lock:
                with self._condition:
                    if self._stopped:  # closed while this thread waited for the lock (a weight sync, a callback)
                        return
                    self._sampler_wait += time.monotonic() - idle_since
                rollout.version = self.version
                try:
                    rollout.completion_ids, rollout.logprobs = self.request(rollout.prompt_ids)
                except BaseException as error:  # noqa: BLE001  (handed to the trainer, which raises it)
                    # Recorded before the lock is released, so that the weight sync waiting for it sees the failure
                    # instead of sending the weights to a failed server
                    with self._condition:
                        self._error = error
                        self._condition.notify_all()
                    return
                idle_since = time.monotonic()
            with self._condition:
                self._ready.append(rollout)
                self._condition.notify_all()

    def _failure(self, error, doing="sampling a rollout batch ahead of training"):
        # A timed-out request's error (`bound_request_time`) gives what happened and its fix: said once, not nested
        reason, fix = getattr(error, "reason", None), getattr(error, "fix", None)
        happened = f"{reason} while {doing}" if reason else f"failed while {doing} ({type(error).__name__}: {error})"
        return RolloutServerError(
            f"The vLLM rollout server at {self.server} {happened}. No update used any batch it did not finish; the "
            f"checkpoints already written are untouched. {fix or 'Restart the server'} and resume from the last "
            "checkpoint (`--resume_from_checkpoint last`)."
        )

    def _wait(self, ready, what):
        """Calls `ready(timeout)` until it returns true, warning every `WAIT_WARNING_INTERVAL` seconds that the trainer
        is waiting for `what`. Returns the seconds waited."""
        start = time.monotonic()
        while not ready(WAIT_WARNING_INTERVAL):
            logger.warning(f"Waiting {time.monotonic() - start:.0f} s on the vLLM server at {self.server}: {what}.")
        return time.monotonic() - start

    def take(self, index):
        """The sampled rollout `index`, waiting for it. One sampled with weights more than `max_staleness` versions
        older than `index` (the trainer's version now) is dropped and sampled again at once, with the current
        weights. Raises [`RolloutServerError`] when the server failed."""
        start = time.monotonic()
        with self._condition:
            self._wait(
                lambda timeout: self._condition.wait_for(lambda: self._ready or self._error is not None, timeout),
                f"rollout batch {index}",
            )
            if not self._ready:  # a batch sampled before the failure is whole, and trains
                raise self._failure(self._error) from self._error
            rollout = self._ready.popleft()
        if rollout.index != index:
            raise RuntimeError(f"Rollout batch {rollout.index} came back where batch {index} was due.")
        dropped = 0
        if index - rollout.version > self.max_staleness:
            dropped = 1
            with self.holding_lock(f"the end of the request in flight, before sampling rollout batch {index} again"):
                rollout.version = self.version
                try:
                    rollout.completion_ids, rollout.logprobs = self.request(rollout.prompt_ids)
                except Exception as error:
                    raise self._failure(error) from error
        return rollout, TakeStatistics(index - rollout.version, dropped, time.monotonic() - start)

    @contextlib.contextmanager
    def holding_lock(self, what):
        """Holds the lock of requests and weight syncs, warning while the request in flight keeps it. Yields the seconds
        waited for it."""
        waited = self._wait(lambda timeout: self.lock.acquire(timeout=timeout), what)
        try:
            yield waited
        finally:
            self.lock.release()

    def update_weights(self, sync, agree=None):
        """Runs `sync` (the trainer's weight sync after an optimizer step) between two requests, and moves to the next
        version. Returns the seconds spent waiting for the request in flight.

        `agree(failure)` (by default: raise it unless it is `None`) is called with the server's failure found before
        the sync, then with the sync's own: with several processes, the trainer broadcasts it there, so that every
        process raises the same [`RolloutServerError`] rather than wait in its next collective."""
        agree = agree or raise_failure
        with self.holding_lock("the end of the request in flight, before the weight sync") as waited:
            agree(None if self._error is None else self._failure(self._error))
            failure = None
            try:
                sync()
            except Exception as error:
                failure = self._failure(error, "loading the weights of the last optimizer step")
            agree(failure)
            with self._condition:
                self.version += 1
                self._condition.notify_all()
        return waited

    def collect_sampler_wait(self):
        """Seconds the server sat idle for the producer (waiting for the staleness bound, a submission or a weight
        sync) since the last call. A request in flight is not counted until it ends."""
        with self._condition:
            waited, self._sampler_wait = self._sampler_wait, 0.0
        return waited

    def close(self, abandon=False):
        """Stops the thread, once the request in flight (if any) has ended: no request outlives the producer, and no
        later weight sync lands in the middle of one. The request timeout bounds the wait.

        With `abandon=True` (training leaves on an error or a Ctrl-C), the request in flight samples a batch no step
        will use: it is aborted, not waited for. A thread that outlives `ABANDON_WAIT` seconds, where `abort` could not
        reach its request, only finishes that request: it sends no other and touches nothing of the trainer's."""
        with self._condition:
            self._stopped = True
            self._condition.notify_all()
        if not abandon:
            self._wait(self._ended, "the end of the request in flight, before the producer stops")
            return
        if self.abort is not None:
            self.abort()
        if not self._ended(ABANDON_WAIT):
            logger.warning(
                f"The request in flight to the vLLM server at {self.server} did not end when training stopped; it is "
                "left to finish on its own, and its batch is discarded."
            )

    def _ended(self, timeout):
        self._thread.join(timeout)
        return not self._thread.is_alive()


def raise_failure(failure):
    if failure is not None:
        raise failure


class AsyncRolloutMixin:
    """
    How a [`TVOPDTrainer`] samples ahead with `max_staleness > 0` (see the module's docstring).

    The rollout batches come from the trainer's own sampler, iterated here ([`rollout_batches`]): from a fresh start
    they are the batches its dataloader yields, which then only paces the loop; a resumed run picks up at the batch of
    its `global_step`. The main process tokenizes the batches `max_staleness` ahead and a [`RolloutProducer`] samples
    them on the server, every process's rows in one request; at each rollout batch's first step the main process takes
    it and hands each process its share. The weight sync moves from before each rollout to right after each optimizer
    step, under the producer's lock.
    """

    # Set inside `train()` only: the batches in order (every process), the producer (main process), the batch taken
    # for this step, and the trainer's seconds of waiting in this step
    _rollout_stream = None
    _rollouts = None
    _taken_rollout = None
    _trainer_wait = 0.0

    def train(self, *args, **kwargs):
        finished = False
        try:
            output = super().train(*args, **kwargs)
            finished = True
            return output
        finally:
            if self._rollouts is not None:
                # A run that ends waits for the request in flight; one that leaves on an error or a Ctrl-C aborts it,
                # rather than wait up to `vllm_server_request_timeout` for a batch no step will use
                self._rollouts.close(abandon=not finished)
            self._rollout_stream = self._rollouts = self._taken_rollout = None

    def _rollout_lock(self):
        """Held around a request outside the rollouts (an evaluation, a callback's sampling), between two of theirs."""
        if self._rollouts is None:
            return contextlib.nullcontext()
        return self._rollouts.holding_lock("the end of the request in flight, before a request outside the rollouts")

    def _start_rollouts(self):
        # Fresh or resumed, the server gets the weights of this step before it samples anything: a rollout in flight is
        # never part of a checkpoint, and a resumed run samples again with the restored weights.
        version = self.state.global_step  # one optimizer step per rollout batch: the index of this step's batch
        self.vllm_generation.sync_weights()  # on every process: under ZeRO-3 and FSDP the gathers are collectives
        self._last_loaded_step = version
        self._rollout_stream = rollout_batches(
            self.train_dataset, self._get_train_sampler(), self._global_rollout_size, start=version
        )
        if self.accelerator.is_main_process:
            client = self.vllm_generation.vllm_client
            self._rollouts = RolloutProducer(
                functools.partial(sample_on_server, self.vllm_generation),
                self.args.max_staleness,
                version,
                server=client.base_url,
                abort=abortable_requests(client.session) if hasattr(client, "session") else None,
            )
            for index in range(version, version + self.args.max_staleness + 1):
                self._submit_rollout(index)

    def _submit_rollout(self, index):
        if index >= self.state.max_steps:
            return  # no step would train on it
        rows = next(self._rollout_stream)
        # Tokenized here, in the main thread: a fast tokenizer must not be used by two threads at once
        prompt_ids = super()._tokenize_prompts(copy.deepcopy([row["prompt"] for row in rows]))[0]
        self._rollouts.submit(Rollout(index, rows, self._truncate_prompts(prompt_ids)[0]))

    def _take_rollout(self):
        """This process's rows of the rollout batch of this step, its completions kept for `_taken_completions`."""
        index = self.state.global_step
        payload = error = None
        try:
            if self._rollout_stream is None:
                self._start_rollouts()
            if self._rollouts is not None:
                rollout, statistics = self._rollouts.take(index)
                self._submit_rollout(index + self.args.max_staleness + 1)
                payload = (rollout.prompt_ids, rollout.completion_ids, rollout.logprobs, statistics)
                rows = rollout.rows
        except Exception as raised:
            # A server failure, a prompt that tokenizes to nothing, a batch out of order: the main process's error is
            # sent to every process, which raises it rather than wait for a batch that will not come
            error, payload = raised, shareable(raised)
        payload = self._from_main_process(payload)
        if error is not None:
            raise error
        if isinstance(payload, Exception):
            raise payload
        if self._rollouts is None:
            rows = next(self._rollout_stream)
        prompt_ids, completion_ids, logprobs, statistics = payload
        # The processes' shares in order, as TRL's `VLLMGeneration` slices a server's answer
        size = len(rows) // self.accelerator.num_processes
        share = slice(self.accelerator.process_index * size, (self.accelerator.process_index + 1) * size)
        self._taken_rollout = (prompt_ids[share], completion_ids[share], logprobs[share])
        metrics = self._metrics["train"]
        metrics["async/staleness/mean"].append(float(statistics.staleness))
        metrics["async/staleness/max"].append(float(statistics.staleness))
        metrics["async/dropped"].append(float(statistics.dropped))
        self._trainer_wait = statistics.wait_seconds
        return rows[share]

    def _taken_completions(self, prompt_ids):
        """`(completion_ids, logprobs)` of the batch `_take_rollout` took, for its rows' `prompt_ids`."""
        taken_prompt_ids, completion_ids, logprobs = self._taken_rollout
        self._taken_rollout = None
        if [list(ids) for ids in prompt_ids] != [list(ids) for ids in taken_prompt_ids]:
            raise RuntimeError(
                "The prompts of the rollout batch sampled ahead differ from those being trained on: the chat template "
                "or the tokenizer changed between the two tokenizations."
            )
        return completion_ids, logprobs

    def _from_main_process(self, payload):
        return broadcast_object_list([payload])[0] if self.accelerator.num_processes > 1 else payload

    def _agree_on_failure(self, failure):
        """Raises the main process's `failure` (a [`RolloutServerError`], or `None`) on every process."""
        raise_failure(self._from_main_process(failure))

    def _sync_rollout_weights(self):
        """Right after an optimizer step: the server gets the new weights between two requests. A server failure that
        the main process finds here, as it usually finds one, stops every process with the same error."""
        if self._rollouts is None:  # another process: its share of the main process's collectives
            self._agree_on_failure(None)
            self.vllm_generation.sync_weights()
            self._agree_on_failure(None)
            waited = 0.0
        else:
            waited = self._rollouts.update_weights(self.vllm_generation.sync_weights, self._agree_on_failure)
        self._last_loaded_step = self.state.global_step + 1  # the step is counted once this hook has run
        metrics = self._metrics["train"]
        metrics["async/wait_seconds/trainer"].append(self._trainer_wait + waited)
        sampler_wait = self._rollouts.collect_sampler_wait() if self._rollouts is not None else 0.0
        metrics["async/wait_seconds/sampler"].append(sampler_wait)

    def log(self, logs, start_time=None):
        # TRL averages every metric over the logging window; these two are its maximum and its total.
        metrics = self._metrics["train"]
        if metrics.get("async/staleness/max"):
            metrics["async/staleness/max"] = [max(metrics["async/staleness/max"])]
        if metrics.get("async/dropped"):
            metrics["async/dropped"] = [sum(metrics["async/dropped"])]
        return super().log(logs, start_time)
