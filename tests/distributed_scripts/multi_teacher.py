"""2 processes, two teachers, ranks whose rows are routed differently: rank 0 holds only one teacher's rows at a step
where rank 1 holds only the other's.

    accelerate launch --config_file recipes/accelerate_configs/ddp_cpu.yaml multi_teacher.py OUTPUT_DIR ddp
    DS_ACCELERATOR=cpu accelerate launch --config_file recipes/accelerate_configs/zero3_cpu.yaml \
        multi_teacher.py OUTPUT_DIR zero3

Under ZeRO-3 a teacher's forward is a collective: a rank without rows of a teacher still runs it as often as the rank
with the most, or both hang. Each rank records its per-step row counts per teacher, its logs and its schedulers.
"""

import sys

from accelerate.utils import DistributedType
from common import check_launch, finish, save_rank_result, skip_deepspeed_shm_op

from tvopd_trl import TVOPDTrainer
from tvopd_trl.testing import tiny_config, tiny_pair_trainer
from tvopd_trl.tiny import prompt_dataset, student_path, teacher_path


TEACHERS = {"teacher": teacher_path(), "self": student_path()}


class CountingTrainer(TVOPDTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows = []

    def score_completions(self, batch, *args, **kwargs):
        self.rows.append([int((batch["teacher_index"] == k).sum()) for k in range(len(self.teachers))])
        return super().score_completions(batch, *args, **kwargs)


def main(output_dir, launch):
    zero3 = launch == "zero3"
    if zero3:
        skip_deepspeed_shm_op()
    args = tiny_config(
        output_dir,
        use_cpu=not zero3,  # DDP's CPU request (see ddp_cpu.yaml)
        ddp_backend="gloo" if zero3 else None,  # DeepSpeed's process group on CPU (see zero3_cpu.yaml)
        max_steps=4,
        learning_rate=1e-3,
        shuffle_dataset=False,
    )
    if zero3:
        args.deepspeed_plugin.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"] = 640
    # Blocks of 4 rows per teacher: a global rollout of 8 rows gives each rank one block
    names = ["teacher"] * 4 + ["self"] * 4 + ["teacher"] * 8
    dataset = prompt_dataset("opd", len(names)).add_column("teacher_id", names)
    trainer = tiny_pair_trainer(args, trainer_class=CountingTrainer, teacher_model=TEACHERS, train_dataset=dataset)
    check_launch(trainer.accelerator, DistributedType.DEEPSPEED if zero3 else DistributedType.MULTI_CPU)
    trainer.train()
    save_rank_result(
        output_dir,
        trainer.accelerator,
        {
            "rows": trainer.rows,
            "logs": [entry for entry in trainer.state.log_history if "loss" in entry],
            "schedulers": [scheduler.state_dict() for scheduler in trainer._tv_schedulers],
        },
    )
    finish(output_dir, trainer.accelerator)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
