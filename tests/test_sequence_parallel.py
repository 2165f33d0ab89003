"""Ulysses sequence parallelism (SP), real `accelerate launch` runs on CPU over gloo (DeepSpeed, as in
tests/test_distributed.py), against runs without it on the same rollouts: 2 processes with SP = 2 (one data-parallel
replica) against 1 process (tests/distributed_scripts/sequence_parallel.py) at each ZeRO stage, for the modes whose
advantage reads whole rows, a task reward, a teacher of another tokenizer whose spans cross the shard boundary, a tool
result that crosses it, two teachers routed by row, a teacher with 3 attention heads (which Ulysses could not split in
2: it scores whole rows), gradient checkpointing, a teacher that scores after each row's own `teacher_prompt`, and the
student as its own live teacher after the hinted prompts (`self_distillation`). Compared: every per-token tensor the loss reads and the loss, the
first step's gradient of every parameter (1e-5 relative), every logged value over 3 optimizer steps, evaluation. Then
what Ulysses cannot run, refused. Whole jobs under SP: tests/test_sequence_parallel_jobs.py.
"""

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tvopd_trl.sequence_parallel import ShardedRows, shard_rows

from .test_distributed import (
    ACCELERATE_CONFIGS,
    REPO,
    SCRIPTS,
    _launch_env,
    launch,
)


SCRIPT = SCRIPTS / "sequence_parallel.py"
SP_CONFIG = ACCELERATE_CONFIGS / "zero3_sp_cpu.yaml"
# Logged per step and reduced over processes (the loss as the Trainer averages it); times are not compared
NOT_COMPARED = ("step_time", "epoch", "teacher/request_seconds")


def _launch(output_dir, config, launch_args, script_args, processes, timeout=300):
    """Each rank's results of tests/distributed_scripts/sequence_parallel.py under `config`, its tensors merged in."""
    runs = launch(
        config, SCRIPT.name, output_dir, *script_args, timeout=timeout, launch_args=launch_args, processes=processes
    )
    return [{**run, **run.pop("tensors")} for run in runs]


def _result(output_dir, rank):
    result = json.loads((output_dir / f"rank-{rank}.json").read_text())
    return {**result, **torch.load(output_dir / f"rank-{rank}.pt")}


def _single_process(output_dir, script_args):
    _run_script([str(output_dir), *script_args])
    return _result(output_dir, 0)


def _run_script(args, timeout=300):
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=_launch_env(),
        cwd=SCRIPTS,
        timeout=timeout,
    )
    assert completed.returncode == 0, completed.stderr[-6000:]


def relative_error(value, reference):
    value, reference = value.double(), reference.double()
    finite = torch.isfinite(reference)
    assert torch.equal(finite, torch.isfinite(value))
    if not finite.any():
        return 0.0
    return ((value - reference)[finite].abs().max() / reference[finite].abs().max().clamp(min=1e-30)).item()


def assert_same_run(run, reference):
    """`run` (one process's results) against the run without SP over the same rows."""
    assert len(run["calls"]) == len(reference["calls"]) == 3
    # The first call runs on the same parameters; later ones on parameters that the earlier steps' rounding moved apart
    for index, (call, expected) in enumerate(zip(run["calls"], reference["calls"], strict=True)):
        tolerance = 1e-5 if index == 0 else 1e-4
        assert call.keys() == expected.keys()
        real = expected["completion_mask"].bool()  # what a padding position holds is no one's value
        for key, value in expected.items():
            if value.shape == real.shape and key != "completion_mask":
                value, call[key] = value[real], call[key][real]
            if value.is_floating_point():
                # The entropy, logsumexp(z) - sum p z, is a difference of O(10)-nat terms: exact to float32's ~1e-6
                # nats, which is far above 1e-4 relative for the hint student that one step makes near-deterministic
                absolute = 1e-5 if key == "entropy" else 0.0
                difference = (call[key].double() - value.double()).abs().max().item()
                assert relative_error(call[key], value) <= tolerance or difference <= absolute, (index, key)
            else:
                assert torch.equal(call[key], value), key
    # SGD without clipping: the first step's parameter change is -lr times its gradient. Both runs start from the same
    # parameters, and each rounds its updated parameter to float32 once: up to one ULP (<= eps |p|) of the parameter
    # separates the two changes even where the gradients agree exactly, which for a norm's weight near 1 with changes of
    # 3e-3 is 4e-5 of the change. That ULP is the measurement's, not the gradient's.
    before, after = run["parameters"][:2]
    reference_before, reference_after = reference["parameters"][:2]
    eps = torch.finfo(torch.float32).eps
    for name, value in reference_before.items():
        assert torch.equal(before[name], value), name
        gradient, expected = (after[name] - before[name]).double(), (reference_after[name] - value).double()
        rounding = eps * torch.maximum(after[name].abs(), reference_after[name].abs()).double()
        excess = ((gradient - expected).abs() - rounding).clamp(min=0).max()
        assert excess <= 1e-5 * expected.abs().max().clamp(min=1e-30), name
    assert len(run["log"]) == len(reference["log"]) == 3
    for step, expected in zip(run["log"], reference["log"], strict=True):
        # DeepSpeed's engine at ZeRO-0 computes no gradient norm when it does not clip
        assert set(expected) - set(step) <= ({"grad_norm"} if run["zero_stage"] == 0 else set())
        for key, value in expected.items():
            if key not in step:
                continue
            if key not in NOT_COMPARED and isinstance(value, float) and math.isfinite(value):
                assert step[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step["step"], key)


