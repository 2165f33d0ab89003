"""2-process DDP with asynchronous rollouts (`max_staleness=1`) from a stand-in server (async_stand_in.py), on plain-text
prompts, unshuffled, of which the first of rollout batch 3 is empty: the main process refuses it when it tokenizes that
batch ahead, at step 1 (`_submit_rollout`), an error only it sees. Each rank records the error that stopped its
`train()` and the step it stopped at.

    accelerate launch --config_file recipes/accelerate_configs/ddp_cpu.yaml async_error_ddp.py OUTPUT_DIR

tests/test_distributed.py checks that the other process stops at once with the same error, rather than wait in the
broadcast of the batch until `ddp_timeout` (before the fix, the launch ran into the test's time limit).
"""

import sys

from accelerate.utils import DistributedType
from async_stand_in import use_stand_in
from common import check_launch, finish, save_rank_result
from datasets import Dataset

from tvopd_trl.testing import tiny_config, tiny_pair_trainer
from tvopd_trl.tiny import prompt_dataset


def main(output_dir):
    prompts = [row["prompt"][0]["content"] for row in prompt_dataset("opd", 16)]
    prompts[12] = ""  # rows 12-15: rollout batch 3, with 2 rows per process
    args = tiny_config(output_dir, per_device_train_batch_size=2, max_steps=6, shuffle_dataset=False)
    trainer = tiny_pair_trainer(args, train_dataset=Dataset.from_list([{"prompt": prompt} for prompt in prompts]))
    check_launch(trainer.accelerator, DistributedType.MULTI_CPU)
    server = use_stand_in(trainer, serve=trainer.accelerator.is_main_process)
    try:
        trainer.train()
        error = None
    except Exception as raised:  # noqa: BLE001  (whatever stopped this rank is the result)
        error = f"{type(raised).__name__}: {raised}"
    if server is not None:
        server.stop()
    save_rank_result(output_dir, trainer.accelerator, {"error": error, "step": trainer.state.global_step})
    finish(output_dir, trainer.accelerator)


if __name__ == "__main__":
    main(sys.argv[1])
