# Copyright 2026 The tvopd-trl Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Ulysses sequence parallelism (SP) in the loss phase: DeepSpeed's `UlyssesSPAttentionHF`, which accelerate registers
for `parallelism_config.sp_size > 1` with `sp_backend="deepspeed"` (docs/scaling.md).

The `sp_size` consecutive processes of an SP group are one data-parallel replica. Rollouts stay whole: each process
samples and scores its share of the group's rows as usual, then the group gathers them (`SequenceParallelGroup.gather`)
so that each of its processes holds every row whole, with every per-token tensor. Only the student's forwards in train
mode are split: each process runs its contiguous `1/sp_size` of every row (`shard_rows`) under Ulysses, and the
sampled-token log-probabilities are gathered back to whole rows (`SequenceParallelGroup.whole_rows`), detached except
on the process's own shard. The advantage, the TV estimate and every statistic are then computed on whole rows, exactly
as without SP; the group's first process alone counts them in reductions over processes, and each process's loss sums
whole rows of which only its shard carries a gradient.
"""

import contextlib
import importlib.metadata
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from packaging import version
from trl.trainer.utils import shuffle_sequence_dict

from .packing import check_predicted


# What Ulysses runs as the core attention (DeepSpeed refuses eager: it needs the 4D mask Ulysses drops)
ULYSSES_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")
# Batch entries padded on the left (TRL left-pads prompts); every other `(B, T)` entry is padded on the right
_LEFT_PADDED = ("prompt_ids", "prompt_mask", "teacher_prompt_ids", "teacher_prompt_mask")
_PADDING_VALUE = {"span_ids": -1}


def sequence_parallel_size(accelerator) -> int:
    config = getattr(accelerator, "parallelism_config", None)
    return 1 if config is None else config.sp_size


# The first DeepSpeed release whose ZeRO-3 sums gradients over an SP group instead of averaging them over the world
ZERO3_SUMS_OVER_SP_GROUP = "0.20.2"


def zero3_averages_over_sp_group(accelerator) -> bool:
    """Whether the run's DeepSpeed engine is ZeRO-3 of a version that averages the SP group's gradients (as transformers'
    own Ulysses loss, `deepspeed_sp_compute_loss`, gates its rescale)."""
    if accelerator.state.deepspeed_plugin.zero_stage != 3:
        return False
    return version.parse(importlib.metadata.version("deepspeed")) < version.parse(ZERO3_SUMS_OVER_SP_GROUP)


def check_sequence_parallel(trainer, student):
    """Refuses what Ulysses cannot run, each with the fix; fills accelerate's `sp_attn_implementation` from the
    student's when it is unset (accelerate's default, None, fails in DeepSpeed's registration)."""
    args, accelerator = trainer.args, trainer.accelerator
    config = getattr(accelerator, "parallelism_config", None)
    if config is not None and config.cp_size > 1:
        raise ValueError(
            f"cp_size={config.cp_size}: torch context parallelism needs CUDA's attention kernels and is not supported; "
            "split sequences with Ulysses instead: sp_size (with sp_backend: deepspeed)."
        )
    size = sequence_parallel_size(accelerator)
    if size == 1:
        return
    if not trainer.is_deepspeed_enabled:
        raise ValueError(
            f"sp_size={size} runs DeepSpeed's Ulysses attention, which accelerate turns on only with a DeepSpeed engine "
            "(FSDP2's sequence split is torch context parallelism, CUDA-only). Launch with a DeepSpeed config, e.g. "
            "recipes/accelerate_configs/zero3_sp_cpu.yaml or zero3_sp.yaml."
        )
    processes = accelerator.num_processes
    if processes % size:
        raise ValueError(f"sp_size={size} does not divide the {processes} processes: launch a multiple of {size}.")
    text = student.config.get_text_config()
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    if heads % size or (kv_heads % size and size % kv_heads):
        raise ValueError(
            f"sp_size={size} must divide the student's {heads} attention heads and divide (or be a multiple of) its "
            f"{kv_heads} KV heads: Ulysses gives each process whole heads. Use an sp_size that does."
        )
    implementation = student.config._attn_implementation
    if implementation not in ULYSSES_ATTENTION:
        raise ValueError(
            f"The student runs attn_implementation={implementation!r}, which Ulysses sequence parallelism cannot wrap: "
            f"load it with one of {', '.join(ULYSSES_ATTENTION)} (model_init_kwargs={{'attn_implementation': 'sdpa'}})."
        )
    handler = config.sp_handler
    handler.sp_attn_implementation = handler.sp_attn_implementation or implementation
    if handler.sp_attn_implementation != implementation:
        raise ValueError(
            f"parallelism_config's sp_attn_implementation={handler.sp_attn_implementation!r} is not the student's "
            f"{implementation!r}: set them to the same value."
        )
    if not handler.sp_seq_length_is_variable:
        raise ValueError("Rollouts vary in length: set parallelism_config_sp_seq_length_is_variable: true.")
    if args.padding_free:
        raise ValueError(
            "padding_free=True packs rows into one sequence, but Ulysses drops the attention mask and attends causally "
            "over the whole sequence, so packed rows would see each other. Set padding_free=False with sp_size > 1."
        )
    if args.max_tokens_per_micro_batch is not None:
        raise ValueError(
            "max_tokens_per_micro_batch varies the rows of a forward, but Ulysses is built for "
            "per_device_train_batch_size rows per forward: unset it with sp_size > 1."
        )
    zero = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
    if zero3_averages_over_sp_group(accelerator) and not zero.get("reduce_scatter", True):
        # With `contiguous_gradients`, parameters of one layer take different reduction paths, some averaged and some
        # not (transformers' finding; its Trainer refuses it too); without, every update is 1/sp_size (measured), which
        # the loss's scale corrects
        if zero.get("contiguous_gradients", True):
            raise ValueError(
                f"ZeRO-3 with reduce_scatter: false and contiguous_gradients: true scales some gradients of an SP "
                f"group by 1/sp_size and not others on deepspeed<{ZERO3_SUMS_OVER_SP_GROUP}: set reduce_scatter: true "
                f"(the default), or contiguous_gradients: false, or upgrade to deepspeed>={ZERO3_SUMS_OVER_SP_GROUP}."
            )
    rows = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.steps_per_generation
    if rows % size:
        raise ValueError(
            f"Each SP group's rollout has per_device_train_batch_size x gradient_accumulation_steps x "
            f"steps_per_generation = {rows} rows, which its {size} processes sample in equal shares: make it a "
            f"multiple of sp_size={size}."
        )


