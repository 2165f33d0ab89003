"""2 processes, two teachers, ranks whose rows are routed differently: rank 0 holds only one teacher's rows at a step
where rank 1 holds only the other's.

    accelerate launch --config_file recipes/accelerate_configs/ddp_cpu.yaml multi_teacher.py OUTPUT_DIR ddp
    DS_ACCELERATOR=cpu accelerate launch --config_file recipes/accelerate_configs/zero3_cpu.yaml \
        multi_teacher.py OUTPUT_DIR zero3   (or zero2: the same launch, at ZeRO-2)

Under ZeRO-3 a teacher's forward is a collective: a rank without rows of a teacher still runs it as often as the rank
with the most, or both hang. At ZeRO-2 the teacher is not sharded, and each rank scores its own rows only. Each rank
records its per-step row counts per teacher, the rows it scored for each, its logs and its schedulers.
"""

import os
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
        self.rows, self.scored = [], []

    def score_completions(self, batch, *args, **kwargs):
        self.rows.append([int((batch["teacher_index"] == k).sum()) for k in range(len(self.teachers))])
        return super().score_completions(batch, *args, **kwargs)

    def _rows_by_teacher(self, batch):
        rows = super()._rows_by_teacher(batch)
        self.scored.append({teacher.name: len(own) for teacher, own, _ in rows})
        return rows


def main(output_dir, launch):
    zero3, deepspeed = launch == "zero3", launch in ("zero2", "zero3")
    if deepspeed:
        skip_deepspeed_shm_op()
    if launch == "zero2":
        # zero3_cpu.yaml's launch, at the stage that the launcher passes on to the DeepSpeed plugin
        os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"] = "2"
        os.environ["ACCELERATE_DEEPSPEED_ZERO3_INIT"] = "false"
    args = tiny_config(
        output_dir,
        use_cpu=not deepspeed,  # DDP's CPU request (see ddp_cpu.yaml)
        ddp_backend="gloo" if deepspeed else None,  # DeepSpeed's process group on CPU (see zero3_cpu.yaml)
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
    check_launch(trainer.accelerator, DistributedType.DEEPSPEED if deepspeed else DistributedType.MULTI_CPU)
    if deepspeed:
        assert trainer.accelerator.state.deepspeed_plugin.zero_stage == int(launch[-1])
    trainer.train()
    save_rank_result(
        output_dir,
        trainer.accelerator,
        {
            "rows": trainer.rows,
            "scored": trainer.scored,
            "logs": [entry for entry in trainer.state.log_history if "loss" in entry],
            "schedulers": [scheduler.state_dict() for scheduler in trainer._tv_schedulers],
        },
    )
    finish(output_dir, trainer.accelerator)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
