"""2-process DDP on CPU with the embedded pair: each rank records its logs, its rollouts and its gradients.

    accelerate launch --config_file recipes/accelerate_configs/ddp_cpu.yaml ddp_tv_pooling.py OUTPUT_DIR

tests/test_distributed.py checks that both ranks agree, and replays the recorded rollouts in a single process.
"""

import sys

import torch
from accelerate.utils import DistributedType
from common import check_launch, finish, save_rank_result
from transformers import TrainerCallback

from tvopd_trl import TVOPDConfig, TVOPDTrainer
from tvopd_trl.testing import tiny_pair_trainer


# Saved with the results, so that the single-process replay runs the same configuration.
CONFIG = dict(
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,  # the estimate pools tokens over micro-batches and processes
    max_steps=5,
    max_completion_length=8,
    learning_rate=1e-4,
    tv_ema_decay=0.0,  # c_k follows each step's estimate: early TV is noisy, so some steps scale below 1
    bf16=False,  # TRL's default is bf16, which on CPU would autocast the scoring to bf16
    seed=0,
)


class RecordingTrainer(TVOPDTrainer):
    """Keeps every rollout's prompts and sampled completions, so that a single process can be fed the same ones."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rollouts = []

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        completion_ids = super()._generate_single_turn(prompt_ids, images, multimodal_fields, has_tool_images)
        step, prompt_ids = self.state.global_step, [list(ids) for ids in prompt_ids]
        self.rollouts.append({"step": step, "prompt_ids": prompt_ids, "completion_ids": completion_ids})
        return completion_ids


class GradientRecorder(TrainerCallback):
    """The gradient each optimizer step applies: after DDP's all-reduce, the same on every rank."""

    def __init__(self):
        self.gradients = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.gradients.append(torch.cat([p.grad.detach().flatten() for p in model.parameters()]))


def main(output_dir):
    args = TVOPDConfig(
        output_dir=output_dir,
        use_cpu=True,  # the CPU request that makes the two processes one gloo group (see ddp_cpu.yaml)
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **CONFIG,
    )
    gradients = GradientRecorder()
    trainer = tiny_pair_trainer(args, trainer_class=RecordingTrainer, callbacks=[gradients])
    accelerator = trainer.accelerator
    check_launch(accelerator, DistributedType.MULTI_CPU)
    trainer.train()
    assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel), type(trainer.model_wrapped)

    student = accelerator.unwrap_model(trainer.model)
    save_rank_result(
        output_dir,
        accelerator,
        {
            "config": CONFIG,
            "logs": [entry for entry in trainer.state.log_history if "tv/scale" in entry],
            "rollouts": trainer.rollouts,
            "scheduler": trainer._tv_scheduler.state_dict(),
        },
        tensors={
            "gradients": torch.stack(gradients.gradients),
            "parameters": torch.cat([p.detach().flatten() for p in student.parameters()]),
        },
    )
    finish(output_dir, accelerator)


if __name__ == "__main__":
    main(sys.argv[1])
