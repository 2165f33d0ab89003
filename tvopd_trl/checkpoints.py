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
import warnings

import torch


# Per process, in a checkpoint taken inside a rollout batch
ROLLOUT_STATE_NAME = "rollout_state_{process}.pt"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_WEIGHTS = ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin", "adapter_model.bin")


def missing_parts(checkpoint):
    """What `checkpoint` lacks to be resumed from (an empty list when it is complete)."""
    missing = []
    try:
        with open(os.path.join(checkpoint, "trainer_state.json")) as f:
            json.load(f)
    except (OSError, ValueError):
        missing.append("a readable trainer_state.json")
    index = os.path.join(checkpoint, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                shards = set(json.load(f)["weight_map"].values())
        except (OSError, ValueError, KeyError):
            shards = {"model.safetensors.index.json"}
        missing += [shard for shard in sorted(shards) if not os.path.isfile(os.path.join(checkpoint, shard))]
    elif not any(os.path.isfile(os.path.join(checkpoint, name)) for name in _WEIGHTS) and not glob.glob(
        os.path.join(checkpoint, "global_step*")
    ):
        missing.append("model weights")
    return missing


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
