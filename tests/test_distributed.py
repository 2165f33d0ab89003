"""Real multi-process runs on CPU: 2-process DDP and 2-process DeepSpeed ZeRO-3 (with and without LoRA), each started
with `accelerate launch --config_file recipes/accelerate_configs/<config>` on a script of tests/distributed_scripts.

Each launch runs once per module and several tests read its per-rank results. Every launched script asserts its world
size and distributed type itself (`common.check_launch`), so a launch that silently fell back to independent single
processes fails. The first ZeRO-3 launch on a machine compiles DeepSpeed's shared-memory op into torch's extension
cache (`TORCH_EXTENSIONS_DIR`, by default ~/.cache/torch_extensions): a minute or two on 2 cores, once.
"""

import contextlib
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from accelerate.state import AcceleratorState
from transformers import AutoModelForCausalLM, AutoTokenizer

from tvopd_trl import TVOPDTrainer, tiny
from tvopd_trl.testing import tiny_config

from .timeouts import slow_machine_note, time_limit


REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "distributed_scripts"
ACCELERATE_CONFIGS = REPO / "recipes" / "accelerate_configs"
NUM_PROCESSES = 2
# What gloo sometimes prints when it aborts in its destructors after a script has finished (see `common.finish`).
GLOO_EXIT_ABORT = "terminate called without an active exception"
# Logged values reduced over processes: every rank must log the same ones.
POOLED = ("loss", "tv/estimate", "tv/scale", "tv/ema", "tv/reference", "kl/reverse_estimate", "update/norm")
# Set per rank by the launcher: inherited from the test process, they would confuse it.
_DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# ----------------------------------------------------------------------------------------------------------------------
# Launch helpers
# ----------------------------------------------------------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_env():
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _DISTRIBUTED_ENV and not key.startswith("ACCELERATE_")
    }
    # One thread per process: the two ranks share the CPU cores. DeepSpeed finds no GPU and needs to be told to use
    # its CPU accelerator (gloo, no oneCCL); DDP ignores it.
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    return env


def start_launch(launch_args, cwd=None):
    """`accelerate launch` with `launch_args`, in a session of its own (`wait_launch` ends it and the ranks it
    started)."""
    return subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", *launch_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_launch_env(),
        cwd=cwd,
        start_new_session=True,
    )


def wait_launch(process, what, timeout=300):
    """`(stdout, stderr)` of a launcher from `start_launch` once it ended; the test fails if it runs past `timeout`
    seconds (times `TVOPD_TEST_TIMEOUT_SCALE`)."""
    limit = time_limit(timeout)
    try:
        return process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        # torch's elastic agent starts each rank in a session of its own: the ranks and what they started are found
        # by descent, or they would outlive the launcher and hold its pipes open, leaving `communicate` waiting forever
        launcher = psutil.Process(process.pid)
        descendants = launcher.children(recursive=True)
        for running in [*descendants, launcher]:
            with contextlib.suppress(psutil.NoSuchProcess):
                running.kill()
        psutil.wait_procs(descendants, timeout=30)
        stdout, stderr = process.communicate()
        note = slow_machine_note()
        pytest.fail(f"{what} did not finish within {limit:g} s. {note}\n{stdout[-2000:]}\n{stderr[-6000:]}")


def launch(config, script, output_dir, *script_args, timeout=300, launch_args=(), processes=NUM_PROCESSES):
    """Runs a script of tests/distributed_scripts with `accelerate launch` on one of our accelerate configs (with
    `launch_args` over it, starting `processes`), and returns each rank's `rank-<i>.json` (with the tensors of
    `rank-<i>.pt`, when the script saved any, under "tensors")."""
    output_dir.mkdir(parents=True, exist_ok=True)
    process = start_launch(
        ["--config_file", str(ACCELERATE_CONFIGS / config), "--main_process_port", str(_free_port()), *launch_args]
        + [str(SCRIPTS / script), str(output_dir), *script_args]
    )
    stdout, stderr = wait_launch(process, script, timeout)

    log = f"{script}: exit code {process.returncode}\n{stdout[-2000:]}\n{stderr[-6000:]}"
    done = [(output_dir / f"rank-{rank}.done").exists() for rank in range(processes)]
    assert all(done), f"ranks done: {done}\n{log}"
    # Every rank finished its work; a non-zero exit code is then only acceptable as gloo's known exit abort.
    assert process.returncode == 0 or GLOO_EXIT_ABORT in stderr, log
    results = []
    for rank in range(processes):
        result = json.loads((output_dir / f"rank-{rank}.json").read_text())
        assert result["rank"] == rank
        tensors = output_dir / f"rank-{rank}.pt"
        if tensors.exists():
            result["tensors"] = torch.load(tensors)
        results.append(result)
    return results