def crosses_the_boundary(call, region):
    """Whether, in some row of a loss call's micro-batch, the tokens of `region` (`(B, T)` ints: tokens of one run share
    a value >= 0) are predicted on both sides of the SP = 2 shard boundary."""
    prompt_lengths = call["prompt_mask"].sum(dim=1)
    lengths = prompt_lengths + call["completion_mask"].sum(dim=1)
    boundary = math.ceil(lengths.max().item() / 2)
    predictors = prompt_lengths.unsqueeze(1) + torch.arange(region.size(1)) - 1
    for row in range(region.size(0)):
        for run_id in region[row][region[row] >= 0].unique():
            sides = (predictors[row][region[row] == run_id] >= boundary).unique()
            if len(sides) == 2:
                return True
    return False


VARIANTS = {
    # name: (advantage mode, options, ZeRO stage)
    "tv": ("tv", [], 3),
    "raw-zero2": ("raw", [], 2),
    "tv-zero1": ("tv", [], 1),
    "tv-zero0": ("tv", [], 0),
    "sign_mass_raw_alloc": ("sign_mass_raw_alloc", [], 3),
    "sequence_constant": ("sequence_constant", [], 3),
    "shuffle": ("shuffle", [], 3),
    "vopd": ("vopd", [], 3),
    "reward": ("tv", ["reward=1"], 3),
    "cross-tokenizer": ("tv", ["teacher=cross"], 3),
    "tools": ("tv", ["tools=1"], 3),
    "two-teachers": ("tv", ["teacher=two"], 3),
    "teacher-prompts": ("tv", ["teacher=hinted"], 3),
    "self-distillation": ("tv", ["teacher=self"], 3),
    # Rows after the student's own prompt beside hinted ones, and no hint at all: pi_old's scores, whatever the shards
    "self-distillation-half-hinted": ("tv", ["teacher=self", "hints=half"], 3),
    "self-distillation-unhinted": ("tv", ["teacher=self", "hints=none"], 3),
    "three-head-teacher": ("tv", ["teacher=three-heads"], 3),
    "gradient-checkpointing": ("tv", ["checkpointing=1"], 2),
}


def _script_args(name):
    mode, options, _ = VARIANTS[name]
    # The evaluation test reads one variant's evaluation
    return [mode, *options, "evaluate=1"] if name == "tv" else [mode, *options]


@pytest.fixture(scope="module")
def references(request, tmp_path_factory):
    """The run without SP of every variant this session selected, one after another in one process: a process each
    spent most of its time importing."""
    names = {
        item.callspec.params.get("sequence_parallel_run")
        for item in request.session.items
        if hasattr(item, "callspec")
    }
    names = sorted(names - {None})
    folder = tmp_path_factory.mktemp("references")
    runs = [[str(folder / name), *_script_args(name)] for name in names]
    (folder / "runs.json").write_text(json.dumps(runs))
    _run_script(["--references", str(folder / "runs.json")], timeout=300 + 60 * len(runs))
    return {name: _result(folder / name, 0) for name in names}


