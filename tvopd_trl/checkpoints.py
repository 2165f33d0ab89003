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
"""Which checkpoints a run can resume from.

A process killed while `Trainer._save_checkpoint` writes leaves a `checkpoint-N` folder behind that transformers'
`get_last_checkpoint` would pick, and resuming from it fails or, worse, loads a partial state. transformers writes
`trainer_state.json` after the weights, optimizer, scheduler and RNG states, so a checkpoint is complete when that file
parses and the weights it needs are all there.
"""

import glob
import json
import os
import re
import shutil
import warnings

import torch


# Per process, in a checkpoint taken inside a rollout batch
ROLLOUT_STATE_NAME = "rollout_state_{process}.pt"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_WEIGHTS = ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin", "adapter_model.bin")
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Folders that hold the weights: DeepSpeed's, and FSDP's sharded state dict (transformers' `FSDP_MODEL_NAME`)
_WEIGHT_FOLDERS = ("global_step*", "pytorch_model_fsdp_*")
# The optimizer's state as transformers writes it: its own file, DeepSpeed's shards, FSDP's (accelerate's names)
_OPTIMIZER_STATES = ("optimizer.pt", "global_step*/*optim_states.pt", "optimizer.bin", "optimizer_*")


def heavy_parts(folder):
    """The paths of `folder`'s weights (sharded ones included) and optimizer and DeepSpeed/FSDP states: all but its
    records (configs, trainer state, tokenizer)."""
    # (DeepSpeed's optimizer shards go with their weight folder)
    optimizer = [pattern for pattern in _OPTIMIZER_STATES if "/" not in pattern]
    patterns = (*_WEIGHTS, "model-*.safetensors", *_WEIGHT_FOLDERS, *optimizer)
    return sorted({path for pattern in patterns for path in glob.glob(os.path.join(folder, pattern))})


def missing_parts(checkpoint):
    """What `checkpoint` lacks to be resumed from (an empty list when it is complete)."""
    missing = []
    try:
        with open(os.path.join(checkpoint, "trainer_state.json")) as f:
            json.load(f)
    except (OSError, ValueError):
        missing.append("a readable trainer_state.json")
    index = next((name for name in _INDEXES if os.path.isfile(os.path.join(checkpoint, name))), None)
    if index is not None:
        try:
            with open(os.path.join(checkpoint, index)) as f:
                shards = set(json.load(f)["weight_map"].values())
        except (OSError, ValueError, KeyError):
            missing.append(f"a readable {index}")
            shards = set()
        missing += [shard for shard in sorted(shards) if not os.path.isfile(os.path.join(checkpoint, shard))]
    elif not any(os.path.isfile(os.path.join(checkpoint, name)) for name in _WEIGHTS) and not any(
        glob.glob(os.path.join(checkpoint, pattern)) for pattern in _WEIGHT_FOLDERS
    ):
        missing.append("model weights")
    return missing


def has_optimizer_state(checkpoint):
    """Whether `checkpoint` holds the optimizer's state: not where it was saved with `save_only_model`."""
    return any(glob.glob(os.path.join(checkpoint, pattern)) for pattern in _OPTIMIZER_STATES)


def last_complete_checkpoint(output_dir):
    """The complete `checkpoint-N` of `output_dir` with the largest N, or None; warns about each newer incomplete one."""
    steps = sorted(
        (int(match.group(1)), name)
        for name in (os.listdir(output_dir) if os.path.isdir(output_dir) else [])
        if (match := _CHECKPOINT.match(name)) and os.path.isdir(os.path.join(output_dir, name))
    )
    for _, name in reversed(steps):
        path = os.path.join(output_dir, name)
        missing = missing_parts(path)
        if not missing:
            return path
        warnings.warn(
            f"{path} is incomplete (it lacks {', '.join(missing)}; the process was probably killed while saving it): "
            "resuming from an earlier checkpoint instead. It is left in place; delete it once the run is back.",
            stacklevel=2,
        )
    return None


def save_rollout_state(checkpoint, process_index, state):
    """Writes what a process needs to continue the rollout batch a checkpoint falls inside (`state`, with its
    `"layout"`: the batch settings it was cut with)."""
    torch.save(state, os.path.join(checkpoint, ROLLOUT_STATE_NAME.format(process=process_index)))


def load_rollout_state(checkpoint, process_index, layout, steps_per_rollout, device):
    """The rollout state this process saved in `checkpoint`, or None when the checkpoint is at a rollout boundary.

    Raises when the checkpoint falls inside a rollout batch that cannot be continued exactly: its file is missing
    (saved with other batch settings, or by an older tvopd-trl), or it was cut with another `layout`.
    """
    path = os.path.join(checkpoint, ROLLOUT_STATE_NAME.format(process=process_index))
    if not os.path.isfile(path):
        with open(os.path.join(checkpoint, "trainer_state.json")) as f:
            global_step = json.load(f)["global_step"]
        if global_step % steps_per_rollout:
            raise ValueError(
                f"{checkpoint} is at step {global_step}, inside a rollout batch of {steps_per_rollout} optimizer "
                f"steps (steps_per_generation x num_iterations), but has no {os.path.basename(path)} to continue it: "
                "it was saved with other batch settings or by an older tvopd-trl. Resume from a checkpoint at a "
                f"multiple of {steps_per_rollout} steps, or with the settings it was saved with."
            )
        return None
    state = torch.load(path, map_location=device, weights_only=True)
    if state["layout"] != layout:
        raise ValueError(
            f"{checkpoint} was saved inside a rollout batch laid out as {state['layout']}, but this run has {layout}. "
            "Resume with the settings it was saved with, or from a checkpoint at a rollout boundary."
        )
    return state


class RolloutCheckpointMixin:
    """
    How a [`TVOPDTrainer`] run checkpoints and resumes: from complete checkpoints only, and exactly inside a rollout
    batch.

    With steps_per_generation or num_iterations > 1, a checkpoint may fall between two optimizer steps that share one
    rollout batch. It then carries the rest of that batch and the batch's accumulators (the trainer's `_step`,
    `_buffered_inputs`, `rollout_scales`, `_rollout_tv` and `_rollout_grad_norm_finite`), so that a resumed run takes
    the same steps on the same tokens and updates the scheduler at the same steps as an uninterrupted one.
    """

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        """As [`~transformers.Trainer.train`], except that `resume_from_checkpoint=True` resumes from the last
        *complete* checkpoint (warning about newer ones a killed process left half-written), and that a given
        checkpoint is checked for completeness before anything loads from it."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No complete checkpoint-N in {self.args.output_dir} to resume from.")
        elif isinstance(resume_from_checkpoint, str):
            missing = missing_parts(resume_from_checkpoint)
            if missing:
                raise ValueError(
                    f"Cannot resume from {resume_from_checkpoint}: it lacks {', '.join(missing)}. Resume with "
                    "`resume_from_checkpoint=True` (`--resume_from_checkpoint last`) to use the last complete one."
                )
        if resume_from_checkpoint is not None and not has_optimizer_state(resume_from_checkpoint):
            # transformers would load the weights and the step, and go on with fresh AdamW moments and a schedule
            # restarted at its warmup, without a word
            raise ValueError(
                f"Cannot resume from {resume_from_checkpoint}: it holds the weights only (saved with "
                "`save_only_model: true`, as the paper recipes save their checkpoints for evaluation), not the "
                "optimizer and scheduler states a resume needs. Set `save_only_model: false` for checkpoints that "
                "resume exactly, or start a new run from these weights: `--model_name_or_path "
                f"{resume_from_checkpoint}` (fresh optimizer, schedule and step count)."
            )
        if resume_from_checkpoint is not None:
            self._load_rollout_state(resume_from_checkpoint)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)

    def _rollout_layout(self):
        args = self.args
        return {
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "steps_per_generation": args.steps_per_generation,
            "num_iterations": args.num_iterations,
            "num_processes": self.accelerator.num_processes,
        }

    def _save_rng_state(self, output_dir):
        # Each process saves its RNG state here, before transformers writes `trainer_state.json`: a checkpoint whose
        # trainer state exists has its rollout states too. At a rollout boundary the next step generates anew.
        super()._save_rng_state(output_dir)
        if self._step % self._micro_steps_per_rollout:
            state = {
                "layout": self._rollout_layout(),
                "step": self._step,
                "buffered_inputs": self._buffered_inputs,
                "scales": self.rollout_scales,
                "tv": self._rollout_tv,
                "grad_norm_finite": self._rollout_grad_norm_finite,
            }
            save_rollout_state(output_dir, self.accelerator.process_index, state)

    def _load_rollout_state(self, checkpoint):
        steps_per_rollout = self.args.steps_per_generation * self.args.num_iterations
        state = load_rollout_state(
            checkpoint,
            self.accelerator.process_index,
            self._rollout_layout(),
            steps_per_rollout,
            self.accelerator.device,
        )
        if state is None:
            self._step, self._buffered_inputs = 0, None
            return
        self._step = state["step"]
        self._buffered_inputs = state["buffered_inputs"]
        self.rollout_scales = state["scales"]
        self._rollout_tv = state["tv"]
        self._rollout_grad_norm_finite = state["grad_norm_finite"]

    def _save_checkpoint(self, model, trial):
        # TRL writes the run's card before each checkpoint; a copy inside the checkpoint describes the run up to that
        # step, so `tvopd-trl push` can publish any checkpoint with its own card.
        super()._save_checkpoint(model, trial)
        card = os.path.join(self.args.output_dir, "README.md")
        checkpoint = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        if self.is_world_process_zero() and os.path.isfile(card) and os.path.isdir(checkpoint):
            shutil.copy(card, checkpoint)
