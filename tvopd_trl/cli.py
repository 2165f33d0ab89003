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
"""The `tvopd-trl` console command.

- `tvopd-trl train --config recipe.yaml [accelerate and training flags]`: like `trl sft`, it runs the training script
  through `accelerate launch`; flags the script does not know (e.g. `--num_processes 2`, or `--accelerate_config
  zero3` for one of TRL's shipped configs) go to accelerate.
- `tvopd-trl eval --model PATH --benchmarks aime24,math500 --k 16`: the paper's evaluation (`tvopd_trl.eval`).
- `tvopd-trl select RUN_DIR [RUN_DIR ...]`: the paper's checkpoint selection over saved evaluations.
- `tvopd-trl report --method NAME=RUN_DIR,... --output_dir DIR`: its tables and training curves.
- `tvopd-trl push RUN_DIR --repo_id USER/NAME`: uploads a run's selected checkpoint, with its model card, to the Hub.
- `tvopd-trl doctor --config recipe.yaml`: checks a teacher/student pair for silent teacher-scoring bugs.
- `tvopd-trl study --config study.yaml`: a resumable (method x seed) grid and the paper's tables and figures.
"""

import importlib
import sys
from argparse import ArgumentParser


def _subtract_subsequence(items, subsequence):
    remaining = iter(subsequence)
    current = next(remaining, None)
    kept = []
    for item in items:
        if current is not None and item == current:
            current = next(remaining, None)
        else:
            kept.append(item)
    return kept


def _accelerate_launch_args(config_remaining, cli_remaining):
    """`accelerate launch` flags: the recipe's and the command line's keys that the script does not know, with
    `--accelerate_config NAME_OR_PATH` turned into `--config_file PATH`. Fails on a config that does not exist."""
    import importlib.resources as resources
    from pathlib import Path

    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    if "--accelerate_config" in config_remaining and "--accelerate_config" in cli_remaining:
        # The command line wins over the recipe, as for every other key (TRL would resolve the recipe's value and
        # leave the flag to `accelerate launch`, which rejects it).
        index = config_remaining.index("--accelerate_config")
        config_remaining = config_remaining[:index] + config_remaining[index + 2 :]
    flags = config_remaining + cli_remaining
    if "--accelerate_config" in flags[:-1]:
        index = flags.index("--accelerate_config")
        value = flags[index + 1]
        shipped = resources.files("trl.accelerate_configs")
        if not Path(value).is_file() and not shipped.joinpath(f"{value}.yaml").is_file():
            # TRL's own message names neither the recipe nor the names it accepts.
            names = sorted(
                entry.name.removesuffix(".yaml") for entry in shipped.iterdir() if entry.name.endswith(".yaml")
            )
            source = "the recipe's `accelerate_config`" if index < len(config_remaining) else "--accelerate_config"
            raise ValueError(
                f"{source} {value!r} is neither a file nor one of TRL's accelerate configs ({', '.join(names)}). "
                "Name one of those, or give the path of a YAML file, such as recipes/accelerate_configs/zero3.yaml "
                "(a relative path starts from the current directory)."
            )
    return resolve_accelerate_config_argument(flags)


def _fill_launch_defaults(launch, training_args):
    """Passes `accelerate launch` (its parsed arguments, `launch`) the values it would otherwise default to, and warn
    about ("The following values were not passed to `accelerate launch` and had defaults used instead"), without
    changing what it does: one machine, no dynamo, the recipe's mixed precision (`bf16`/`fp16`, which the Trainer uses
    whatever the launcher says) and one process where accelerate would start one anyway. Whatever the user passed
    wins, and so does an accelerate config file (`--accelerate_config`, or the default one `accelerate config`
    writes): then nothing is filled in, and accelerate does not warn."""
    import os

    import torch
    from accelerate.commands.config import default_config_file

    if launch.config_file is not None or (os.path.isfile(default_config_file) and not launch.cpu):
        return launch
    if launch.num_machines is None:
        launch.num_machines = 1
    if launch.dynamo_backend is None:
        launch.dynamo_backend = "no"
    if launch.mixed_precision is None:
        launch.mixed_precision = "fp16" if training_args.fp16 else "bf16" if training_args.bf16 else "no"
    # Without a count, accelerate starts one process per accelerator device (one process without a device), or the
    # device count for a distributed mode; several devices also get a notice worth reading. Only the one-process case
    # is filled in. `--cpu` keeps accelerate's choice too: a count of 1 would switch on its CPU-thread heuristic.
    devices = torch.accelerator.device_count()
    modes = ("multi_gpu", "use_deepspeed", "use_fsdp", "use_megatron_lm", "tpu", "cpu")
    if launch.num_processes is None and devices <= 1 and not any(getattr(launch, mode, False) for mode in modes):
        launch.num_processes = 1
    return launch


COMMANDS = {
    "train": "run the TV-OPD main job",
    "eval": "evaluate a model or a run's checkpoints on benchmarks",
    "select": "select each run's checkpoint",
    "report": "tables and curves from runs' evaluations",
    "push": "upload a run's selected checkpoint to the Hub",
    "doctor": "check a teacher/student pair for silent teacher-scoring bugs",
    "study": "run a (method x seed) grid and write the paper's tables and figures",
}


def command_parser(command):
    """The argument parser of `tvopd-trl COMMAND` (docs/cli.md is generated from these)."""
    if command in ("select", "report"):
        from .scripts.report import make_parser

        return make_parser(command)
    module = importlib.import_module(f".scripts.{'evaluate' if command == 'eval' else command}", __package__)
    return module.make_parser(prog=f"tvopd-trl {command}")


def main(argv=None) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser

    from .scripts.train import check_launch_options, make_parser

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = ArgumentParser(prog="tvopd-trl", allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=COMMANDS, help="; ".join(f"`{c}`: {h}" for c, h in COMMANDS.items()))
    if not argv or argv[0] not in COMMANDS:
        parser.print_help()
        return 0 if not argv else 2
    command, script_argv = argv[0], argv[1:]
    if command != "train":
        from .scripts import doctor, evaluate, push, report, study

        runners = {"eval": evaluate.run, "push": push.run, "doctor": doctor.run, "study": study.run}
        try:
            status = runners[command](script_argv) if command in runners else report.run(command, script_argv)
        except (ValueError, FileNotFoundError, push.PushError) as error:  # the message says what to fix
            print(f"tvopd-trl {command}: error: {error}", file=sys.stderr)
            return 2
        return status if isinstance(status, int) else 0  # `doctor` returns 1 when a check fails
    # Parses (and validates) the script's own flags; whatever it does not know goes to `accelerate launch`. Both fail
    # here, on bad input, before any process starts or any model loads.
    try:
        _, training_args, config_remaining, cli_remaining = make_parser(prog="tvopd-trl train").parse_args_and_config(
            script_argv, return_remaining_strings=True, separate_remaining_strings=True
        )
        check_launch_options(config_remaining + cli_remaining)
        launch_args = _accelerate_launch_args(config_remaining, cli_remaining)
    except ValueError as error:
        print(f"tvopd-trl train: error: {error}", file=sys.stderr)
        return 2
    script_args = _subtract_subsequence(script_argv, cli_remaining)
    launch = launch_command_parser().parse_args([*launch_args, "-m", "tvopd_trl.scripts.train", *script_args])
    launch_command(_fill_launch_defaults(launch, training_args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
