"""2-process DDP with asynchronous rollouts (`max_staleness=1`) whose vLLM server is killed after step 2, by the main
process: each rank records the error that stopped its `train()` and the step it stopped at.

    accelerate launch --config_file recipes/accelerate_configs/ddp_cpu.yaml vllm_async_server_dies.py OUTPUT_DIR \
        SERVER_URL SERVER_PID

The main process finds the failure in the weight sync after step 3 (the request for batch 4 failed while step 3
trained): tests/test_vllm_async.py checks that the other process stops with the same error rather than wait in its
next collective.
"""

import os
import signal
import sys

from accelerate.utils import DistributedType
from common import check_launch, finish, save_rank_result
from requests.adapters import HTTPAdapter
from transformers import AutoTokenizer, TrainerCallback

from tvopd_trl import TVOPDTrainer
from tvopd_trl.async_rollouts import RolloutServerError
from tvopd_trl.testing import tiny_config
from tvopd_trl.tiny import prompt_dataset, vllm_paths


class KillServer(TrainerCallback):
    def __init__(self, pid):
        self.pid = pid

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2 and state.is_world_process_zero:
            os.killpg(self.pid, signal.SIGKILL)


def main(output_dir, url, pid):
    pair = vllm_paths()
    args = tiny_config(
        output_dir,
        per_device_train_batch_size=4,
        max_steps=6,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_server_weights_dir=f"{output_dir}/weights",
        max_staleness=1,
    )
    trainer = TVOPDTrainer(
        model=pair["student"],
        teacher_model=pair["teacher"],
        args=args,
        train_dataset=prompt_dataset("opd", 32),
        processing_class=AutoTokenizer.from_pretrained(pair["student"], padding_side="left"),
        callbacks=[KillServer(int(pid))],
    )
    check_launch(trainer.accelerator, DistributedType.MULTI_CPU)
    if trainer.accelerator.is_main_process:
        # TRL's client retries a refused connection 5 times over about a minute before it fails; not here, for speed
        trainer.vllm_generation.vllm_client.session.mount("http://", HTTPAdapter(max_retries=0))
    try:
        trainer.train()
        error = None
    except RolloutServerError as raised:
        error = str(raised)
    save_rank_result(output_dir, trainer.accelerator, {"error": error, "step": trainer.state.global_step})
    finish(output_dir, trainer.accelerator)


if __name__ == "__main__":
    main(*sys.argv[1:])
