"""2-process DeepSpeed ZeRO-3 on CPU with a LoRA student (peft `LoraConfig` as `peft_config`) and the embedded pair.

    DS_ACCELERATOR=cpu accelerate launch --config_file recipes/accelerate_configs/zero3_cpu.yaml zero3_lora.py OUTPUT_DIR

Trains a few steps and saves the adapter into OUTPUT_DIR/adapter; tests/test_distributed.py reloads it with peft.
"""

import os
import sys

from accelerate.utils import DistributedType
from common import check_launch, finish, save_rank_result, skip_deepspeed_shm_op
from peft import LoraConfig

from tvopd_trl import TVOPDConfig
from tvopd_trl.testing import tiny_pair_trainer


def main(output_dir):
    skip_deepspeed_shm_op()
    args = TVOPDConfig(
        output_dir=output_dir,
        ddp_backend="gloo",  # DeepSpeed's process group on CPU (see zero3_cpu.yaml)
        bf16=False,
        per_device_train_batch_size=4,
        max_steps=2,
        max_completion_length=8,
        learning_rate=5e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    # Below DeepSpeed's default persistence threshold every tiny tensor would stay whole (see zero3_checkpoint_resume).
    args.deepspeed_plugin.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"] = 640
    trainer = tiny_pair_trainer(
        args,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    accelerator = trainer.accelerator
    check_launch(accelerator, DistributedType.DEEPSPEED)
    assert accelerator.state.deepspeed_plugin.zero_stage == 3
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "DeepSpeedEngine", type(trainer.model_wrapped)
    trainer.save_model(os.path.join(output_dir, "adapter"))

    student = accelerator.unwrap_model(trainer.model)
    trainable = [(name, p) for name, p in student.named_parameters() if p.requires_grad]
    save_rank_result(
        output_dir,
        accelerator,
        {
            "student_class": type(student).__name__,
            "trainable": [name for name, _ in trainable],
            "trainable_zero3": all(hasattr(p, "ds_tensor") for _, p in trainable),
            "logs": [entry for entry in trainer.state.log_history if "tv/scale" in entry],
        },
    )
    finish(output_dir, accelerator)


if __name__ == "__main__":
    main(sys.argv[1])