# The compatibility legs (`-m "not long and not compat_skip"`) run one variant, at ZeRO-3: the others exercise this library's code
@pytest.fixture(
    scope="module",
    params=[
        pytest.param(
            name, marks=[] if name == "tv" else pytest.mark.compat_skip if name == "raw-zero2" else pytest.mark.long
        )
        for name in VARIANTS
    ],
)
def sequence_parallel_run(request, references, tmp_path_factory):
    zero = VARIANTS[request.param][2]
    folder = tmp_path_factory.mktemp(request.param)
    runs = _launch(folder / "sp", SP_CONFIG, ["--zero_stage", str(zero)], _script_args(request.param), processes=2)
    return request.param, zero, runs, references[request.param]


def test_two_processes_with_sp_equal_one_process_on_the_same_rollouts(sequence_parallel_run):
    name, zero, runs, reference = sequence_parallel_run
    for run in runs:
        assert (run["sp_size"], run["zero_stage"]) == (2, zero)
        assert_same_run(run, reference)
    if name == "cross-tokenizer":
        assert any(crosses_the_boundary(call, call["span_ids"]) for call in reference["calls"])
    if name == "tools":  # the tool result: tokens out of `tool_mask`, all of a row's one run
        assert any(crosses_the_boundary(call, -call["tool_mask"]) for call in reference["calls"])
    if name.startswith("self-distillation-"):
        # The rows after the student's own prompt carry pi_old as the teacher's score: delta 0 exactly, advantage 0
        for run in [*runs, reference]:
            unhinted = [call["self_scored"].bool() for call in run["calls"]]
            assert all(rows.any() for rows in unhinted) and all(
                rows.all() == name.endswith("unhinted") for rows in unhinted
            )
    if name == "self-distillation-unhinted":
        # Nothing to learn: loss 0 and no update on every process, with SP and without
        for run in [*runs, reference]:
            assert [step["loss"] for step in run["log"]] == [0.0] * 3
            for after in run["parameters"][1:]:
                assert all(torch.equal(after[key], value) for key, value in run["parameters"][0].items())


def test_evaluation_under_sp_runs_whole_rows_and_a_sharded_forward_in_eval_mode_is_refused(sequence_parallel_run):
    # Ulysses is off in eval mode (accelerate registers it with `disable_in_eval`): a sharded forward there attends to
    # its own shard only and is silently wrong, and DeepSpeed's wrapper drops the attention mask even then
    name, _, runs, reference = sequence_parallel_run
    if name != "tv":
        pytest.skip("one variant is enough")
    for run in runs:
        for key, value in reference["evaluation"].items():
            if key.startswith(("eval_tv/", "eval_kl/", "eval_entropy", "eval_clip_ratio")):
                assert run["evaluation"][key] == pytest.approx(value, rel=1e-5), key
        assert run["eval_mode_refusal"] == (
            "A sequence-parallel forward needs the model in train mode (Ulysses is off in eval)."
        )
    assert reference["eval_mode_refusal"] is None


def zero3_sp_config(folder, **zero_optimization):
    """zero3_sp_cpu.yaml with a DeepSpeed config file of `zero_optimization` (over stage 3) instead of its ZeRO flags."""
    import yaml

    config = yaml.safe_load(SP_CONFIG.read_text())
    deepspeed = folder / "deepspeed.json"
    deepspeed.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 3, **zero_optimization},
                "train_micro_batch_size_per_gpu": "auto",
                "train_batch_size": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
            }
        )
    )
    config["deepspeed_config"] = {"deepspeed_config_file": str(deepspeed), "zero3_init_flag": True}
    config.pop("mixed_precision")
    path = folder / "accelerate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.long
def test_zero3_without_reduce_scatter_under_sp_updates_as_one_process(tmp_path):
    # ZeRO-3 of DeepSpeed < 0.20.2 averages an SP group's gradients over the world without reduce-scatter too: the
    # step was exactly half the reference's before the loss scaled it
    reference = _single_process(tmp_path / "reference", ["tv"])
    config = zero3_sp_config(tmp_path, reduce_scatter=False, contiguous_gradients=False)
    for run in _launch(tmp_path / "sp", config, [], ["tv"], processes=2):
        assert run["sp_size"] == 2 and run["zero_stage"] == 3
        assert_same_run(run, reference)


