"""FSDP2 over 2 CPU processes and gloo: a CPU stand-in for the GPU path, not a supported mode.

    accelerate launch --config_file recipes/accelerate_configs/ddp_cpu.yaml fsdp2_teacher.py OUTPUT_DIR

accelerate turns FSDP on only with GPUs: on a CPU-only machine an FSDP launch silently runs unsharded. This script makes
accelerate believe that its gloo process group is a multi-GPU one (a test-only patch, `_pretend_multi_gpu`), so that
the Trainer shards the student with FSDP2 and `TVOPDTrainer.__init__` shards the teacher (`tvopd_trl.teachers.
shard_teacher`). Each rank records how both models are held, the teacher as TRL's base trainer handed it to that call,
how much of the teacher a forward holds whole at once, the training logs, and the teacher log-probabilities of a fixed
batch through the sharded teacher and through an unsharded copy. tests/test_fsdp.py checks them.
"""

import sys

import torch
from accelerate import PartialState
from accelerate.utils import DistributedType
from common import check_launch, finish, save_rank_result
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import tvopd_trl.teachers
from tvopd_trl import tiny
from tvopd_trl.testing import tiny_config, tiny_pair_trainer


def _pretend_multi_gpu():
    """The test-only patch: a gloo process group that accelerate takes for a multi-GPU one. Given the FSDP plugin that
    the config's `fsdp` settings build, `AcceleratorState` then turns MULTI_GPU into FSDP. It must run before any
    `TrainingArguments` or `Accelerator` is built, and the config must reuse this state (`use_configured_state`)."""
    PartialState(backend="gloo")
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def _sharding(model):
    """How a model's parameters are held on this rank: as DTensors (FSDP2) or plain tensors; local and full sizes."""
    parameters = list(model.parameters())
    local = [p.to_local() if isinstance(p, DTensor) else p for p in parameters]
    return {
        "class": type(model).__name__,
        "fsdp_units": sum(isinstance(module, FSDPModule) for module in model.modules()),  # `fully_shard` groups
        "params": len(parameters),
        "dtensor_params": sum(isinstance(p, DTensor) for p in parameters),
        "full_numel": sum(p.numel() for p in parameters),  # a DTensor's numel is the full tensor's
        "local_numel": sum(t.numel() for t in local),
        "whole_params": sum(t.numel() == p.numel() for t, p in zip(local, parameters, strict=True)),
    }


def _recording_shard_teacher(record):
    """Wraps the `shard_teacher` that `tvopd_trl.teachers.prepare_teacher` calls, to record the teacher as the base
    trainer left it."""
    shard_teacher = tvopd_trl.teachers.shard_teacher

    def shard(model, accelerator):
        record.append(_sharding(model))
        return shard_teacher(model, accelerator)

    return shard


def _gathered_at_once(teacher, forward):
    """How many of the teacher's parameters this rank holds whole (a plain tensor, not its DTensor shard) at most, at
    the entry and exit of any of its modules during `forward()`; beside the sizes of its decoder layers and root."""
    peak = 0

    def record(*_):
        nonlocal peak
        # FSDP2 swaps a unit's parameters for whole tensors while it computes: read them anew each time
        peak = max(peak, sum(p.numel() for p in teacher.parameters() if not isinstance(p, DTensor)))

    hooks = [module.register_forward_pre_hook(record) for module in teacher.modules()]
    hooks += [module.register_forward_hook(record) for module in teacher.modules()]
    forward()
    for hook in hooks:
        hook.remove()
    layers = teacher.model.layers
    full = sum(p.numel() for p in teacher.parameters())  # a DTensor's numel is the full tensor's
    layer_numel = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    return {
        "peak_whole": peak,
        "full": full,
        "layer_numel": layer_numel,
        "root_own": full - sum(layer_numel),  # embeddings, final norm and head
        "layers": teacher.config.num_hidden_layers,
        "sharded_layers": sum(isinstance(layer, FSDPModule) for layer in layers),
    }