def _flat_parameters(model):
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


# ----------------------------------------------------------------------------------------------------------------------
# 2-process DDP
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return launch("ddp_cpu.yaml", "ddp_tv_pooling.py", tmp_path_factory.mktemp("ddp"))


class ReplayTrainer(TVOPDTrainer):
    """Samples nothing: each prompt gets the completion that a rank of the distributed run sampled for it at that
    step. Everything downstream (teacher and student scoring, the estimate, the scheduler) runs for real."""

    def __init__(self, *args, rollouts, **kwargs):
        super().__init__(*args, **kwargs)
        self.completions = {
            (rollout["step"], tuple(prompt)): completion
            for rollout in rollouts
            for prompt, completion in zip(rollout["prompt_ids"], rollout["completion_ids"], strict=True)
        }
        self.replayed = 0

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        self.replayed += len(prompt_ids)
        return [self.completions[(self.state.global_step, tuple(ids))] for ids in prompt_ids]


@pytest.mark.compat_skip
def test_ddp_ranks_train_on_different_prompts(ddp_run):
    steps = ddp_run[0]["config"]["max_steps"]
    rollouts = [run["rollouts"] for run in ddp_run]
    assert [len(r) for r in rollouts] == [steps, steps]
    # Otherwise the agreement checked below would prove nothing: each rank samples its own half of the global batch.
    for first, second in zip(*rollouts, strict=True):
        assert first["step"] == second["step"]
        assert not {tuple(p) for p in first["prompt_ids"]} & {tuple(p) for p in second["prompt_ids"]}


def test_ddp_ranks_log_the_same_pooled_tv_estimate_and_scale_at_every_step(ddp_run):
    first, second = (run["logs"] for run in ddp_run)
    assert len(first) == len(second) == ddp_run[0]["config"]["max_steps"]
    for a, b in zip(first, second, strict=True):
        for name in POOLED:
            assert a[name] == b[name], (a["step"], name, a[name], b[name])
        assert 0 < a["tv/estimate"] < 1
    assert ddp_run[0]["scheduler"] == ddp_run[1]["scheduler"]
    # Each step's c_k comes from the estimates before it; some fall below the first, so the scale moves.
    assert any(entry["tv/scale"] < 1 for entry in first), [entry["tv/scale"] for entry in first]


def test_ddp_pooled_tv_estimate_equals_a_single_process_over_the_global_batch(ddp_run, tmp_path):
    config = ddp_run[0]["config"]
    # One process holds both ranks' micro-batches; the ranks' rollouts are replayed for the prompts they sampled.
    args = tiny_config(
        tmp_path, **{**config, "per_device_train_batch_size": NUM_PROCESSES * config["per_device_train_batch_size"]}
    )
    trainer = ReplayTrainer(
        model=tiny.student_path(),
        teacher_model=tiny.teacher_path(),
        args=args,
        train_dataset=tiny.prompt_dataset("opd", 64),
        processing_class=AutoTokenizer.from_pretrained(tiny.student_path(), padding_side="left"),
        rollouts=[rollout for run in ddp_run for rollout in run["rollouts"]],
    )
    trainer.train()
    assert trainer.accelerator.num_processes == 1
    assert trainer.replayed == len(trainer.completions)  # every recorded completion, each once

    single = [entry for entry in trainer.state.log_history if "tv/scale" in entry]
    distributed = ddp_run[0]["logs"]
    assert len(single) == len(distributed) == config["max_steps"]
    for one, two in zip(single, distributed, strict=True):
        assert one["tv/estimate"] == pytest.approx(two["tv/estimate"], rel=1e-6), one["step"]
        assert one["tv/scale"] == pytest.approx(two["tv/scale"], rel=1e-6), one["step"]
        # The loss divides each rank's token sum by its share of the global token count: the same token mean.
        assert one["loss"] == pytest.approx(two["loss"], rel=1e-5), one["step"]


