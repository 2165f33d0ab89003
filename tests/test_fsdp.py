"""FSDP2 teacher handling, tested with a CPU stand-in for the GPU path: 2 processes over gloo that accelerate is made to
take for a multi-GPU launch (tests/distributed_scripts/fsdp2_teacher.py, `_pretend_multi_gpu`).

accelerate turns FSDP on only with GPUs, so without that test-only patch an FSDP run on this machine is silently
unsharded. With it, the Trainer shards the student with FSDP2 as on GPUs, and TRL's `DistillationTrainer` hands
`TVOPDTrainer.__init__` a teacher that it left whole: `accelerator.prepare_model(teacher, evaluation_mode=True)` neither
shards nor places a model under FSDP. `TVOPDTrainer.__init__` shards it (`tvopd_trl.teachers.shard_teacher`, one unit
per decoder layer, then the root); these tests check that this call takes effect, that a teacher forward gathers one
decoder layer at a time, and that the sharded teacher scores tokens exactly as an unsharded copy does. Training on CPU
FSDP2 is not a supported mode: what this covers is our code on the GPU path, not gloo or the CPU.
"""

import math

import pytest
import torch

from .test_distributed import NUM_PROCESSES, check_padding_free_run, launch


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    return launch("ddp_cpu.yaml", "fsdp2_teacher.py", tmp_path_factory.mktemp("fsdp2"))


def test_fsdp2_stand_in_runs_two_processes_with_fsdp2_on(fsdp2_run):
    # The script asserts the process group itself (`common.check_launch`); these are the trainer's own flags.
    assert len(fsdp2_run) == NUM_PROCESSES
    for result in fsdp2_run:
        assert result["world_size"] == NUM_PROCESSES
        assert result["distributed_type"] == "DistributedType.FSDP"
        assert result["is_fsdp_enabled"] and result["fsdp_version"] == 2


@pytest.mark.parametrize("model", ["student", "teacher", "teacher_after_training"])
def test_fsdp2_shards_the_student_and_the_teacher_over_both_processes(fsdp2_run, model):
    for result in fsdp2_run:
        sharding = result[model]
        assert sharding["class"].startswith("FSDP") and sharding["fsdp_units"] >= 1, sharding
        # Every parameter is a DTensor of which this rank holds a part, never all of it.
        assert sharding["dtensor_params"] == sharding["params"] > 0, sharding
        assert sharding["whole_params"] == 0, sharding
        assert sharding["local_numel"] < sharding["full_numel"], sharding
    # The shards partition the model: together, the ranks hold each element once.
    assert sum(result[model]["local_numel"] for result in fsdp2_run) == fsdp2_run[0][model]["full_numel"]
    assert fsdp2_run[0][model]["full_numel"] == fsdp2_run[0]["copy"]["full_numel"]  # the whole tiny model


def test_without_shard_teacher_the_base_trainer_leaves_the_teacher_whole(fsdp2_run):
    # What `DistillationTrainer` handed to our `shard_teacher` call (recorded by wrapping that call): a plain module with
    # every parameter whole on each rank. Without the call, that is the teacher that would score every rollout.
    for result in fsdp2_run:
        (before,) = result["teacher_before_sharding"]  # the call ran exactly once
        assert before["class"] == "Qwen2ForCausalLM" and before["fsdp_units"] == 0, before
        assert before["dtensor_params"] == 0 and before["whole_params"] == before["params"], before
        assert before["local_numel"] == before["full_numel"] == result["teacher"]["full_numel"], before
        assert result["teacher_training"] is False  # `prepare_fsdp` leaves it in eval mode


def test_a_teacher_forward_gathers_one_decoder_layer_at_a_time(fsdp2_run):
    for result in fsdp2_run:
        gathered = result["teacher_gathered"]
        # One FSDP unit per decoder layer, then the root (embeddings, final norm and head), as the student's layers
        assert gathered["layers"] >= 2 and gathered["sharded_layers"] == gathered["layers"], gathered
        assert result["teacher"]["fsdp_units"] == gathered["layers"] + 1, result["teacher"]
        # Each rank holds whole at most one layer beside the root's own parameters during the forward: as one unit,
        # the whole teacher was gathered on every rank
        one_layer = gathered["root_own"] + max(gathered["layer_numel"])
        assert 0 < gathered["peak_whole"] <= one_layer < gathered["full"], gathered


def test_fsdp2_training_logs_the_same_finite_tv_scale_and_estimate_on_both_ranks(fsdp2_run):
    first, second = (result["logs"] for result in fsdp2_run)
    assert [entry["step"] for entry in first] == [1, 2, 3]
    for a, b in zip(first, second, strict=True):
        assert math.isfinite(a["loss"]) and a["update/skipped"] == 0.0 and a["update/norm"] > 0, a
        for name in ("tv/scale", "tv/estimate", "tv/ema", "tv/reference", "loss", "update/norm"):
            assert math.isfinite(a[name]) and a[name] == b[name], (a["step"], name, a[name], b[name])
        assert 0 < a["tv/estimate"] < 1 and 0 < a["tv/scale"] <= 1, a
    assert fsdp2_run[0]["scheduler"] == fsdp2_run[1]["scheduler"]
    assert fsdp2_run[0]["scheduler"]["num_updates"] == 3


def test_sharded_teacher_log_probabilities_equal_an_unsharded_copy(fsdp2_run):
    for result in fsdp2_run:
        tensors = result["tensors"]
        sharded, unsharded, mask = tensors["sharded"], tensors["unsharded"], tensors["completion_mask"].bool()
        assert result["copy"]["dtensor_params"] == 0  # the copy is a plain module, loaded whole on each rank
        assert mask.sum() >= 20 and (sharded[~mask] == 0).all()
        # Not a comparison of near-zero values only: some hand-written completion tokens are unlikely.
        assert unsharded[mask].min() < -5
        # The trainer's scoring path (sharded teacher, fused float32 head) against plain full-vocabulary logits.
        torch.testing.assert_close(sharded, unsharded, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(fsdp2_run[0]["tensors"]["sharded"], fsdp2_run[1]["tensors"]["sharded"], atol=0, rtol=0)


@pytest.fixture(scope="module")
def fsdp2_padding_free_run(tmp_path_factory):
    return launch("ddp_cpu.yaml", "padding_free.py", tmp_path_factory.mktemp("padding_free_fsdp2"), "fsdp2")


@pytest.mark.compat_skip
def test_fsdp2_padding_free_runs_as_many_forwards_on_every_rank_and_equals_padded(fsdp2_padding_free_run):
    check_padding_free_run(fsdp2_padding_free_run)
