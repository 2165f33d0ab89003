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
"""Rollout batching, as TRL's GRPO does it: one rollout batch feeds `steps_per_generation` optimizer steps,
`num_iterations` times. The sampler repeats each rollout batch's rows once per micro-step that uses it; the first of
those micro-steps samples and scores the batch (synchronously, or takes the one sampled ahead), shuffles it and splits it
into micro-batches, which the following micro-steps consume."""

import torch
from datasets import IterableDataset
from trl.trainer.utils import RepeatSampler, repeat_iterable_dataset, shuffle_sequence_dict, split_tensor_dict

from .delta import TokenDelta


class RolloutBatchingMixin:
    """How a [`TVOPDTrainer`] turns its dataloader's batches into rollout batches and micro-batches (see the module's
    docstring)."""

    @property
    def _micro_batches_per_rollout(self):
        return self.args.gradient_accumulation_steps * self.args.steps_per_generation

    @property
    def _micro_steps_per_rollout(self):
        return self._micro_batches_per_rollout * self.args.num_iterations

    @property
    def _global_rollout_size(self):
        # An SP group is one data-parallel replica (`tvopd_trl.sequence_parallel`)
        return self.args.per_device_train_batch_size * self._data_parallel_size * self._micro_batches_per_rollout

    def get_train_dataloader(self):
        dataset = self.train_dataset
        if isinstance(dataset, IterableDataset):
            if self.shuffle_dataset:
                dataset = dataset.shuffle(seed=self.args.seed)
            dataset = repeat_iterable_dataset(
                dataset,
                mini_repeat_count=self.args.num_generations,
                batch_size=self._global_rollout_size // self.args.num_generations,
                repeat_count=self._micro_steps_per_rollout,
            )
        return self._get_dataloader(
            dataset=dataset,
            description="Training",
            # Each process samples its share of its SP group's rollout
            batch_size=self._train_batch_size * self._micro_batches_per_rollout // self._sp_size,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def _get_train_sampler(self, dataset=None):
        # Each rollout batch is yielded once per micro-step that uses it; `_prepare_inputs` generates on the first. A
        # prompt's `num_generations` samples are consecutive: GRPO's groups.
        return RepeatSampler(
            data_source=self.train_dataset if dataset is None else dataset,
            mini_repeat_count=self.args.num_generations,
            batch_size=self._global_rollout_size // self.args.num_generations,
            repeat_count=self._micro_steps_per_rollout,
            shuffle=self.shuffle_dataset,
            seed=self.args.seed,
        )

    def _active_tokens(self, batch):
        # Tokens the loss will use, as far as it is known before the loss pass: without precomputed pi_old, only a
        # missing teacher or sampler log-probability is known (a non-finite student log-probability there,
        # pathological, leaves its token in the count).
        old_logps = batch.get("old_logps")
        old_logps = torch.zeros_like(batch["teacher_logps"]) if old_logps is None else old_logps
        return TokenDelta.of_batch(batch, old_logps).active

    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            return self._generate_and_score_completions(generation_batch)
        micro_batches = self._micro_batches_per_rollout
        if self._step % self._micro_steps_per_rollout == 0:
            if self.args.max_staleness:
                generation_batch = self._take_rollout()  # sampled ahead; the dataloader's batch only paces the loop
            rollout = self._generate_and_score_completions(generation_batch)
            sequence_parallel = self._sequence_parallel
            rollout = (
                shuffle_sequence_dict(rollout) if sequence_parallel is None else sequence_parallel.shuffle(rollout)
            )
            self._buffered_inputs = split_tensor_dict(rollout, micro_batches)
            # The loss is a token mean over each optimizer step: count its active tokens over micro-batches and
            # processes once, so every micro-batch divides by the same exact total.
            local_counts = torch.stack([self._active_tokens(batch).sum() for batch in self._buffered_inputs])
            step_counts = (
                self.accelerator.reduce(
                    local_counts.view(self.args.steps_per_generation, -1).sum(dim=1), reduction="sum"
                )
                // self._sp_size
            )  # the processes of an SP group hold the same rows
            for index, batch in enumerate(self._buffered_inputs):
                batch["step_num_items"] = step_counts[index // self.args.gradient_accumulation_steps]
        return self._buffered_inputs[self._step % micro_batches]
