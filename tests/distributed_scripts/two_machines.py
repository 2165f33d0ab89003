"""One process on each of 2 machines, both on loopback: `accelerate launch` runs once per machine rank.

    accelerate launch --config_file recipes/accelerate_configs/ddp_cpu.yaml --num_machines 2 --machine_rank R \
        --rdzv_backend static --main_process_ip 127.0.0.1 --main_process_port PORT two_machines.py OUTPUT_DIR

Each rank records its machine, the sum of the ranks' numbers over the group and its training logs.
"""

import os
import sys

import torch
from accelerate.utils import DistributedType
from common import check_launch, finish, save_rank_result

from tvopd_trl.testing import tiny_config, tiny_pair_trainer


def main(output_dir):
    # `tiny_config` asks for the CPU (`use_cpu=True`), which joins the two machines' processes in one gloo group.
    trainer = tiny_pair_trainer(tiny_config(output_dir, max_steps=2, learning_rate=1e-3))
    accelerator = trainer.accelerator
    check_launch(accelerator, DistributedType.MULTI_CPU)
    assert int(os.environ["LOCAL_WORLD_SIZE"]) == 1, "expected one process per machine"
    rank_sum = accelerator.reduce(torch.tensor(accelerator.process_index + 1.0), reduction="sum").item()
    trainer.train()
    result = {
        "machine_rank": int(os.environ["GROUP_RANK"]),
        "num_processes": accelerator.num_processes,
        "rank_sum": rank_sum,
        "logs": [entry for entry in trainer.state.log_history if "loss" in entry],
    }
    save_rank_result(output_dir, accelerator, result)
    finish(output_dir, accelerator)


if __name__ == "__main__":
    main(sys.argv[1])