@pytest.mark.parametrize("deepspeed_version, scale", [("0.19.8", 2), ("0.20.1", 2), ("0.20.2", 1), ("0.21.0", 1)])
@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_the_sp_gradient_scale_follows_deepspeed_s_version_at_zero3(monkeypatch, deepspeed_version, scale, zero_stage):
    from types import SimpleNamespace

    import tvopd_trl.sequence_parallel as sequence_parallel

    versions = {"deepspeed": deepspeed_version}
    monkeypatch.setattr(sequence_parallel.importlib.metadata, "version", versions.__getitem__)
    plugin = SimpleNamespace(zero_stage=zero_stage)
    trainer = SimpleNamespace(
        _sp_size=2,
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)),
    )
    # transformers' own Ulysses loss gates its rescale alike (`deepspeed_sp_compute_loss`)
    assert sequence_parallel.SequenceParallelMixin._gradient_scale(trainer) == (scale if zero_stage == 3 else 1)
    trainer.model.training = False
    assert sequence_parallel.SequenceParallelMixin._gradient_scale(trainer) == 1


@pytest.mark.parametrize("deepspeed_version, refused", [("0.19.8", True), ("0.20.2", False)])
@pytest.mark.parametrize("contiguous_gradients", [True, False])
def test_zero3_without_reduce_scatter_and_contiguous_gradients_is_refused_where_deepspeed_averages(
    monkeypatch, tmp_path, deepspeed_version, refused, contiguous_gradients
):
    from tvopd_trl.sequence_parallel import check_sequence_parallel, importlib

    monkeypatch.setattr(importlib.metadata, "version", {"deepspeed": deepspeed_version}.__getitem__)
    trainer = _trainer_stand_in(tmp_path)
    zero = {"stage": 3, "reduce_scatter": False, "contiguous_gradients": contiguous_gradients}
    trainer.accelerator.state = SimpleNamespace(
        deepspeed_plugin=SimpleNamespace(zero_stage=3, deepspeed_config={"zero_optimization": zero})
    )
    if refused and contiguous_gradients:
        with pytest.raises(
            ValueError, match=r"set reduce_scatter: true.*contiguous_gradients: false.*deepspeed>=0\.20\.2"
        ):
            check_sequence_parallel(trainer, _student())
    else:
        check_sequence_parallel(trainer, _student())


def test_shard_rows_moves_padding_after_the_real_tokens_and_shifts_labels_on_the_whole_row():
    # Two rows: prompt [5, 6] (left-padded by one) and [7, 8, 9]; completions [1, 2] and [3] (right-padded)
    input_ids = torch.tensor([[0, 5, 6, 1, 2], [7, 8, 9, 3, 0]])
    attention_mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    shards = [shard_rows(input_ids, attention_mask, 2, size=2, rank=rank) for rank in range(2)]
    assert all(isinstance(shard, ShardedRows) for shard in shards)
    assert torch.equal(torch.cat([s.input_ids for s in shards], dim=1), torch.tensor([[5, 6, 1, 2], [7, 8, 9, 3]]))
    assert torch.equal(torch.cat([s.position_ids for s in shards], dim=1), torch.arange(4).expand(2, -1))
    labels = torch.cat([s.shift_labels for s in shards], dim=1)
    assert torch.equal(labels, torch.tensor([[-100, 1, 2, -100], [-100, -100, 3, -100]]))
    assert torch.equal(shards[0].predictors, torch.tensor([[1, 2], [2, 0]]))
    assert torch.equal(shards[0].scored, torch.tensor([[True, True], [True, False]]))


def _trainer_stand_in(tmp_path, processes=2, deepspeed=True, parallelism=None, **overrides):
    from accelerate.parallelism_config import ParallelismConfig

    from tvopd_trl.testing import tiny_config

    args = tiny_config(tmp_path, **overrides)
    config = ParallelismConfig(**(parallelism or {"sp_size": 2, "sp_backend": "deepspeed"}))
    plugin = SimpleNamespace(zero_stage=3, deepspeed_config={"zero_optimization": {"stage": 3}})
    accelerator = SimpleNamespace(
        parallelism_config=config, num_processes=processes, state=SimpleNamespace(deepspeed_plugin=plugin)
    )
    return SimpleNamespace(args=args, accelerator=accelerator, is_deepspeed_enabled=deepspeed)


def _student(heads=4, kv_heads=2, attention="sdpa"):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=64,
    )
    config._attn_implementation = attention
    return Qwen2ForCausalLM(config)