def test_ddp_gradients_are_synchronised(ddp_run):
    first, second = (run["tensors"] for run in ddp_run)
    steps = ddp_run[0]["config"]["max_steps"]
    assert first["gradients"].shape[0] == steps
    # The all-reduced gradient, bit for bit, although the ranks' data differ; and it is a real gradient.
    assert torch.equal(first["gradients"], second["gradients"])
    assert all(gradient.norm() > 0 for gradient in first["gradients"])
    assert torch.equal(first["parameters"], second["parameters"])
    shipped = _flat_parameters(AutoModelForCausalLM.from_pretrained(tiny.student_path()))
    assert not torch.equal(first["parameters"], shipped)


# ----------------------------------------------------------------------------------------------------------------------
# 2-process DeepSpeed ZeRO-3: sharding, the TV scheduler across ranks, the 16-bit checkpoint and resuming from it
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("zero3")
    return output_dir, launch("zero3_cpu.yaml", "zero3_checkpoint_resume.py", output_dir)


@pytest.mark.parametrize("model", ["student", "teacher"])
def test_zero3_shards_the_student_and_the_teacher_over_both_processes(zero3_run, model):
    _, results = zero3_run
    for result in results:
        partition = result[model]
        assert partition["zero3_params"] == partition["params"] > 0, partition
        # Each rank holds its half of every parameter (DeepSpeed pads a partition to a multiple of the world size).
        full, local = partition["full_numel"], partition["local_numel"]
        assert full / NUM_PROCESSES <= local <= full / NUM_PROCESSES + partition["params"], partition
        # Outside a forward, all but the norms and biases are released: the rank holds only its shard of them.
        assert partition["released_numel"] > 0.9 * full, partition
    assert results[0][model] == results[1][model]


def test_zero3_trains_with_one_tv_scheduler_state_on_both_ranks(zero3_run):
    _, results = zero3_run
    first, second = (result["logs"] for result in results)
    assert [entry["step"] for entry in first] == [1, 2, 3, 4]
    assert not any(result["teacher_training"] for result in results)  # the teacher scores in evaluation mode
    for a, b in zip(first, second, strict=True):
        assert math.isfinite(a["loss"]) and a["update/skipped"] == 0.0 and a["update/norm"] > 0, a
        for name in POOLED:  # `tv/estimate` only at the end of a rollout batch, steps 2 and 4
            assert a.get(name) == b.get(name), (a["step"], name)
    assert ["tv/estimate" in entry for entry in first] == [False, True, False, True]
    assert results[0]["scheduler"] == results[1]["scheduler"]
    assert results[0]["scheduler"]["num_updates"] == 2  # once per rollout batch of 2 steps


