"""2 processes, a task reward whose groups span both: 8 samples of one prompt per rollout, 4 on each rank.

    accelerate launch --config_file recipes/accelerate_configs/ddp_cpu.yaml ddp_reward.py OUTPUT_DIR

Each rank records, per rollout, its rows' prompts, rewards (a function of the completion's tokens) and reward
advantages, and its logs.
"""

import sys

from accelerate.utils import DistributedType
from common import check_launch, finish, save_rank_result

from tvopd_trl.testing import tiny_config, tiny_pair_trainer


def token_sum(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]


def main(output_dir):
    args = tiny_config(
        output_dir, use_cpu=True, max_steps=3, learning_rate=1e-3, num_generations=8, reward_coef=1.0, temperature=1.5
    )
    trainer = tiny_pair_trainer(args, reward_funcs=[token_sum])
    check_launch(trainer.accelerator, DistributedType.MULTI_CPU)
    rollouts = []
    reward_advantages = trainer.reward_advantages

    def recording(prompts, batch):
        advantages = reward_advantages(prompts, batch)
        ids = [
            row[mask.bool()].tolist()
            for row, mask in zip(batch["completion_ids"], batch["completion_mask"], strict=True)
        ]
        rollouts.append(
            {
                "prompts": [row["answer"] for row in prompts],
                "rewards": token_sum(ids),
                "advantages": advantages.tolist(),
            }
        )
        return advantages

    trainer.reward_advantages = recording
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    save_rank_result(output_dir, trainer.accelerator, {"rollouts": rollouts, "logs": logs})
    finish(output_dir, trainer.accelerator)


if __name__ == "__main__":
    main(sys.argv[1])