@pytest.mark.parametrize(
    "setup, message",
    [
        (
            dict(deepspeed=False),
            r"sp_size=2 runs DeepSpeed's Ulysses attention.*FSDP2.*Launch with a DeepSpeed config",
        ),
        (dict(processes=3), r"sp_size=2 does not divide the 3 processes: launch a multiple of 2\."),
        (dict(student=dict(heads=3, kv_heads=3)), r"must divide the student's 3 attention heads.*Use an sp_size"),
        (dict(student=dict(heads=4, kv_heads=3)), r"3 KV heads"),
        (dict(student=dict(attention="eager")), r"attn_implementation='eager'.*load it with one of sdpa"),
        (dict(padding_free=True), r"padding_free=True.*Set padding_free=False with sp_size > 1\."),
        (dict(max_tokens_per_micro_batch=64), r"max_tokens_per_micro_batch.*unset it with sp_size > 1\."),
        (dict(per_device_train_batch_size=3), r"= 3 rows.*make it a multiple of sp_size=2\."),
        (dict(parallelism={"cp_size": 2}), r"cp_size=2: torch context parallelism needs CUDA.*sp_size"),
    ],
)
def test_what_ulysses_cannot_run_is_refused_with_the_fix(tmp_path, setup, message):
    from tvopd_trl.sequence_parallel import check_sequence_parallel

    setup = dict(setup)
    student = _student(**setup.pop("student", {}))
    with pytest.raises(ValueError, match=message):
        check_sequence_parallel(_trainer_stand_in(tmp_path, **setup), student)


def test_kv_heads_fewer_than_sp_size_are_accepted_and_the_attention_is_filled_from_the_student(tmp_path):
    from tvopd_trl.sequence_parallel import check_sequence_parallel

    trainer = _trainer_stand_in(tmp_path)
    check_sequence_parallel(trainer, _student(heads=4, kv_heads=1))  # DeepSpeed replicates a KV head over processes
    assert trainer.accelerator.parallelism_config.sp_handler.sp_attn_implementation == "sdpa"


def test_the_config_accepts_sequence_parallelism_that_trls_refuses(tmp_path):
    from accelerate.parallelism_config import ParallelismConfig
    from trl import DistillationConfig

    parallelism = ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    with pytest.raises(ValueError, match="does not support sequence-dim parallelism"):
        DistillationConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, parallelism_config=parallelism)
    from tvopd_trl.testing import tiny_config

    assert tiny_config(tmp_path, parallelism_config=parallelism).parallelism_config is parallelism


@pytest.mark.parametrize("config, refused", [("zero3_cpu", True), ("zero3_sp_cpu", False)])
def test_train_refuses_sp_flags_that_accelerate_would_drop(monkeypatch, capsys, tmp_path, config, refused):
    # accelerate applies --parallelism_config_* over a config file's `parallelism_config` section only
    import accelerate.commands.launch

    from tvopd_trl import cli

    launched = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", launched.append)
    recipe = str(REPO / "recipes" / "tiny" / "tvopd.yaml")
    argv = ["train", "--config", recipe, "--accelerate_config", config, "--parallelism_config_sp_size", "2"]
    code = cli.main([*argv, "--output_dir", str(tmp_path)])
    if refused:
        assert code == 2 and not launched
        error = capsys.readouterr().err
        assert "--parallelism_config_sp_size is applied by accelerate only over a config file's" in error
        assert "recipes/accelerate_configs/zero3_sp.yaml" in error
    else:
        assert code == 0 and launched[0].parallelism_config_sp_size == 2


@pytest.mark.parametrize(
    "flags, refused",
    [
        (["--num_processes", "4"], "(dp_shard 1, sp 2: 2 processes) does not match the 4 processes launched"),
        (["--num_processes", "4", "--parallelism_config_dp_shard_size", "2"], None),
        (["--parallelism_config_dp_shard_size", "2"], "(dp_shard 2, sp 2: 4 processes) does not match the 2"),
    ],
)
def test_train_checks_the_parallelism_layout_against_the_processes_before_launching(
    monkeypatch, capsys, tmp_path, flags, refused
):
    """accelerate would find out only once the processes run, after the models load (zero3_sp_cpu: 2 processes,
    sp 2)."""
    import accelerate.commands.launch

    from tvopd_trl import cli

    launched = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", launched.append)
    recipe = str(REPO / "recipes" / "tiny" / "tvopd.yaml")
    argv = ["train", "--config", recipe, "--accelerate_config", "zero3_sp_cpu", *flags, "--output_dir", str(tmp_path)]
    code = cli.main(argv)
    if refused:
        assert code == 2 and not launched
        error = capsys.readouterr().err
        assert refused in error and "--parallelism_config_dp_shard_size" in error
    else:
        assert code == 0 and len(launched) == 1