def test_zero3_checkpoint_holds_a_full_model_that_reloads_with_from_pretrained(zero3_run):
    output_dir, results = zero3_run
    checkpoint = output_dir / "checkpoint-3"
    # `zero3_save_16bit_model` gathers the shards into one state dict; without it only DeepSpeed's shards are saved.
    reloaded, info = AutoModelForCausalLM.from_pretrained(checkpoint, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert sum(p.numel() for p in reloaded.parameters()) == results[0]["student"]["full_numel"]
    weights = _flat_parameters(reloaded)
    assert torch.isfinite(weights).all()
    shipped = _flat_parameters(AutoModelForCausalLM.from_pretrained(tiny.student_path()))
    # Trained: most weights moved away from the shipped student's (the gathered shards, not the initial copy).
    assert (weights != shipped).float().mean() > 0.5


def test_zero3_resume_inside_a_rollout_batch_continues_it_exactly(zero3_run):
    """checkpoint-3 falls between the two steps of the second rollout batch: each rank saved the rest of its batch,
    and the resumed step 4 is the uninterrupted run's, scheduler update included."""
    output_dir, results = zero3_run
    checkpoint = output_dir / "checkpoint-3"
    assert sorted(path.name for path in checkpoint.glob("rollout_state_*.pt")) == [
        f"rollout_state_{rank}.pt" for rank in range(NUM_PROCESSES)
    ]
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    saved = state["stateful_callbacks"]["TVScheduleCallback"]["args"]["scheduler_state"]
    assert saved["num_updates"] == 1 and saved["reference"] is not None
    uninterrupted = results[0]["logs"]
    for result in results:
        resumed = result["resumed"]
        assert resumed["scheduler_at_train_begin"] == saved
        (resumed_step,) = [entry for entry in resumed["logs"] if entry["step"] == 4]
        (uninterrupted_step,) = [entry for entry in uninterrupted if entry["step"] == 4]
        for name in ("loss", "tv/estimate", "tv/scale", "tv/ema", "tv/reference", "update/norm"):
            assert resumed_step[name] == pytest.approx(uninterrupted_step[name], rel=1e-6), name


# ----------------------------------------------------------------------------------------------------------------------
# 2-process DeepSpeed ZeRO-3 with a LoRA student
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[pytest.param("zero3", marks=pytest.mark.compat_skip)])
def zero3_lora_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("zero3_lora")
    return output_dir, launch("zero3_cpu.yaml", "zero3_lora.py", output_dir)


def test_zero3_lora_trains_and_saves_an_adapter_that_peft_reloads(zero3_lora_run):
    from peft import PeftModel
    from safetensors.torch import load_file

    output_dir, results = zero3_lora_run
    for result in results:
        assert result["student_class"] == "PeftModel"
        assert result["trainable"] and all("lora_" in name for name in result["trainable"])
        assert result["trainable_zero3"]  # the adapter is sharded too
        for entry in result["logs"]:
            assert math.isfinite(entry["loss"]) and entry["update/norm"] > 0, entry
    for a, b in zip(results[0]["logs"], results[1]["logs"], strict=True):
        assert [a[name] for name in POOLED] == [b[name] for name in POOLED], a["step"]

    adapter = output_dir / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert not (adapter / "model.safetensors").exists()  # the adapter only, not a full model
    saved = load_file(adapter / "adapter_model.safetensors")
    lora_b = {name: weight for name, weight in saved.items() if "lora_B" in name}
    # 2 layers x (q_proj, v_proj), gathered whole; lora_B starts at zero, so a non-zero one was trained.
    assert len(lora_b) == 4 and all(weight.shape == (64, 4) and weight.abs().max() > 0 for weight in lora_b.values())

    base = AutoModelForCausalLM.from_pretrained(tiny.student_path())
    model = PeftModel.from_pretrained(base, adapter)
    loaded = {name: p for name, p in model.named_parameters() if "lora_B" in name}
    assert len(loaded) == 4 and all(p.abs().max() > 0 for p in loaded.values())
    probe = AutoTokenizer.from_pretrained(tiny.student_path())("Compute 47 + 86.", return_tensors="pt").input_ids
    with torch.no_grad():
        adapted = model(probe).logits
        with model.disable_adapter():
            plain = model(probe).logits
    assert not torch.allclose(adapted, plain)


