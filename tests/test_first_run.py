"""The README's first command prints no warning its user could do nothing about; what a user passes still wins.

`tvopd-trl train --config recipes/tiny/tvopd.yaml` used to print accelerate's "values were not passed to `accelerate
launch`" block, transformers' `gradient_checkpointing` FutureWarning (once per process) and torch's `pin_memory`
warning on a machine without an accelerator. The main job now passes what it knows instead. It also printed
DeepSpeed's "Setting accelerator to CPU" (DeepSpeed is imported by accelerate, not used), TRL's use of the deprecated
`is_gradient_checkpointing` and transformers' "Loading weights" bars: `tvopd_trl.console.quiet` turns those off.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .timeouts import time_limit


REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "tiny" / "tvopd.yaml"
ACCELERATE_CONFIG = REPO / "recipes" / "accelerate_configs" / "ddp_cpu.yaml"
# A distinctive substring of each warning the first run used to print.
AVOIDABLE_WARNINGS = {
    "accelerate launch defaults": "were not passed to `accelerate launch`",
    "transformers gradient_checkpointing": "`gradient_checkpointing` is deprecated",
    "torch pin_memory": "pin_memory",
    "DeepSpeed accelerator detection": "Setting accelerator to CPU",
    "TRL's is_gradient_checkpointing": "`is_gradient_checkpointing` is deprecated",
    "transformers weight loading bars": "Loading weights",
    "transformers weight writing bars": "Writing model shards",
    # printed on import of transformers' trackers module under WANDB_MODE=offline, whatever `report_to` says
    "transformers' wandb offline notice": "Running in WANDB offline mode",
}


@pytest.mark.skipif(
    torch.accelerator.device_count() > 1, reason="with several devices accelerate starts one process each, and says so"
)
@pytest.mark.parametrize("recipe", [["--config", str(RECIPE)], []], ids=["README command", "embedded default"])
@pytest.mark.compat_skip  # the warnings of the stack the README installs, the newest
def test_first_run_prints_none_of_the_avoidable_warnings(recipe, tmp_path):
    # The embedded default runs from a directory without the checkout, as an installed package's user would.
    cwd = REPO if recipe else tmp_path
    command = [sys.executable, "-m", "tvopd_trl.cli", "train", *recipe, "--output_dir", str(tmp_path / "run")]
    command += ["--max_steps", "2", "--eval_problems", "4", "--eval_every_steps", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}  # the recipes report to none
    result = subprocess.run(command, capture_output=True, text=True, timeout=time_limit(300), cwd=cwd, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert (tmp_path / "run" / "summary.json").exists()
    printed = {name: substring for name, substring in AVOIDABLE_WARNINGS.items() if substring in output}
    assert not printed, f"the first run printed {sorted(printed)}:\n{output[-3000:]}"
    assert "TV-OPD main job (tv, 2 steps)" in output and "Traceback" not in output


def _launched(argv, monkeypatch, recipe=RECIPE):
    """The `accelerate launch` arguments `tvopd-trl train --config RECIPE ARGV` would launch with."""
    import accelerate.commands.launch

    from tvopd_trl import cli

    launched = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", launched.append)
    assert cli.main(["train", "--config", str(recipe), *argv]) == 0
    (args,) = launched
    return args


def _without_default_accelerate_config(monkeypatch, tmp_path):
    # A developer's `accelerate config` file would be read instead (and nothing filled in): keep it out of the way.
    import accelerate.commands.config

    monkeypatch.setattr(accelerate.commands.config, "default_config_file", str(tmp_path / "none.yaml"))


@pytest.mark.skipif(
    torch.accelerator.device_count() > 1, reason="with several devices accelerate's own process count is kept"
)
def test_launch_gets_the_values_accelerate_would_default_to(monkeypatch, tmp_path):
    _without_default_accelerate_config(monkeypatch, tmp_path)
    args = _launched(["--output_dir", str(tmp_path)], monkeypatch)
    assert (args.num_processes, args.num_machines, args.mixed_precision, args.dynamo_backend) == (1, 1, "no", "no")


def test_launch_mixed_precision_follows_bf16(monkeypatch, tmp_path):
    _without_default_accelerate_config(monkeypatch, tmp_path)
    # `use_cpu`: transformers refuses bf16 at config construction on a machine without a GPU otherwise.
    args = _launched(["--output_dir", str(tmp_path), "--bf16", "true", "--use_cpu", "true"], monkeypatch)
    assert args.mixed_precision == "bf16"


def test_what_the_user_passes_to_accelerate_wins(monkeypatch, tmp_path):
    _without_default_accelerate_config(monkeypatch, tmp_path)
    argv = ["--output_dir", str(tmp_path), "--num_processes", "2", "--mixed_precision", "fp16", "--num_machines", "1"]
    args = _launched(argv, monkeypatch)
    assert (args.num_processes, args.mixed_precision, args.dynamo_backend) == (2, "fp16", "no")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.read_text() + "num_processes: 2\n")
    args = _launched(["--output_dir", str(tmp_path)], monkeypatch, recipe)
    assert args.num_processes == 2


def test_an_accelerate_config_file_is_left_to_fill_in_the_rest(monkeypatch, tmp_path):
    args = _launched(["--output_dir", str(tmp_path), "--accelerate_config", str(ACCELERATE_CONFIG)], monkeypatch)
    assert args.config_file == str(ACCELERATE_CONFIG)
    # accelerate reads these from the file only where they are still unset
    assert (args.num_processes, args.num_machines, args.mixed_precision, args.dynamo_backend) == (None,) * 4


@pytest.mark.parametrize(
    "accelerator, recipe_value, flags, pinned",
    [
        (False, None, [], False),
        (False, "true", [], True),
        (False, None, ["--dataloader_pin_memory", "true"], True),
        (True, None, [], True),
    ],
)
def test_pinned_memory_is_off_without_an_accelerator_unless_asked_for(
    accelerator, recipe_value, flags, pinned, monkeypatch, tmp_path
):
    from tvopd_trl.scripts import train

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: accelerator)
    parsed = []
    monkeypatch.setattr(
        train, "main", lambda job_args, training_args, model_args: parsed.append(training_args)
    )  # no training
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.read_text() + (f"dataloader_pin_memory: {recipe_value}\n" if recipe_value else ""))
    assert train.run(["--config", str(recipe), "--output_dir", str(tmp_path), *flags]) == 0
    (training_args,) = parsed
    assert training_args.dataloader_pin_memory is pinned
