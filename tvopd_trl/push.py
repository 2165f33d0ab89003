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
"""Publishing a finished run to the Hub (`tvopd-trl push`): its selected checkpoint, in one commit, with its model card.

The checkpoint is the one `tvopd-trl select` recorded in `RUN_DIR/selection.json` (the paper's selection rule), or
`checkpoint`, or else the run's final model. Its model card is the one the trainer wrote when it saved that
checkpoint, with a paragraph on how it was selected. One commit uploads the weights, config, tokenizer and card;
optimizer, scheduler and RNG states stay local. The run directory is only read, never written.
"""

import glob
import json
import os

from .model_card import insert_section


# Training internals: needed to resume, not to use the model.
IGNORE_PATTERNS = (
    "optimizer.pt",
    "scheduler.pt",
    "scaler.pt",
    "rng_state*.pth",
    "global_step*",
    "latest",
    "zero_to_fp32.py",
)
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors", "pytorch_model.bin")


class PushError(RuntimeError):
    """The Hub refused or could not be reached; the run directory is unchanged."""


def resolve_checkpoint(run_dir, checkpoint=None):
    """(folder to upload, how it was chosen, the `selection.json` record or None)."""
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"{run_dir} is not a directory: give the run's `output_dir`.")
    if checkpoint is not None:
        return checkpoint, f"`{checkpoint}`, given on the command line", None
    selection_path = os.path.join(run_dir, "selection.json")
    if os.path.isfile(selection_path):
        with open(selection_path) as f:
            selection = json.load(f)
        folder = selection.get("checkpoint")
        if folder is None:
            raise FileNotFoundError(
                f"{selection_path} selects step {selection['step']}, but the run has no checkpoint-{selection['step']} "
                "folder (it was not saved, or was rotated out by `save_total_limit`). Pass --checkpoint to upload "
                "another one."
            )
        return folder, f"step {selection['step']}, chosen by `tvopd-trl select`: {selection['rule']}", selection
    return (
        run_dir,
        "the run's final model (no selection.json: run `tvopd-trl select` to upload the selected one)",
        None,
    )


def _check_model_folder(folder):
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder} does not exist.")
    names = set(os.listdir(folder))
    if not names & {*_WEIGHTS, "adapter_config.json"} and not glob.glob(os.path.join(folder, "model-*.safetensors")):
        hint = ""
        if any(name.startswith("global_step") for name in names):
            hint = (
                " It holds DeepSpeed ZeRO shards only: consolidate them with the folder's `zero_to_fp32.py`, or train "
                "with `stage3_gather_16bit_weights_on_model_save: true` (as recipes/accelerate_configs/zero3.yaml does)."
            )
        raise FileNotFoundError(f"{folder} holds no model weights (looked for {', '.join(_WEIGHTS)}).{hint}")


def model_card(run_dir, folder, chosen, selection):
    """The card to upload: the one saved with the checkpoint (or the run's), plus how this checkpoint was chosen."""
    for path in (os.path.join(folder, "README.md"), os.path.join(run_dir, "README.md")):
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                card = f.read()
            break
    else:
        card = f"# {os.path.basename(os.path.abspath(run_dir))}\n"
    lines = ["## Selected checkpoint", "", f"This repository holds {chosen}."]
    if selection is not None:
        lines += ["", f"| benchmark | mean@{selection['k']} |", "| --- | ---: |"]
        lines += [f"| {name} | {100 * score:.1f} |" for name, score in selection["scores"].items()]
        lines += [f"| **average** | **{100 * selection['mean']:.1f}** |"]
    return insert_section(card, "\n".join(lines) + "\n")


def push_run(
    run_dir,
    repo_id,
    checkpoint=None,
    private=None,
    revision=None,
    commit_message=None,
    token=None,
):
    """Uploads the run's selected checkpoint to `repo_id` in one commit and returns the commit's URL."""
    from huggingface_hub import CommitOperationAdd, HfApi, constants
    from huggingface_hub.errors import HTTPError
    from huggingface_hub.utils import filter_repo_objects

    folder, chosen, selection = resolve_checkpoint(run_dir, checkpoint)
    _check_model_folder(folder)
    card = model_card(run_dir, folder, chosen, selection)
    files = [os.path.relpath(os.path.join(root, name), folder) for root, _, names in os.walk(folder) for name in names]
    files = list(filter_repo_objects(files, ignore_patterns=[*IGNORE_PATTERNS, "README.md"]))
    operations = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=os.path.join(folder, path)) for path in files]
    operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode("utf-8")))
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message
            or f"Upload {chosen.split(',')[0]} of {os.path.basename(os.path.abspath(run_dir))}",
            revision=revision,
        )
    except (OSError, HTTPError) as error:  # HTTP statuses, refused connections, offline mode
        raise PushError(
            f"could not push {folder} to {repo_id} at {constants.ENDPOINT}: {type(error).__name__}: {error}\n"
            f"Nothing under {run_dir} was changed. Check the network (and that HF_HUB_OFFLINE is not set), and that a "
            "token with write access is available (--token, HF_TOKEN, or `hf auth login`)."
        ) from error
    return commit.commit_url
