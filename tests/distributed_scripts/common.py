"""Helpers shared by the scripts that tests/test_distributed.py starts with `accelerate launch`.

A launched script is on its own: it checks that the launch really is distributed, writes what it saw into
`rank-<i>.json` (and tensors into `rank-<i>.pt`), and ends with a per-rank "done" marker. The test reads those files.
"""

import json
import os
import sys

import torch
import torch.distributed as dist


def check_launch(accelerator, distributed_type, num_processes=2):
    """Fails unless this process is one of `num_processes` synchronised ones: a launch that silently fell back to
    independent single processes would otherwise pass every per-rank check."""
    assert dist.is_available() and dist.is_initialized(), "no process group: the launch is not distributed"
    assert dist.get_world_size() == num_processes, f"world size {dist.get_world_size()}, expected {num_processes}"
    # A process group alone is not enough: without the CPU request (see ddp_cpu.yaml) torch joins the processes, but
    # accelerate, and so the Trainer, runs each of them as a single process.
    assert accelerator.num_processes == num_processes, (
        f"accelerate runs {accelerator.num_processes} process(es), expected {num_processes}"
    )
    assert accelerator.distributed_type == distributed_type, (
        f"distributed type {accelerator.distributed_type}, expected {distributed_type}"
    )
    assert int(os.environ["WORLD_SIZE"]) == num_processes and int(os.environ["RANK"]) == accelerator.process_index


def skip_deepspeed_shm_op():
    """Keeps DeepSpeed from compiling its shared-memory all-reduce on CPU (1-3 minutes on 2 cores, on every new
    extension cache or venv). Only tensor-parallel inference calls it; training communicates through gloo either way,
    which is also what DeepSpeed falls back to where the op is unavailable. Call before the trainer is built."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def save_rank_result(output_dir, accelerator, result, tensors=None):
    rank = accelerator.process_index
    with open(os.path.join(output_dir, f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": rank, **result}, f)
    if tensors is not None:
        torch.save(tensors, os.path.join(output_dir, f"rank-{rank}.pt"))


def finish(output_dir, accelerator):
    """Ends the script on every rank, then leaves a "done" marker as the very last thing.

    Gloo sometimes aborts in its destructors after a script's last line ("terminate called without an active
    exception", exit code 1); `os._exit` skips them, and the marker tells the test that the rank got this far.
    """
    accelerator.wait_for_everyone()
    accelerator.end_training()
    with open(os.path.join(output_dir, f"rank-{accelerator.process_index}.done"), "w") as f:
        f.write("done\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
