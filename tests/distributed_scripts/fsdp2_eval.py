"""FSDP2 over 2 CPU processes (fsdp2_teacher.py's test-only stand-in) and a `BenchmarkEvalCallback`: the benchmark
evaluation runs sharded over both processes before training and after its last step, through a student whose every
forward gathers its weights.

    accelerate launch --config_file recipes/accelerate_configs/ddp_cpu.yaml fsdp2_eval.py OUTPUT_DIR

Each rank records the callback's scores; rank 0 saves the trained student, gathered from its shards, into
OUTPUT_DIR/student for tests/test_eval_sharded.py to evaluate with `tvopd-trl eval`.
"""

import os
import sys

from accelerate.utils import DistributedType
from common import check_launch, finish, save_rank_result
from fsdp2_teacher import _pretend_multi_gpu, fsdp2_config
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from zero3_eval import EVALUATION, SETTINGS, record

from tvopd_trl import tiny
from tvopd_trl.eval import BenchmarkEvalCallback
from tvopd_trl.testing import tiny_pair_trainer


STEPS = 2


def main(output_dir):
    _pretend_multi_gpu()
    args = fsdp2_config(output_dir, max_steps=STEPS, learning_rate=1e-3)
    trainer = tiny_pair_trainer(args, prompts=32)
    check_launch(trainer.accelerator, DistributedType.FSDP)
    callback = BenchmarkEvalCallback(trainer, eval_every_steps=STEPS, settings=SETTINGS, **EVALUATION)
    trainer.add_callback(callback)
    trainer.train()
    # Every rank takes part in gathering the shards; rank 0 writes them into a plain copy of the student.
    weights = {
        name: value.full_tensor() if isinstance(value, DTensor) else value
        for name, value in trainer.model_wrapped.state_dict().items()
    }
    assert any(isinstance(value, DTensor) for value in trainer.model_wrapped.state_dict().values()), "not sharded"
    if trainer.accelerator.is_main_process:
        student = AutoModelForCausalLM.from_pretrained(tiny.student_path())
        student.load_state_dict(weights)
        student.save_pretrained(os.path.join(output_dir, "student"))
        trainer.processing_class.save_pretrained(os.path.join(output_dir, "student"))
    models = [[0, tiny.student_path()], [STEPS, os.path.join(output_dir, "student")]]
    save_rank_result(output_dir, trainer.accelerator, record(callback, models))
    finish(output_dir, trainer.accelerator)


if __name__ == "__main__":
    main(sys.argv[1])
