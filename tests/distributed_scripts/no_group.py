"""2 processes launched the way zero3_cpu.yaml's header launches DeepSpeed, but on the DDP config: `ddp_backend="gloo"`
without the CPU request. Torch joins them in a process group, accelerate runs each alone (distributed type NO).

    accelerate launch --config_file recipes/accelerate_configs/ddp_cpu.yaml no_group.py OUTPUT_DIR

Each rank records what it saw and the error that building the trainer raised (None if it built), then exits with 2
on that error.
"""

import os
import sys

import torch.distributed as dist
from accelerate import PartialState
from common import save_rank_result

from tvopd_trl.testing import tiny_config, tiny_pair_trainer


def main(output_dir):
    args = tiny_config(output_dir, use_cpu=False, ddp_backend="gloo")
    state = PartialState()
    try:
        tiny_pair_trainer(args)
        error = None
    except ValueError as refused:
        error = str(refused)
    result = {"distributed_type": state.distributed_type.value, "world_size": dist.get_world_size(), "error": error}
    save_rank_result(output_dir, state, result)
    # The launcher ends the other ranks as soon as it sees one exit: none exits before every rank has its result.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if error is None else 2)


if __name__ == "__main__":
    main(sys.argv[1])
