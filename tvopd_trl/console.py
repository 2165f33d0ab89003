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
"""What the commands print: one line per user error, and none of the warnings a user cannot act on.

Used by `tvopd-trl` (`tvopd_trl.cli`) and by the training script it launches, never on import of the library: a
program that imports `tvopd_trl` keeps its own warnings, progress bars and tracebacks.
"""

import logging
import os
import sys
import warnings
from argparse import ArgumentParser


DEBUG_VARIABLE = "TVOPD_TRL_DEBUG"


def debugging():
    """Whether user errors show their traceback (`tvopd-trl --debug ...` or `TVOPD_TRL_DEBUG=1`)."""
    return os.environ.get(DEBUG_VARIABLE, "").lower() not in ("", "0", "false", "no")


def user_errors():
    """The exceptions whose message tells the user what to fix: bad values (`ValueError`), missing files and folders,
    unreachable Hubs and servers (`OSError`, which covers `ConnectionError` and transformers' "can't load" errors), a
    missing optional dependency (`ImportError`: vLLM, DeepSpeed) and a failed push."""
    from .push import PushError

    return (ValueError, OSError, ImportError, PushError)


def report_errors(prog, run, argv=None):
    """`run(argv)`'s exit status, or 2 after one line `{prog}: error: ...` on stderr for a user error (its traceback
    too when `debugging()`)."""
    try:
        return run(argv)
    except BrokenPipeError:  # `tvopd-trl recipes | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return 1
    except user_errors() as error:
        if debugging():
            raise
        # transformers' and the Hub's messages span lines; one line is what a terminal user reads.
        print(f"{prog}: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2


class OneLineErrors(ArgumentParser):
    """An argument parser whose errors are one line, without the usage block (hundreds of lines for `tvopd-trl train`,
    which takes every `TrainingArguments` flag)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


class _DropRecords(logging.Filter):
    def __init__(self, *prefixes):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record):
        return not record.getMessage().startswith(self.prefixes)


def quiet():
    """Turns off what a command line user cannot act on. Each is named here with where it comes from."""
    # TRL 1.16's `unwrap_model_for_generation` reads `model.is_gradient_checkpointing`, which transformers >= 5.20
    # deprecates: one FutureWarning per process at the first rollout, about TRL's code.
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        # accelerate imports DeepSpeed whenever it is installed (`extract_model_from_parallel`), and DeepSpeed's
        # accelerator detection warns "Setting accelerator to CPU" on a machine without a GPU, in runs that do not
        # use DeepSpeed at all. The filter goes on DeepSpeed's logger before DeepSpeed creates it: importing DeepSpeed
        # here to quiet it would add the import to every command.
        logging.getLogger("DeepSpeed").addFilter(_DropRecords("Setting accelerator to CPU"))
    # transformers' per-model "Loading weights" and "Writing model shards" bars. The training progress bar is the
    # Trainer's own tqdm; downloads keep the Hub's bars, which transformers' switch turns off with its own.
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    hub_bars = not are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()
    if hub_bars:
        enable_progress_bars()