# ----------------------------------------------------------------------------------------------------------------------
# The accelerate configs, and `tvopd-trl train --accelerate_config`
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, distributed_type, num_processes, zero_stage",
    [
        ("zero3", "DEEPSPEED", 8, 3),
        ("zero2", "DEEPSPEED", 8, 2),
        ("fsdp2", "FSDP", 8, None),
        ("multi_gpu", "MULTI_GPU", 8, None),
        ("single_gpu", "NO", 1, None),
        ("zero3_cpu", "DEEPSPEED", 2, 3),
        ("ddp_cpu", "MULTI_GPU", 2, None),  # MULTI_GPU selects the multi-process launcher (see its header)
        ("zero3_sp", "DEEPSPEED", 8, 3),
        ("zero3_sp_cpu", "DEEPSPEED", 2, 3),
    ],
)
def test_accelerate_configs_load_and_say_how_to_launch_them(name, distributed_type, num_processes, zero_stage):
    from accelerate.commands.config.config_args import load_config_from_file

    path = ACCELERATE_CONFIGS / f"{name}.yaml"
    config = load_config_from_file(str(path))
    assert config.distributed_type == distributed_type and config.num_processes == num_processes
    assert not config.use_cpu  # it would not reach the processes (see ddp_cpu.yaml)
    if zero_stage is not None:
        assert config.deepspeed_config["zero_stage"] == zero_stage
        assert config.deepspeed_config.get("zero3_save_16bit_model", False) == (zero_stage == 3)
    header = path.read_text().split("\ncompute_environment:")[0]
    assert f"--config_file recipes/accelerate_configs/{name}.yaml" in header
    if name.startswith("zero3_sp"):  # the processes split into SP groups of 2, as many as dp_shard_size (or 1)
        sizes = config.parallelism_config
        assert sizes["parallelism_config_sp_size"] == 2 and sizes["parallelism_config_sp_backend"] == "deepspeed"
        assert sizes.get("parallelism_config_dp_shard_size", 1) * 2 == num_processes


def _train_cli(argv, monkeypatch, capsys):
    import accelerate.commands.launch

    from tvopd_trl import cli

    def no_launch(args):
        raise AssertionError(f"launched with {args}")

    monkeypatch.setattr(accelerate.commands.launch, "launch_command", no_launch)
    code = cli.main(["train", *argv])
    return code, capsys.readouterr().err


RECIPE = REPO / "recipes" / "tiny" / "tvopd.yaml"


def test_train_refuses_an_accelerate_config_that_does_not_exist_before_launching(monkeypatch, capsys, tmp_path):
    code, err = _train_cli(
        ["--config", str(RECIPE), "--accelerate_config", "nope", "--output_dir", str(tmp_path)], monkeypatch, capsys
    )
    assert code == 2
    assert "tvopd-trl train: error: --accelerate_config 'nope' is neither a file nor one of our" in err
    assert "zero3" in err and "recipes/accelerate_configs/zero3.yaml" in err


def test_train_refuses_a_recipe_naming_an_accelerate_config_that_does_not_exist(monkeypatch, capsys, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.read_text() + "accelerate_config: nope\n")
    code, err = _train_cli(["--config", str(recipe), "--output_dir", str(tmp_path)], monkeypatch, capsys)
    assert code == 2
    assert "tvopd-trl train: error: the recipe's `accelerate_config` 'nope' is neither a file nor" in err


def test_train_accelerate_config_flag_overrides_the_recipes(monkeypatch, tmp_path):
    import accelerate.commands.launch

    from tvopd_trl import cli

    launched = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", launched.append)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.read_text() + "accelerate_config: nope\n")
    config = ACCELERATE_CONFIGS / "ddp_cpu.yaml"
    argv = ["train", "--config", str(recipe), "--accelerate_config", str(config), "--output_dir", str(tmp_path)]
    assert cli.main(argv) == 0
    (args,) = launched
    assert args.config_file == str(config) and "--accelerate_config" not in args.training_script_args


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--accelerate_config", "zero3"],
            r"zero3.yaml's num_processes starts 8 processes on this node, which sees 4",
        ),
        (["--num_processes", "8"], r"--num_processes 8 starts 8 processes .* Pass --num_processes 4, and multiply "),
    ],
)
def test_train_refuses_more_processes_than_the_gpus_it_sees(flags, message, monkeypatch, capsys, tmp_path):
    """docs/vllm.md's trainers on 4 of 8 GPUs: the recipe's zero3 config starts 8 processes (checked with 4 devices
    pretended, before anything launches)."""
    import accelerate.commands.launch
    import torch

    from tvopd_trl import cli

    launched = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", launched.append)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 4)
    argv = ["train", "--config", str(RECIPE), *flags, "--output_dir", str(tmp_path)]
    assert cli.main(argv) == 2 and not launched
    assert re.search(message, capsys.readouterr().err)
    assert cli.main([*argv, "--num_processes", "4"]) == 0 and len(launched) == 1


