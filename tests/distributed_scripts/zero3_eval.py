"""2-process DeepSpeed ZeRO-3 on CPU with the embedded pair and a `BenchmarkEvalCallback`: the benchmark evaluation
runs sharded over both processes before training and at the step whose checkpoint is saved.

    DS_ACCELERATOR=cpu accelerate launch --config_file recipes/accelerate_configs/zero3_cpu.yaml \
        zero3_eval.py OUTPUT_DIR

The trainer is zero3_checkpoint_resume.py's (the student really sharded, a 16-bit full model saved at
`CHECKPOINT_STEP`). Each rank records the callback's scores and the logged ones; tests/test_eval_sharded.py compares
them across ranks and with `tvopd-trl eval` of the shipped student and of the checkpoint.
"""

import sys

from common import finish, save_rank_result, skip_deepspeed_shm_op
from zero3_checkpoint_resume import CHECKPOINT_STEP, make_trainer

from tvopd_trl import tiny
from tvopd_trl.eval import BenchmarkEvalCallback, SamplingSettings


# 11 problems x 2 samples in batches of 8: batches of 8, 8 and 6 sequences, so that one rank generates two and the
# other one plus a repeat (each `generate` call is a collective), and a last batch that is not full.
EVALUATION = dict(benchmarks=["tiny"], limit=11, batch_size=8)
SETTINGS = SamplingSettings(k=2, max_new_tokens=8)  # the paper's sampling: T=0.6, top-p 0.95, top-k 20


def record(callback, models):
    """What tests/test_eval_sharded.py reads of a run: the evaluation, its scores and their logs, and `models`, the
    [step, path] of the model each step evaluated."""
    return {
        "evaluation": EVALUATION,
        "settings": SETTINGS.to_dict(),
        "history": callback.history,
        "logs": [entry for entry in callback.trainer.state.log_history if "eval/tiny/mean@2" in entry],
        "models": models,
    }


def main(output_dir):
    skip_deepspeed_shm_op()
    trainer, _ = make_trainer(output_dir, max_steps=CHECKPOINT_STEP)
    callback = BenchmarkEvalCallback(trainer, eval_every_steps=CHECKPOINT_STEP, settings=SETTINGS, **EVALUATION)
    trainer.add_callback(callback)
    trainer.train()
    # What each evaluation evaluated, saved: the shipped student, and the 16-bit model ZeRO-3 gathered
    models = [[0, tiny.student_path()], [CHECKPOINT_STEP, f"{output_dir}/checkpoint-{CHECKPOINT_STEP}"]]
    save_rank_result(output_dir, trainer.accelerator, record(callback, models))
    finish(output_dir, trainer.accelerator)


if __name__ == "__main__":
    main(sys.argv[1])
