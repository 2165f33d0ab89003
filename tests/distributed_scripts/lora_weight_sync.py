"""A LoRA student's weight sync under 2-process DeepSpeed ZeRO-3 or the FSDP2 stand-in of fsdp2_teacher.py.

    DS_ACCELERATOR=cpu accelerate launch --config_file recipes/accelerate_configs/zero3_cpu.yaml \
        lora_weight_sync.py OUTPUT_DIR zero3
    accelerate launch --config_file recipes/accelerate_configs/ddp_cpu.yaml lora_weight_sync.py OUTPUT_DIR fsdp2

Trains one step (the adapter sharded with the student), then every rank walks the parameters a sync sends
(`CPUWeightSyncGeneration._iter_named_params`, whose gathers are collectives). Rank 0 records them beside PEFT's
`merge_and_unload` of an unsharded copy; every rank records whether its student's gathered weights are unchanged.
tests/test_weight_sync.py checks them.
"""

import sys

import torch
from accelerate.utils import DistributedType
from common import check_launch, finish, save_rank_result, skip_deepspeed_shm_op
from fsdp2_teacher import _pretend_multi_gpu, fsdp2_config
from peft import LoraConfig, get_peft_model
from torch.distributed.tensor import DTensor
from transformers import Qwen2ForCausalLM
from trl.distributed import DistributedBackend

from tvopd_trl import TVOPDConfig
from tvopd_trl.testing import tiny_pair_trainer
from tvopd_trl.vllm_weight_sync import CPUWeightSyncGeneration


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)


def config(output_dir, mode):
    if mode == "fsdp2":
        _pretend_multi_gpu()
        return fsdp2_config(output_dir, max_steps=1, learning_rate=5e-2)
    skip_deepspeed_shm_op()
    args = TVOPDConfig(
        output_dir=output_dir,
        ddp_backend="gloo",  # DeepSpeed's process group on CPU (see zero3_cpu.yaml)
        bf16=False,
        per_device_train_batch_size=4,
        max_steps=1,
        max_completion_length=8,
        learning_rate=5e-2,
        report_to="none",
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    # Every tensor partitioned, the adapter's too: below DeepSpeed's persistence threshold a tensor stays whole
    args.deepspeed_plugin.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return args


def gathered(model, dist):
    """Every parameter of `model`, whole, by name (a collective)."""
    with dist.gather_params(list(model.parameters())):
        return {
            name: (param.full_tensor() if isinstance(param, DTensor) else param.data).detach().clone()
            for name, param in model.named_parameters()
        }


def main(output_dir, mode):
    args = config(output_dir, mode)
    trainer = tiny_pair_trainer(args, prompts=16, peft_config=LoraConfig(**LORA))
    accelerator = trainer.accelerator
    check_launch(accelerator, DistributedType.FSDP if mode == "fsdp2" else DistributedType.DEEPSPEED)
    trainer.train()
    model = trainer.model  # the PEFT model TRL's trainer hands its `VLLMGeneration`
    generation = CPUWeightSyncGeneration.__new__(CPUWeightSyncGeneration)  # no engine: the sync's iteration only
    generation.model, generation.accelerator = model, accelerator
    generation._dist = DistributedBackend(accelerator)
    # Outside a gather a rank holds a part of each adapter matrix
    sharded = [
        name
        for name, param in model.named_parameters()
        if "lora_" in name and (isinstance(param, DTensor) or param.data.numel() < param.ds_numel)
    ]

    before = gathered(model, generation._dist)
    sent = {name: tensor.detach().clone() for name, tensor in generation._iter_named_params()}
    after = gathered(model, generation._dist)
    result = {
        "zero_stage": generation._dist.zero_stage,
        "fsdp_version": generation._dist.fsdp_version,
        "sharded_lora": len(sharded),
        "unchanged": all(torch.equal(after[name], tensor) for name, tensor in before.items()),
        "lora_B_max": max(tensor.abs().max().item() for name, tensor in before.items() if "lora_B" in name),
    }
    tensors = None
    if accelerator.is_main_process:
        # Built by its class, not `from_pretrained`, which would partition it under ZeRO-3 (a collective)
        copy = get_peft_model(Qwen2ForCausalLM(model.config), LoraConfig(**LORA))
        result["not_loaded"] = copy.load_state_dict(before, strict=False).missing_keys  # the tied LM head only
        tensors = {"sent": sent, "merged": copy.merge_and_unload().state_dict()}
    save_rank_result(output_dir, accelerator, result, tensors)
    finish(output_dir, accelerator)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