@dataclass
class ShardedRows:
    """This process's shard of a padded batch of `B` rows laid out for Ulysses.

    Ulysses attends causally without a mask, so each row's real tokens are moved to its start (padding only after
    them) and padded to `width`, a multiple of the SP size; the labels are shifted on the whole row before it is cut.

    Attributes:
        input_ids, position_ids, shift_labels (`torch.Tensor`): `(B, width / sp)`, this process's columns; the label
            of a position is the completion token it predicts, -100 elsewhere.
        predictors (`torch.Tensor`): `(B, T)`, the column of the whole row whose output predicts each completion token.
        scored (`torch.Tensor`): `(B, T)` bool, the real completion tokens.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor
    predictors: torch.Tensor
    scored: torch.Tensor


def shard_rows(input_ids, attention_mask, logits_to_keep, size, rank) -> ShardedRows:
    real = attention_mask.bool()
    check_predicted(real, logits_to_keep)
    rows = input_ids.size(0)
    width = max(1, math.ceil(real.sum(dim=1).max().item() / size)) * size
    column = real.cumsum(dim=1) - 1  # of each real token, in its row with the padding removed
    aligned = input_ids.new_zeros(rows, width)
    aligned[real.nonzero(as_tuple=True)[0], column[real]] = input_ids[real]
    scored = real[:, -logits_to_keep:]
    predictors = torch.where(scored, column[:, -logits_to_keep:] - 1, 0)
    labels = torch.full_like(aligned, -100)
    labels[scored.nonzero(as_tuple=True)[0], predictors[scored]] = input_ids[:, -logits_to_keep:][scored]
    own = slice(rank * width // size, (rank + 1) * width // size)
    positions = torch.arange(width, device=input_ids.device).expand(rows, -1)
    return ShardedRows(aligned[:, own], positions[:, own], labels[:, own], predictors, scored)


class SequenceParallelGroup:
    """This process's SP group: DeepSpeed's (consecutive processes), built when accelerate prepared the model."""

    def __init__(self, size, process_index):
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        self.size, self.rank = size, process_index % size
        self.group = parallel_state_sp.get_sequence_parallel_group()

    @property
    def is_first(self):
        return self.rank == 0

    def _all_gather(self, tensor):
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return parts

    def gather(self, batch):
        """The group's rows: every process's `batch` (as many rows each), in process order, each entry padded to the
        group's widest; a 0-dimensional entry, the same on every process, as it is."""
        widths = torch.tensor([value.size(1) if value.dim() > 1 else 0 for value in batch.values()])
        widths = torch.stack(self._all_gather(widths.to(next(iter(batch.values())).device))).amax(dim=0).tolist()
        gathered = {}
        for (key, value), width in zip(batch.items(), widths, strict=True):
            if value.dim() == 0:  # a count over every process (TRL's `num_items_in_batch`)
                gathered[key] = value
                continue
            if value.dim() > 1:
                missing = width - value.size(1)
                padding = (missing, 0) if key in _LEFT_PADDED else (0, missing)
                value = torch.nn.functional.pad(value, padding, value=_PADDING_VALUE.get(key, 0))
            gathered[key] = torch.cat(self._all_gather(value))
        return gathered

    def shuffle(self, batch):
        """TRL's row shuffle with the permutation of the group's first process, so that the group agrees on it."""
        seed = torch.randint(2**62, (1,), device=next(iter(batch.values())).device)
        dist.broadcast(seed, src=dist.get_global_rank(self.group, 0), group=self.group)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed.item())
            return shuffle_sequence_dict(batch)

    def whole_rows(self, local, sharded: ShardedRows):
        """`(B, T)` values of the completion tokens from each process's `(B, width / sp)` shard of them: gathered,
        detached, except this process's own shard, which keeps its gradient."""
        parts = self._all_gather(local.detach())
        parts[self.rank] = local
        values = torch.cat(parts, dim=1).gather(1, sharded.predictors)
        return torch.where(sharded.scored, values, 0.0)