def _fixed_batch(tokenizer):
    """Four prompts (left-padded) and hand-written completions (right-padded), laid out as the trainer scores them."""
    problems = ["Compute 47 + 86.", "Compute 3 + 5.", "Compute 12 + 90.", "Compute 71 + 29."]
    completions = ["\\boxed{133}<|im_end|>", "\\boxed{8}<|im_end|>", "9 + 3 = \\boxed{12}", "\\boxed{100}"]
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in problems
    ]
    prompts = tokenizer(texts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
    completion = tokenizer(
        completions, add_special_tokens=False, padding=True, padding_side="right", return_tensors="pt"
    )
    input_ids = torch.cat([prompts.input_ids, completion.input_ids], dim=1)
    attention_mask = torch.cat([prompts.attention_mask, completion.attention_mask], dim=1)
    return input_ids, attention_mask, completion.attention_mask


def _reference_logps(model, input_ids, attention_mask, completion_mask, temperature):
    """The completion tokens' log-probabilities from plain full-vocabulary logits: no fused head, no sharding."""
    k = completion_mask.size(1)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -k - 1 : -1].float()
    logps = torch.log_softmax(logits / temperature, dim=-1).gather(-1, input_ids[:, -k:, None]).squeeze(-1)
    return logps * completion_mask


def fsdp2_config(output_dir, **overrides):
    """A tiny run's config under FSDP2 on the CPU stand-in (call `_pretend_multi_gpu` first)."""
    return tiny_config(
        output_dir,
        fsdp=True,
        fsdp_config={"version": 2, "reshard_after_forward": True},
        accelerator_config={"use_configured_state": True},  # the state `_pretend_multi_gpu` built
        **overrides,
    )


def main(output_dir):
    _pretend_multi_gpu()
    args = fsdp2_config(
        output_dir,
        max_steps=3,
        learning_rate=1e-4,
        tv_ema_decay=0.0,  # c_k follows each step's estimate, so that the scale moves within 3 steps
    )
    before_sharding = []
    tvopd_trl.teachers.shard_teacher = _recording_shard_teacher(before_sharding)
    trainer = tiny_pair_trainer(args, prompts=32)
    tokenizer = trainer.processing_class
    accelerator = trainer.accelerator
    check_launch(accelerator, DistributedType.FSDP)
    assert trainer.is_fsdp_enabled and accelerator.is_fsdp2
    teacher_after_init = _sharding(trainer.teacher_model)
    trainer.train()

    # The teacher through the trainer's own scoring path (sharded, fused head) and an unsharded copy of it.
    input_ids, attention_mask, completion_mask = _fixed_batch(tokenizer)
    scores = []
    with torch.no_grad():
        gathered = _gathered_at_once(
            trainer.teacher_model,
            lambda: scores.append(
                trainer._sampled_token_logps(trainer.teacher_model, input_ids, attention_mask, completion_mask.size(1))
            ),
        )
    (sharded,) = scores
    copy = AutoModelForCausalLM.from_pretrained(tiny.teacher_path()).eval()
    unsharded = _reference_logps(copy, input_ids, attention_mask, completion_mask, trainer.temperature)

    save_rank_result(
        output_dir,
        accelerator,
        {
            "world_size": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type),
            "is_fsdp_enabled": trainer.is_fsdp_enabled,
            "fsdp_version": accelerator.state.fsdp_plugin.fsdp_version,
            "student": _sharding(trainer.model_wrapped),
            "teacher": teacher_after_init,
            "teacher_after_training": _sharding(trainer.teacher_model),  # resharded after each forward
            "teacher_before_sharding": before_sharding,
            "teacher_gathered": gathered,
            "teacher_training": trainer.teacher_model.training,
            "copy": _sharding(copy),
            "logs": [entry for entry in trainer.state.log_history if "tv/scale" in entry],
            "scheduler": trainer._tv_scheduler.state_dict(),
        },
        tensors={"sharded": sharded * completion_mask, "unsharded": unsharded, "completion_mask": completion_mask},
    )
    finish(output_dir, accelerator)


if __name__ == "__main__":
    main(sys.argv[1])