# ----------------------------------------------------------------------------------------------------------------------
# Two teachers over 2 processes whose rows go to different teachers (DDP, ZeRO-2 and ZeRO-3)
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["ddp", "zero2", "zero3"])
def multi_teacher_run(request, tmp_path_factory):
    config = {"ddp": "ddp_cpu.yaml", "zero2": "zero3_cpu.yaml", "zero3": "zero3_cpu.yaml"}[request.param]
    output_dir = tmp_path_factory.mktemp(f"multi_teacher_{request.param}")
    return request.param, launch(config, "multi_teacher.py", output_dir, request.param)


@pytest.mark.compat_skip
def test_two_teachers_train_when_the_ranks_route_their_rows_differently(multi_teacher_run):
    launched, (first, second) = multi_teacher_run
    # The setup: at step 1 one rank holds only "teacher" rows and the other only "self" rows. Under ZeRO-3 each still
    # ran both teachers' forwards on 4 rows (the run would hang otherwise); elsewhere each scored its own rows only.
    assert sorted([first["rows"][0], second["rows"][0]]) == [[0, 4], [4, 0]]
    scored = [first["scored"][0], second["scored"][0]]
    if launched == "zero3":
        assert scored == [{"teacher": 4, "self": 4}] * 2
    else:
        assert sorted(scored, key=list) == [{"self": 4}, {"teacher": 4}]
    assert [entry["step"] for entry in first["logs"]] == [1, 2, 3, 4]
    for a, b in zip(first["logs"], second["logs"], strict=True):
        assert math.isfinite(a["loss"]) and a["update/norm"] > 0, a
        for key in a:
            if key.startswith(("tv/", "kl/")):  # reduced over processes, per teacher too
                assert a[key] == b[key], (a["step"], key)
    # Each teacher's scheduler pools its rows over both ranks: "self" had rows at steps 1 and 3 (the second epoch), and
    # was frozen at steps 2 and 4; "teacher" had rows at every step
    assert first["schedulers"] == second["schedulers"]
    teacher, own = first["schedulers"]
    assert teacher["num_updates"] == 4 and own["num_updates"] == 2
    assert [entry["tv/self/estimate"] is None for entry in first["logs"]] == [False, True, False, True]


@pytest.mark.parametrize(("sharding", "padded"), [(None, False), (1, False), (2, False), (3, True), ("fsdp", True)])
def test_rows_are_padded_only_where_a_teacher_forward_is_a_collective(
    sharding, padded, make_trainer, model_dirs, tmp_path, monkeypatch
):
    # One process stands in for two: the other holds 5 rows of each teacher, this one 4. A sharded teacher's forward
    # (FSDP, ZeRO-3) is a collective, so this process scores 5 rows for each, repeating row 0; at ZeRO-1/2 TRL's
    # `prepare_deepspeed` runs the teacher unsharded, and each process scores its own rows only.
    names = ["wide", "self"] * 4
    dataset = tiny.prompt_dataset("opd", 8).add_column("teacher_id", names)
    teachers = {"wide": model_dirs["teacher"], "self": model_dirs["student"]}
    trainer = make_trainer(tiny_config(tmp_path), teacher_model=teachers, train_dataset=dataset)
    if sharding == "fsdp":
        monkeypatch.setattr(trainer, "is_fsdp_enabled", True)
    elif sharding is not None:
        monkeypatch.setattr(trainer, "is_deepspeed_enabled", True)
        plugin = SimpleNamespace(zero_stage=sharding)
        monkeypatch.setattr(AcceleratorState, "deepspeed_plugin", property(lambda state: plugin))
    monkeypatch.setattr(trainer.accelerator, "gather", lambda counts: torch.cat([counts, torch.full_like(counts, 5)]))
    batch = {"completion_ids": torch.zeros(8, 3, dtype=torch.long), "teacher_index": torch.tensor([0, 1] * 4)}
    scored = {teacher.name: (rows.tolist(), real) for teacher, rows, real in trainer._rows_by_teacher(batch)}
    padding = [0] if padded else []
    assert scored == {"wide": ([0, 2, 4, 6, *padding], 4), "self": ([1, 3, 5, 7, *padding], 4)}


