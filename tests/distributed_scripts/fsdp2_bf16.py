"""FSDP2 in bf16 over 2 CPU processes and gloo: fsdp2_teacher.py's CPU stand-in for the GPU path (not a supported
mode), with `bf16=True` and `optim="adamw_torch_fused"`, as `accelerate_configs/fsdp2.yaml` and the recipes set them.

    accelerate launch --config_file recipes/accelerate_configs/ddp_cpu.yaml fsdp2_bf16.py OUTPUT_DIR

accelerate turns FSDP on only with GPUs; `_pretend_multi_gpu` (fsdp2_teacher.py) makes it take the gloo group for a
multi-GPU one, and the script lifts transformers' bf16-needs-a-GPU check as zero3_bf16.py does. Each rank records the
mixed-precision policy that accelerate gave FSDP2, whether the forward runs under autocast, the dtype of the student's
sharded parameters and of the weights a forward computes with, and the optimizer's moments, for
tests/test_bf16_engine.py.
"""

import sys

import torch
import transformers.training_args
from accelerate.utils import DistributedType
from common import check_launch, finish, save_rank_result
from fsdp2_teacher import _pretend_multi_gpu, fsdp2_config
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tvopd_trl.testing import tiny_pair_trainer


def record_compute(student, seen):
    """A pre-hook on a projection inside the first decoder layer (an FSDP2 unit, gathered while it computes): the
    dtype of the weight it multiplies, and whether autocast is on."""
    projection = student.model.layers[0].self_attn.q_proj

    def hook(module, args):
        weight = module.weight
        seen.add((str(weight.dtype), isinstance(weight, DTensor), torch.is_autocast_enabled("cpu")))

    return projection.register_forward_pre_hook(hook)


def main(output_dir):
    _pretend_multi_gpu()
    transformers.training_args.is_torch_bf16_gpu_available = lambda: True  # see zero3_bf16.py
    args = fsdp2_config(output_dir, max_steps=3, learning_rate=1e-4, bf16=True, optim="adamw_torch_fused")
    trainer = tiny_pair_trainer(args, prompts=32)
    accelerator = trainer.accelerator
    check_launch(accelerator, DistributedType.FSDP)
    seen = set()
    handle = record_compute(trainer.model, seen)  # `fully_shard` keeps the modules: the hook stays on
    trainer.train()
    handle.remove()
    student = accelerator.unwrap_model(trainer.model_wrapped)
    units = [module for module in student.modules() if isinstance(module, FSDPModule)]
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    moments = [value for state in inner.state.values() for key, value in state.items() if key.startswith("exp_avg")]
    save_rank_result(
        output_dir,
        accelerator,
        {
            "mixed_precision": accelerator.mixed_precision,
            "native_amp": accelerator.native_amp,
            "policy": str(units[0]._get_fsdp_state()._mp_policy),
            "param_dtypes": sorted({str(p.dtype) for p in student.parameters()}),
            "all_dtensor": all(isinstance(p, DTensor) for p in student.parameters()),
            "compute": sorted(seen),
            "optimizer": type(inner).__name__,
            "fused": [group.get("fused") for group in inner.param_groups],
            "moment_dtypes": sorted({str(t.dtype) for t in moments}),
            "logs": [entry for entry in trainer.state.log_history if "loss" in entry],
        },
    )
    finish(output_dir, accelerator)


if __name__ == "__main__":
    main(sys.argv[1])