def dispatch_attention_by_mode(implementation):
    """After accelerate registered Ulysses in place of transformers' `implementation` (for the whole process), sends
    modules in eval mode back to the original: Ulysses's wrapper drops the attention mask even where it steps aside
    (`disable_in_eval`), and whole rows in eval mode (generation, a teacher, evaluation) are left-padded."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # Ulysses is registered as the instance's override; transformers' own functions stay in the class's mapping
    ulysses, original = (
        ALL_ATTENTION_FUNCTIONS[implementation],
        ALL_ATTENTION_FUNCTIONS._global_mapping[implementation],
    )

    def attention(module, *args, **kwargs):
        return (ulysses if module.training else original)(module, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[implementation] = attention


def forget_ulysses():
    """Undoes an earlier trainer's registration in this process (a resumed run, a notebook), which DeepSpeed refuses
    to repeat ("sequence parallel group is already initialized") and which would otherwise wrap Ulysses in Ulysses."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is not None:
        parallel_state_sp._release_sequence_parallel_groups()
        groups.mpu = None  # the earlier engine's, which the next engines would ask for the released groups
    for implementation in ULYSSES_ATTENTION:
        ALL_ATTENTION_FUNCTIONS._local_mapping.pop(implementation, None)


class SequenceParallelMixin:
    """What [`TVOPDTrainer`] does differently under SP: its dataloader and batch sizes count SP groups as data-parallel
    replicas, it gathers each group's rollout, and its student forwards whole rows in eval mode, where Ulysses is off
    (accelerate registers it with `disable_in_eval`), and split rows in train mode."""

    @property
    def _sp_size(self):
        return sequence_parallel_size(self.accelerator)

    @property
    def _data_parallel_size(self):
        return self.accelerator.num_processes // self._sp_size

    @property
    def _sequence_parallel(self):
        if self._sp_size == 1:
            return None
        if getattr(self, "_sp_group", None) is None:
            self._sp_group = SequenceParallelGroup(self._sp_size, self.accelerator.process_index)
        return self._sp_group

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if self._sp_size > 1:
            forget_ulysses()
            self.accelerator.deepspeed_ulysses_dl_adapter = self._after_ulysses_registered

    def _after_ulysses_registered(self, dataloader, model):
        # Where the base Trainer hands the train dataloader to Ulysses's adapter, right after accelerate registered
        # Ulysses with the model. The adapter would cut prompts: rollouts are gathered and cut in the loss phase.
        dispatch_attention_by_mode(self.accelerator.parallelism_config.sp_handler.sp_attn_implementation)
        return dataloader

    def get_sp_size(self):
        # Read by the base Trainer to count its Ulysses adapter's batches, which this trainer does not use
        return 1

    def get_total_train_batch_size(self, args):
        return self._train_batch_size * args.gradient_accumulation_steps * self._data_parallel_size

    def _shards_sequences(self, model):
        """Whether `model`'s forwards run split rows: the student's in train mode (a teacher scores whole rows)."""
        # A DeepSpeed engine's own `training` flag stays True: its `eval()` sets the module's only
        training = self.accelerator.unwrap_model(model).training
        return self._sp_size > 1 and training and model in (self.model, self.model_wrapped)

    def _counts_rows(self, model):
        """Whether this process counts its rows' tokens in a reduction over processes: all but the first of an SP
        group hold the same whole rows."""
        return not self._shards_sequences(model) or self._sequence_parallel.is_first

    @contextlib.contextmanager
    def _whole_rows(self):
        """The student forwards whole rows here (generation, the exact divergences): in eval mode under SP."""
        training = self.model.training
        if self._sp_size > 1 and training:
            self.model.eval()
        try:
            yield
        finally:
            if training:
                self.model.train()

    def _sharded_logps(self, model, input_ids, attention_mask, logits_to_keep, with_entropy):
        """`_sampled_token_logps` under SP: each forward of `per_device_train_batch_size` rows (Ulysses is built for
        that many) on this process's shard, through TRL's fused head with the labels shifted on the whole row."""
        group = self._sequence_parallel
        if not self.accelerator.unwrap_model(model).training:
            # Ulysses is off in eval mode: a shard would attend to itself only, silently wrong
            raise RuntimeError("A sequence-parallel forward needs the model in train mode (Ulysses is off in eval).")
        logps, entropies = [], []
        chunk = self.args.per_device_train_batch_size
        for start in range(0, input_ids.size(0), chunk):
            rows = slice(start, start + chunk)
            sharded = shard_rows(input_ids[rows], attention_mask[rows], logits_to_keep, group.size, group.rank)
            with self.accelerator.autocast():
                outputs = model(
                    input_ids=sharded.input_ids,
                    position_ids=sharded.position_ids,
                    shift_labels=sharded.shift_labels,
                    fused_lm_head=True,
                )
            logps.append(group.whole_rows(outputs.log_probs.float(), sharded))
            if with_entropy:
                entropies.append(group.whole_rows(outputs.entropy.detach().float(), sharded))
        return (torch.cat(logps), torch.cat(entropies)) if with_entropy else torch.cat(logps)

    def _gradient_scale(self):
        # Before DeepSpeed 0.20.2, ZeRO-3 averages gradients over the whole world, with or without `reduce_scatter`;
        # ZeRO-0/1/2, and ZeRO-3 from 0.20.2 on (deepspeedai/DeepSpeed#8854), sum them over each SP group and average
        # over data-parallel replicas (docs/scaling.md): the loss's gradient is scaled to meet the second rule.
        if self._sp_size == 1 or not self.model.training:
            return 1
        return self._sp_size if zero3_averages_over_sp_group(self.accelerator) else 1