# ----------------------------------------------------------------------------------------------------------------------
# Served teachers' request statistics over 2 processes (DDP)
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served_stats_run(tmp_path_factory):
    return launch("ddp_cpu.yaml", "served_teacher_stats.py", tmp_path_factory.mktemp("served_stats"))


@pytest.mark.compat_skip
def test_served_teacher_statistics_are_reduced_over_processes(served_stats_run):
    first, second = served_stats_run
    # The setup: at steps 1 and 3 rank 0 scored on "teacher" only and rank 1 on "self" only, at step 2 both on "teacher";
    # only rank 1 retried and had a replica down
    assert [list(call) for call in first["calls"]] == [["teacher"], ["teacher"], ["teacher"]]
    assert [list(call) for call in second["calls"]] == [["self"], ["teacher"], ["self"]]
    assert {stats["retries"] for call in first["calls"] for stats in call.values()} == {0}
    assert {stats["retries"] for call in second["calls"] for stats in call.values()} == {3}
    # Retries add up over processes, the seconds and replicas down are the worst process's; a teacher no process
    # scored on has no value, one that a single process scored on has that process's
    rank_0 = {"request_seconds": 0.5, "retries": 0.0, "replicas_down": 0.0}
    rank_1 = {"request_seconds": 2.0, "retries": 3.0, "replicas_down": 1.0}
    only_one_rank_each = {
        **{f"teacher/teacher/{stat}": value for stat, value in rank_0.items()},
        **{f"teacher/self/{stat}": value for stat, value in rank_1.items()},
    }
    both_on_teacher = {f"teacher/teacher/{stat}": value for stat, value in rank_1.items()}
    expected = [only_one_rank_each, both_on_teacher, only_one_rank_each]
    for result in served_stats_run:
        logged = [
            {key: value for key, value in entry.items() if key.startswith("teacher/")} for entry in result["logs"]
        ]
        assert logged == expected, result["rank"]


# ----------------------------------------------------------------------------------------------------------------------
# A task reward whose groups span both processes
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory):
    return launch("ddp_cpu.yaml", "ddp_reward.py", tmp_path_factory.mktemp("reward"))


@pytest.mark.compat_skip
def test_reward_groups_are_normalised_over_the_processes_that_hold_them(reward_run):
    first, second = reward_run
    assert len(first["rollouts"]) == len(second["rollouts"]) == 3
    for step, (own, other) in enumerate(zip(first["rollouts"], second["rollouts"], strict=True)):
        # One prompt's 8 samples, 4 on each rank
        assert len(own["prompts"]) == len(other["prompts"]) == 4
        assert len(set(own["prompts"] + other["prompts"])) == 1, step
        rewards = torch.tensor(own["rewards"] + other["rewards"])
        expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        assert rewards.std() > 0, step
        got = torch.tensor(own["advantages"] + other["advantages"])
        torch.testing.assert_close(got, expected)
    for key in ("reward", "reward_std", "rewards/token_sum/mean", "advantage/reward_abs_mean", "loss"):
        assert [entry[key] for entry in first["logs"]] == [entry[key] for entry in second["logs"]], key


# ----------------------------------------------------------------------------------------------------------------------
# Asynchronous rollouts: an error only the main process sees stops both
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.compat_skip
def test_an_error_of_the_main_process_in_async_rollouts_stops_every_rank_with_it(tmp_path):
    """The main process alone tokenizes the batches ahead: its error (here an empty prompt in rollout batch 3, found at
    step 1) reaches the other process in the broadcast that would have carried the batch. Before: only a
    `RolloutServerError` did, and the other rank waited there until `ddp_timeout`."""
    first, second = launch("ddp_cpu.yaml", "async_error_ddp.py", tmp_path / "async_error")
    assert first["error"].startswith("ValueError: A prompt tokenized to no token at all")
    assert second["error"] == first["error"]
    assert first["step"] == second["step"] == 1


