"""2-process DDP with asynchronous rollouts (`max_staleness=1`) from a real vLLM server: each rank records the rows it
trained on at each step, the staleness it logged, how many weight reloads it sent the server and its final parameters.

    accelerate launch --config_file recipes/accelerate_configs/ddp_cpu.yaml vllm_async_ddp.py OUTPUT_DIR SERVER_URL
    accelerate launch --config_file recipes/accelerate_configs/zero3_sp_cpu.yaml vllm_async_ddp.py OUTPUT_DIR \
        SERVER_URL sp

The second runs one SP group of the two processes under ZeRO-3: each still samples its half of the rollout.

tests/test_vllm_async.py starts the server and checks the ranks against each other and against the dataloader.
"""

import sys

import requests
import torch
from accelerate.utils import DistributedType
from common import check_launch, finish, save_rank_result, skip_deepspeed_shm_op
from sequence_parallel import full_parameters
from transformers import AutoTokenizer

from tvopd_trl import TVOPDTrainer
from tvopd_trl.testing import tiny_config
from tvopd_trl.tiny import prompt_dataset, vllm_paths


def main(output_dir, url, launch="ddp"):
    sequence_parallel = launch == "sp"
    if sequence_parallel:
        skip_deepspeed_shm_op()
    pair = vllm_paths()
    args = tiny_config(
        output_dir,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_server_weights_dir=f"{output_dir}/weights",
        max_staleness=1,
        use_cpu=not sequence_parallel,
    )  # `use_cpu`: the CPU request that makes the two processes one gloo group (see ddp_cpu.yaml)
    tokenizer = AutoTokenizer.from_pretrained(pair["student"], padding_side="left")
    trainer = TVOPDTrainer(
        model=pair["student"],
        teacher_model=pair["teacher"],
        args=args,
        train_dataset=prompt_dataset("opd", 32),
        processing_class=tokenizer,
    )
    check_launch(trainer.accelerator, DistributedType.DEEPSPEED if sequence_parallel else DistributedType.MULTI_CPU)
    assert trainer._sp_size == (2 if sequence_parallel else 1)
    trained, take = [], trainer._take_rollout

    def recording_take():
        rows = take()
        trained.append([row["prompt"][0]["content"] for row in rows])
        return rows

    trainer._take_rollout = recording_take
    reloads, post = [], requests.Session.post

    def recording_post(session, url, *args, **kwargs):
        if url.endswith("/collective_rpc"):
            reloads.append(url)
        return post(session, url, *args, **kwargs)

    requests.Session.post = recording_post  # the weight sync's request, on whichever process sends it
    loaded = [[row["prompt"][0]["content"] for row in batch] for batch in list(trainer.get_train_dataloader())[:3]]
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "tv/scale" in entry]
    parameters = torch.cat([p.flatten() for p in full_parameters(trainer).values()])
    result = {"trained": trained, "loaded": loaded, "logs": logs, "weight_reloads": len(reloads)}
    save_rank_result(output_dir, trainer.accelerator, result, tensors={"parameters": parameters})
    finish(output_dir, trainer.accelerator)


if __name__ == "__main__":
    main(*sys.argv[1:])
