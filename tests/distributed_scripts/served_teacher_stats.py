"""2 processes, two served teachers whose request statistics differ by rank: only rank 1 retries and loses a replica.

    accelerate launch --config_file recipes/accelerate_configs/ddp_cpu.yaml served_teacher_stats.py OUTPUT_DIR

Each teacher is a stand-in for a `TeacherServerPool`: it scores with the local tiny model and reports this rank's
statistics. The rows are routed as in multi_teacher.py: at step 1 rank 0 holds only "teacher" rows and rank 1 only
"self" rows. Each rank records, per scoring, the teachers it scored and their statistics, and its logs.
"""

import sys

import torch
from accelerate.utils import DistributedType
from common import check_launch, finish, save_rank_result

from tvopd_trl.teachers import Teacher
from tvopd_trl.testing import tiny_config, tiny_pair_trainer
from tvopd_trl.tiny import prompt_dataset, student_path, teacher_path


TEACHERS = {"teacher": teacher_path(), "self": student_path()}


class StandInPool:
    """Scores as the local `model` does, and reports the same request statistics at every call."""

    def __init__(self, trainer, name, model, stats, calls):
        self.trainer, self.name, self.model, self.stats, self.calls = trainer, name, model, stats, calls
        self.last_stats = {}

    def score(self, batch, temperature):
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        logps = self.trainer._sampled_token_logps(self.model, ids, mask, batch["completion_ids"].size(1))
        self.last_stats = dict(self.stats)
        self.calls[-1][self.name] = self.last_stats
        return logps.cpu()


def main(output_dir):
    args = tiny_config(output_dir, use_cpu=True, max_steps=3, learning_rate=1e-3, shuffle_dataset=False)
    # Blocks of 4 rows per teacher: a global rollout of 8 rows gives each rank one block
    names = ["teacher"] * 4 + ["self"] * 4 + ["teacher"] * 8
    dataset = prompt_dataset("opd", len(names)).add_column("teacher_id", names)
    trainer = tiny_pair_trainer(args, teacher_model=TEACHERS, train_dataset=dataset)
    check_launch(trainer.accelerator, DistributedType.MULTI_CPU)
    rank = trainer.accelerator.process_index
    stats = {"request_seconds": 2.0 if rank else 0.5, "retries": 3 if rank else 0, "replicas_down": rank}
    calls = []  # per scoring: {teacher: the statistics it reported on this rank}
    for name, teacher in trainer.teachers.items():
        trainer.teachers[name] = Teacher(name, client=StandInPool(trainer, name, teacher.model, stats, calls))
    scoring = trainer.score_completions

    def score_completions(*args, **kwargs):
        calls.append({})
        return scoring(*args, **kwargs)

    trainer.score_completions = score_completions
    trainer.train()
    save_rank_result(
        output_dir,
        trainer.accelerator,
        {"calls": calls, "logs": [entry for entry in trainer.state.log_history if "loss" in entry]},
    )
    finish(output_dir, trainer.accelerator)


if __name__ == "__main__":
    main(sys.argv[1])
