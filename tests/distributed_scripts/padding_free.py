"""`padding_free` with a token budget, 2 processes: ZeRO-3, FSDP2 on the CPU stand-in, or DDP.

    DS_ACCELERATOR=cpu accelerate launch --config_file recipes/accelerate_configs/zero3_cpu.yaml \
        padding_free.py OUTPUT_DIR zero3
    accelerate launch --config_file recipes/accelerate_configs/ddp_cpu.yaml padding_free.py OUTPUT_DIR fsdp2
    accelerate launch --config_file recipes/accelerate_configs/ddp_cpu.yaml padding_free.py OUTPUT_DIR ddp

A sharded forward is a collective, so both ranks must run as many forwards even where their rows need different
numbers under the budget; under DDP each runs its own number, and one backward reduces the gradients of them all.
Each rank trains a few steps packed, then scores a fixed batch whose rows are shorter on rank 0 than on rank 1 (so
the budget gives the ranks different numbers of forwards), padded and packed, through the student and the teacher, and
the loss, whose packed forwards it then backpropagates. It records each scoring's count of forwards before and after
the ranks agreed on one.
"""

import sys

import torch
from accelerate.utils import DistributedType
from common import check_launch, finish, save_rank_result, skip_deepspeed_shm_op
from fsdp2_teacher import _fixed_batch, _pretend_multi_gpu, fsdp2_config

from tvopd_trl import TVOPDTrainer
from tvopd_trl.packing import token_budget_chunks
from tvopd_trl.testing import tiny_config, tiny_pair_trainer


class ChunkRecordingTrainer(TVOPDTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # (this rank's own count of forwards under the budget, the count run, whether each forward is a collective)
        self.chunks = []

    def _row_chunks(self, attention_mask, model):
        chunks = super()._row_chunks(attention_mask, model)
        if self.args.max_tokens_per_micro_batch is not None:
            own = token_budget_chunks(attention_mask.sum(dim=1), self.args.max_tokens_per_micro_batch)
            self.chunks.append((len(own), len(chunks), self._forward_is_collective(model)))
        return chunks


def main(output_dir, launch):
    overrides = dict(max_steps=3, learning_rate=1e-4, padding_free=True, max_tokens_per_micro_batch=50)
    if launch == "fsdp2":
        _pretend_multi_gpu()
        args, distributed_type = fsdp2_config(output_dir, **overrides), DistributedType.FSDP
    elif launch == "zero3":
        skip_deepspeed_shm_op()
        args = tiny_config(output_dir, use_cpu=False, ddp_backend="gloo", **overrides)
        distributed_type = DistributedType.DEEPSPEED
    else:
        args, distributed_type = tiny_config(output_dir, **overrides), DistributedType.MULTI_CPU
    trainer = tiny_pair_trainer(args, prompts=32, trainer_class=ChunkRecordingTrainer)
    accelerator = trainer.accelerator
    check_launch(accelerator, distributed_type)
    assert trainer._shards_models == (launch != "ddp")
    trainer.train()
    trained_chunks = list(trainer.chunks)

    input_ids, attention_mask, completion_mask = _fixed_batch(trainer.processing_class)
    keep = completion_mask.size(1)
    if accelerator.process_index == 0:  # completions of one token: fewer forwards under the budget than rank 1
        completion_mask[:, 1:] = 0
        attention_mask[:, -keep:] = completion_mask
    # Rows of 20 to 32 tokens on rank 1 (one per forward) and of 16 to 18 on rank 0 (two per forward)
    budget = 36
    tensors = {"completion_mask": completion_mask}
    for padding_free in (False, True):
        args.padding_free = padding_free
        args.max_tokens_per_micro_batch = budget if padding_free else None
        layout = "packed" if padding_free else "padded"
        with torch.no_grad():
            for name, model in (("student", trainer.model_wrapped), ("teacher", trainer.teacher_model)):
                tensors[f"{name}_{layout}"] = trainer._sampled_token_logps(model, input_ids, attention_mask, keep)
    # The loss of the batch, then a backward through the packed forwards, whose number differs between the ranks
    batch = {
        "prompt_ids": input_ids[:, :-keep],
        "prompt_mask": attention_mask[:, :-keep],
        "completion_ids": input_ids[:, -keep:],
        "completion_mask": completion_mask,
    }
    trainer.model_wrapped.train()
    for padding_free in (False, True):
        args.padding_free = padding_free
        args.max_tokens_per_micro_batch = budget if padding_free else None
        with torch.enable_grad() if padding_free else torch.no_grad():
            loss = trainer.compute_loss(trainer.model_wrapped, dict(batch))
        tensors[f"loss_{'packed' if padding_free else 'padded'}"] = loss.detach()
    accelerator.backward(loss)

    save_rank_result(
        output_dir,
        accelerator,
        {
            "trained_chunks": trained_chunks,
            "fixed_batch_chunks": trainer.chunks[len(trained_chunks) :],
            "backward_done": True,
            # DDP's all-reduced gradient of that backward (ZeRO-3 and FSDP hold gradient shards)
            "gradient_sums": [p.grad.sum().item() for p in trainer.model.parameters()] if launch == "ddp" else None,
            "logs": [entry for entry in trainer.state.log_history if "tv/scale" in entry],
        },
        tensors=tensors,
    )
    finish(output_dir, accelerator)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
