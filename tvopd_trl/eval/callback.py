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
"""In-training evaluation: benchmark accuracy every N optimizer steps, logged through `report_to`."""

import os
import shutil
import time
import warnings
from contextlib import contextmanager

from transformers import TrainerCallback
from trl.distributed import DistributedBackend
from trl.models.utils import unwrap_model_for_generation

from .accuracy import mean_at_k
from .benchmarks import get_benchmark, load_problems
from .evaluate import evaluate, evaluated_steps, step_dir
from .generation import SamplingSettings, local_generator
from .grading import DEFAULT_TIMEOUT_SECONDS


@contextmanager
def generation_model(trainer, model=None):
    """The trainer's student (or `model`, another model it prepared: a teacher), unwrapped to generate on every
    process at once, as TRL's trainers generate: under ZeRO-3 the student's weights are gathered when
    `ds3_gather_for_generation` (a teacher's are fetched layer by layer in each forward: DeepSpeed gives a model without
    an optimizer no hooks to lift), under FSDP1 they are summoned, and under FSDP2 each forward gathers them."""
    gather = model is None and trainer.args.ds3_gather_for_generation
    model = trainer.model_wrapped if model is None else model
    with (
        unwrap_model_for_generation(
            model,
            trainer.accelerator,
            gather_deepspeed3_params=gather,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as unwrapped,
        DistributedBackend(trainer.accelerator).summon_full_params(model, recurse=False),
    ):
        yield unwrapped


class BenchmarkEvalCallback(TrainerCallback):
    """
    Evaluates the model being trained on `benchmarks` every `eval_every_steps` optimizer steps (and before the first
    step when `at_start`), at the paper's training-dynamics protocol by default (mean@4 at T=0.6, top-p 0.95, top-k
    20).

    Each evaluation logs `eval/<benchmark>/mean@k` with that step's training metrics (so through `report_to`), and
    writes its records to `<output_dir>/eval/mean@<k>/step-<N>/`, beside the checkpoints, where `tvopd-trl select` and
    `tvopd-trl report` read them.

    Every process takes part: each generates and grades its shard of the batches of `batch_size` responses, and the
    graded records are gathered (see [`evaluate`]). Under ZeRO-3 the weights are gathered for generation as TRL's
    trainers do (`unwrap_model_for_generation`, following `ds3_gather_for_generation`), under FSDP1 they are
    summoned, and under FSDP2 each forward gathers them. A score equals that of `tvopd-trl eval` on the checkpoint
    saved at the same step with the same settings, limit and `--batch_size` (docs/evaluation.md).

    ```python
    trainer = TVOPDTrainer(...)
    trainer.add_callback(BenchmarkEvalCallback(trainer, ["aime24", "aime25"], eval_every_steps=25, data_dir="data"))
    ```
    """

    def __init__(
        self,
        trainer,
        benchmarks,
        eval_every_steps,
        settings=None,
        *,
        at_start=True,
        data_dir=None,
        limit=None,
        prompt_template=None,
        batch_size=64,
        workers=2,
        timeout_seconds=DEFAULT_TIMEOUT_SECONDS,
    ):
        if eval_every_steps < 1:
            raise ValueError(f"`eval_every_steps` must be at least 1 (got {eval_every_steps}).")
        self.trainer, self.eval_every_steps, self.at_start = trainer, eval_every_steps, at_start
        self.benchmarks = [get_benchmark(name) for name in benchmarks]
        for benchmark in self.benchmarks:  # bad names and files fail now, not after hours of training
            load_problems(benchmark, data_dir, limit)
        self.settings = settings or SamplingSettings(k=4)
        self.options = dict(
            data_dir=data_dir,
            limit=limit,
            prompt_template=prompt_template,
            workers=workers,
            timeout_seconds=timeout_seconds,
        )
        self.batch_size = batch_size
        self.history = []  # (step, results) of each evaluation, in order

    def _evaluate(self, args, state):
        trainer = self.trainer
        with generation_model(trainer) as model:
            results = evaluate(
                local_generator(self.benchmarks, model, trainer.processing_class, self.batch_size),
                self.benchmarks,
                self.settings,
                step_dir(args.output_dir, state.global_step, self.settings.k),
                model=os.path.abspath(args.output_dir),
                metadata={"step": state.global_step},
                accelerator=trainer.accelerator,
                **self.options,
            )
        self.history.append((state.global_step, results))
        k = self.settings.k
        return {f"eval/{b.name}/mean@{k}": mean_at_k(results["benchmarks"][b.name]) for b in self.benchmarks}

    def on_train_begin(self, args, state, control, **kwargs):
        self._set_aside_later_evaluations(args, state)
        if self.at_start and state.global_step == 0:
            self.trainer.log(self._evaluate(args, state))

    def _set_aside_later_evaluations(self, args, state):
        """On every process, so that an error stops them all; the main process moves the files."""
        later = [step for step in evaluated_steps(args.output_dir, self.settings.k) if step > state.global_step]
        if later and state.global_step > 0:
            # A resume: the interrupted run evaluated past its last checkpoint, and this run redoes those steps.
            if not state.is_world_process_zero:
                return
            kept = os.path.join(args.output_dir, f"eval-superseded-{time.strftime('%Y%m%d-%H%M%S')}")
            for step in later:
                source = step_dir(args.output_dir, step, self.settings.k)
                shutil.move(source, os.path.join(kept, os.path.relpath(source, os.path.join(args.output_dir, "eval"))))
            warnings.warn(
                f"Resuming from step {state.global_step}: the interrupted run's mean@{self.settings.k} evaluations of "
                f"steps {later} will be redone; the old ones were moved to {kept}.",
                stacklevel=3,
            )
        elif later:  # a fresh run in an output_dir that holds another run's evaluations
            raise ValueError(
                f"{args.output_dir} holds mean@{self.settings.k} evaluations of steps {later}, beyond step "
                f"{state.global_step} where this run starts: they belong to an earlier run. Use a fresh output_dir, "
                f"or move {os.path.join(args.output_dir, 'eval')} away."
            )

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.eval_every_steps != 0:
            return
        # Every process evaluates and records the same scores, as the trainer's own metrics are reduced before logging.
        for key, value in self._evaluate(args, state).items():
            # Recorded, not logged now: the scores land in this step's log, beside the loss.
            self.trainer.record_metric(key, value)
        control.should_log = True  # on every process: the log gathers the loss across them