@pytest.mark.compat_skip
def test_a_rank_that_raises_during_a_step_stops_the_launch_at_once(tmp_path):
    """Any rank's error, not only the main process's: the rank that raises exits, torch's elastic agent (under `accelerate
    launch`) sees it exit and stops the others, which were waiting in the step's collectives, and the launch exits
    non-zero with that rank's traceback, within seconds rather than `ddp_timeout` (1800 s here)."""
    output_dir = tmp_path / "rank_error"
    output_dir.mkdir()
    process = start_launch(
        ["--config_file", str(ACCELERATE_CONFIGS / "ddp_cpu.yaml"), "--main_process_port", str(_free_port())]
        + [str(SCRIPTS / "rank_error.py"), str(output_dir)]
    )
    _, stderr = wait_launch(process, "rank_error.py", timeout=300)
    ended = time.time()
    assert process.returncode != 0
    assert "RuntimeError: rank 1 failed in step 2" in stderr and "ChildFailedError" in stderr, stderr[-3000:]
    # Both ranks reached step 2; the launch ended soon after the error, not after ddp_timeout
    started = [float((output_dir / f"rank-{rank}.started").read_text()) for rank in range(2)]
    assert ended - max(started) < 60, ended - max(started)


# ----------------------------------------------------------------------------------------------------------------------
# padding_free with a token budget over 2 processes: ZeRO-3 and DDP here, FSDP2 in tests/test_fsdp.py
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(
    scope="module", params=[pytest.param(name, marks=pytest.mark.compat_skip) for name in ("zero3", "ddp")]
)
def padding_free_run(request, tmp_path_factory):
    config = {"zero3": "zero3_cpu.yaml", "ddp": "ddp_cpu.yaml"}[request.param]
    output_dir = tmp_path_factory.mktemp(f"padding_free_{request.param}")
    return request.param, launch(config, "padding_free.py", output_dir, request.param)


def check_padding_free_run(run):
    """What tests/distributed_scripts/padding_free.py recorded: wherever a forward is a collective (a sharded model,
    DDP's wrapper) the ranks ran as many, even where the budget gave rank 0 fewer; elsewhere each ran its own. The
    packed log-probabilities and loss equal the padded ones; training and the backward through unequal forwards
    finished (the launch would have timed out otherwise)."""
    first, second = run
    for a, b in zip(first["logs"], second["logs"], strict=True):
        assert math.isfinite(a["loss"]) and a["loss"] == b["loss"]
    for result in run:
        assert result["backward_done"]
    for chunks in ("trained_chunks", "fixed_batch_chunks"):
        for (own_a, ran_a, collective), (own_b, ran_b, _) in zip(first[chunks], second[chunks], strict=True):
            assert (ran_a, ran_b) == ((max(own_a, own_b),) * 2 if collective else (own_a, own_b))
    assert [own for own, _, _ in first["fixed_batch_chunks"]] == [2, 2, 2, 2]
    assert [own for own, _, _ in second["fixed_batch_chunks"]] == [4, 4, 4, 4]
    assert any(collective for _, _, collective in first["fixed_batch_chunks"])
    for result in run:
        tensors = result["tensors"]
        real = tensors["completion_mask"].bool()
        for name in ("student", "teacher"):
            packed, padded = tensors[f"{name}_packed"], tensors[f"{name}_padded"]
            torch.testing.assert_close(packed[real], padded[real], rtol=0, atol=1e-5)
            assert (packed[~real] == 0).all()
        torch.testing.assert_close(tensors["loss_packed"], tensors["loss_padded"], rtol=1e-5, atol=1e-6)


def test_padding_free_runs_as_many_collective_forwards_on_every_rank_and_equals_padded(padding_free_run):
    launched, run = padding_free_run
    check_padding_free_run(run)
    first, second = run
    if launched == "ddp":
        # Under DDP the teacher's forwards are each rank's own, the wrapped student's are collectives
        assert [collective for _, _, collective in first["fixed_batch_chunks"]] == [True, False, False, True]
        # and one backward through unequal numbers of student forwards all-reduced their gradients
        assert first["gradient_sums"] == second["gradient_sums"] and any(first["gradient_sums"])
