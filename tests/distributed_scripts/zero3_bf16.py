"""2-process DeepSpeed ZeRO-3 on CPU in bf16, as the GPU recipes run: the recipes' own `zero3.yaml`
(`mixed_precision: bf16`, so DeepSpeed's `bf16.enabled`), `bf16: true` and `optim: adamw_torch_fused`, the student
loaded from its path with no dtype (TRL loads it in float32), the embedded pair.

    DS_ACCELERATOR=cpu accelerate launch --config_file recipes/accelerate_configs/zero3.yaml --num_processes 2 \
        zero3_bf16.py OUTPUT_DIR

transformers' `TrainingArguments` refuses `bf16=True` without a bf16 GPU ("Your setup doesn't support bf16/gpu. You
need to assign use_cpu if you want to train the model on CPU.", `TrainingArguments._validate_args`), and `use_cpu`
would turn DeepSpeed off; DeepSpeed's CPU accelerator itself computes in bf16 (`is_bf16_supported()` is True). The
script lifts that one check of transformers. Otherwise it differs from the recipes' launch only where the CPU needs it
(gloo, 2 processes) and in scale (the tiny pair, 20 steps of 64 prompts in 2 micro-batches per process, learning rate
1e-4). Each rank records the dtypes of the student's module weights and of the optimizer's master weights and
moments, before and after training, and saves the trained student (`zero3_save_16bit_model` gathers its bf16
weights) for tests/test_bf16_engine.py to score against the shipped one.
"""

import os
import sys

import torch
import transformers.training_args
from accelerate.utils import DistributedType
from common import check_launch, finish, save_rank_result, skip_deepspeed_shm_op
from transformers import TrainerCallback

from tvopd_trl import TVOPDConfig
from tvopd_trl.testing import tiny_pair_trainer


MAX_STEPS = 20


def partitions(optimizer):
    """ZeRO-3's flat shards of this rank: the module's bf16 ones (views of the parameters' `ds_tensor`s) and the
    optimizer's float32 master copies, one of each per sub-group."""
    return optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat


class MasterWeights(TrainerCallback):
    """Records the master and module shards once the engine exists (before the first step) and after training."""

    def __init__(self):
        self.trainer, self.before = None, None

    def on_train_begin(self, args, state, control, **kwargs):
        module, master = partitions(self.trainer.optimizer.optimizer)
        self.before = {
            "module": [t.detach().clone() for t in module],
            "master": [t.detach().clone() for t in master],
        }


def summary(trainer, before):
    zero = trainer.optimizer.optimizer  # accelerate's wrapper -> DeepSpeed's ZeRO-3 optimizer
    inner = zero.optimizer  # the Trainer's optimizer, stepped by ZeRO-3 on the float32 shards
    module, master = partitions(zero)
    student = trainer.accelerator.unwrap_model(trainer.model)
    moments = [value for state in inner.state.values() for key, value in state.items() if key.startswith("exp_avg")]
    module_numel = sum(t.numel() for t in module)
    return {
        "engine": type(trainer.model_wrapped).__name__,
        "zero_optimizer": type(zero).__name__,
        "ds_bf16_enabled": trainer.accelerator.state.deepspeed_plugin.deepspeed_config["bf16"]["enabled"],
        "native_amp": trainer.accelerator.native_amp,  # accelerate's autocast: off under DeepSpeed
        "inner_optimizer": type(inner).__name__,
        "inner_fused": [group.get("fused") for group in inner.param_groups],
        "param_dtypes": sorted({str(p.dtype) for p in student.parameters()}),
        "shard_dtypes": sorted({str(p.ds_tensor.dtype) for p in student.parameters() if hasattr(p, "ds_tensor")}),
        "module_shard_dtypes": sorted({str(t.dtype) for t in module}),
        "master_dtypes": sorted({str(t.dtype) for t in master}),
        "moment_dtypes": sorted({str(t.dtype) for t in moments}),
        # DeepSpeed's defaults under `bf16`: gradients reduced, and summed over micro-batches, in bf16
        "grad_accum_dtype": str(zero.gradient_accumulation_dtype),
        "communication_dtype": str(zero.communication_data_type),
        "module_numel": module_numel,
        "master_numel": sum(t.numel() for t in master),
        # Before the first step the masters are the module's bf16 values, widened
        "master_equals_module_before": all(
            torch.equal(m, w.float()) for m, w in zip(before["master"], before["module"], strict=True)
        ),
        # After it, the module holds the masters rounded to bf16, and the masters hold bits that bf16 cannot
        "module_is_rounded_master": all(torch.equal(w, m.to(w.dtype)) for w, m in zip(module, master, strict=True)),
        "master_finer_than_bf16": sum((m != m.to(torch.bfloat16).float()).sum().item() for m in master)
        / max(1, module_numel),
        "master_moved": sum((m != b).sum().item() for m, b in zip(master, before["master"], strict=True))
        / max(1, module_numel),
        "module_moved": sum((w != b).sum().item() for w, b in zip(module, before["module"], strict=True))
        / max(1, module_numel),
        "logs": [entry for entry in trainer.state.log_history if "loss" in entry],
    }


def main(output_dir):
    skip_deepspeed_shm_op()
    transformers.training_args.is_torch_bf16_gpu_available = lambda: True  # see the docstring
    args = TVOPDConfig(
        output_dir=output_dir,
        ddp_backend="gloo",  # DeepSpeed's process group on CPU (see zero3_cpu.yaml)
        bf16=True,
        optim="adamw_torch_fused",
        per_device_train_batch_size=16,
        gradient_accumulation_steps=2,  # 64 prompts per optimizer step over the 2 processes
        max_steps=MAX_STEPS,
        max_completion_length=8,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    # Real sharding of the tiny tensors (see zero3_checkpoint_resume.py)
    args.deepspeed_plugin.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"] = 640
    master = MasterWeights()
    trainer = tiny_pair_trainer(args, prompts=256, callbacks=[master])
    master.trainer = trainer
    check_launch(trainer.accelerator, DistributedType.DEEPSPEED)
    assert trainer.accelerator.state.deepspeed_plugin.zero_stage == 3
    # TRL loaded the student in float32 (no dtype given), inside ZeRO-3's `zero.Init`: partitioned in bf16 at load
    loaded = sorted({str(p.ds_tensor.dtype) for p in trainer.model.parameters() if hasattr(p, "ds_tensor")})
    trainer.train()
    result = {**summary(trainer, master.before), "loaded_shard_dtypes": loaded}
    trainer.save_model(os.path.join(output_dir, "student"))
    save_rank_result(output_dir, trainer.accelerator, result)
    finish(output_dir, trainer.accelerator)


if __name__ == "__main__":
    main(sys.argv[1])
