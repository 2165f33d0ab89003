"""2-process DeepSpeed ZeRO-3 on CPU with the embedded pair: train with a checkpoint inside a rollout batch (each
rollout batch feeds 2 optimizer steps, the checkpoint falls after the first of them), then resume from it.

    DS_ACCELERATOR=cpu accelerate launch --config_file recipes/accelerate_configs/zero3_cpu.yaml \
        zero3_checkpoint_resume.py OUTPUT_DIR

Each rank records how the student and the teacher are partitioned, its TV scheduler state after training, and the
state the resumed trainer starts from; tests/test_distributed.py compares them across ranks and with the checkpoint.
"""

import os
import sys

from accelerate.utils import DistributedType
from common import check_launch, finish, save_rank_result, skip_deepspeed_shm_op
from transformers import TrainerCallback

from tvopd_trl import TVOPDConfig
from tvopd_trl.testing import tiny_pair_trainer


STEPS_PER_GENERATION = 2
CHECKPOINT_STEP = 3  # between the two steps of the second rollout batch
MAX_STEPS = 4


def partition(model):
    """How ZeRO-3 holds `model` on this rank: `ds_tensor` is the local shard of each parameter, `ds_numel` its size."""
    params = list(model.parameters())
    return {
        "params": len(params),
        "zero3_params": sum(hasattr(p, "ds_tensor") for p in params),
        "full_numel": sum(p.ds_numel for p in params if hasattr(p, "ds_tensor")),
        "local_numel": sum(p.ds_tensor.numel() for p in params if hasattr(p, "ds_tensor")),
        # Outside a forward, a parameter over the persistence threshold is released: it holds no data at all.
        "released_numel": sum(p.ds_numel for p in params if hasattr(p, "ds_tensor") and p.numel() == 0),
    }


class SchedulerAtTrainBegin(TrainerCallback):
    """The TV scheduler state a run starts from: on resume, after the checkpoint's callback states are restored."""

    def __init__(self):
        self.trainer, self.state = None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.state = self.trainer._tv_scheduler.state_dict()


def make_trainer(output_dir, max_steps):
    args = TVOPDConfig(
        output_dir=output_dir,
        ddp_backend="gloo",  # DeepSpeed's process group on CPU (see zero3_cpu.yaml)
        bf16=False,
        per_device_train_batch_size=4,
        steps_per_generation=STEPS_PER_GENERATION,
        max_steps=max_steps,
        max_completion_length=8,
        learning_rate=1e-3,
        tv_ema_decay=0.5,  # the EMA then carries every estimate before it: only a restored state continues it
        logging_steps=1,
        report_to="none",
        save_strategy="steps",
        save_steps=CHECKPOINT_STEP,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    # ZeRO-3 keeps a parameter smaller than `stage3_param_persistence_threshold` (DeepSpeed's default: 1e5 elements)
    # whole on every rank, which is every tensor of the tiny pair. 640 is what "auto" gives a hidden size of 64: only
    # norms and biases stay whole, so the test sees real sharding. TRL's `prepare_deepspeed` copies this config for
    # the teacher (its own 10 * hidden size override uses dotted keys, which DeepSpeed ignores).
    args.deepspeed_plugin.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"] = 640
    start = SchedulerAtTrainBegin()
    trainer = tiny_pair_trainer(args, callbacks=[start])
    start.trainer = trainer
    check_launch(trainer.accelerator, DistributedType.DEEPSPEED)
    assert trainer.accelerator.state.deepspeed_plugin.zero_stage == 3
    return trainer, start


def main(output_dir):
    skip_deepspeed_shm_op()
    trainer, _ = make_trainer(output_dir, max_steps=MAX_STEPS)
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "DeepSpeedEngine", type(trainer.model_wrapped)
    assert type(trainer.teacher_model).__name__ == "DeepSpeedEngine", type(trainer.teacher_model)
    result = {
        "student": partition(trainer.accelerator.unwrap_model(trainer.model)),
        "teacher": partition(trainer.accelerator.unwrap_model(trainer.teacher_model)),
        "logs": [entry for entry in trainer.state.log_history if "tv/scale" in entry],
        "scheduler": trainer._tv_scheduler.state_dict(),
        # DeepSpeed's engine keeps its own `training` flag stale: ask the modules it wraps
        "teacher_training": any(m.training for m in trainer.accelerator.unwrap_model(trainer.teacher_model).modules()),
    }

    checkpoint = os.path.join(output_dir, f"checkpoint-{CHECKPOINT_STEP}")
    resumed, start = make_trainer(os.path.join(output_dir, "resumed"), max_steps=MAX_STEPS)
    resumed.train(resume_from_checkpoint=checkpoint)
    result["resumed"] = {
        "scheduler_at_train_begin": start.state,
        "logs": [entry for entry in resumed.state.log_history if "tv/scale" in entry],
    }
    save_rank_result(output_dir, resumed.accelerator, result)
    finish(output_dir, resumed.accelerator)


if __name__ == "__main__":
    main(sys.argv[1])
