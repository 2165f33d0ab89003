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

import warnings

import torch
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from . import bucketed_step
from .tv import TVScheduler


_CONFIG_NAMES = ("tv_alpha", "tv_ema_decay", "tv_min_scale", "tv_eps")


class TVScheduleCallback(TrainerCallback, ExportableState):
    """
    Holds the [`TVScheduler`] of a [`TVOPDTrainer`] run, or one per teacher, and carries their state through checkpoints.

    The trainer reads the scales at the first step of each rollout batch and updates the schedulers after the last
    optimizer step that uses it. Being an `ExportableState`, the schedulers are written into every checkpoint's
    `trainer_state.json`; on resume with `restore_callback_states_from_checkpoint=True`, transformers rebuilds this
    callback from those arguments, so the trainer always looks the instance up afresh instead of keeping a reference.

    Args:
        alpha, ema_decay, min_scale, eps:
            The schedulers' hyperparameters (see [`TVScheduler`]).
        reference_min_tokens (`int`, *optional*, defaults to `0`):
            The teachers' schedulers' `reference_min_tokens` (`tv_reference_min_tokens`). The pooled scheduler keeps
            the paper's rule: every rollout batch feeds it all its rows, the first one included.
        scheduler_state (`dict`, *optional*):
            The pooled scheduler's state, to restore.
        teacher_states (`dict[str, dict | None]`, *optional*):
            With a scale per teacher (`tv_scale_per_teacher`): each teacher's name -> its scheduler's state to restore
            (`None` for a fresh one). The pooled scheduler is then not used.
    """

    def __init__(
        self,
        alpha: float = 0.5,
        ema_decay: float = 0.95,
        min_scale: float = 0.1,
        eps: float = 1e-5,
        scheduler_state: dict | None = None,
        teacher_states: dict | None = None,
        reference_min_tokens: int = 0,
    ):
        hyperparameters = dict(alpha=alpha, ema_decay=ema_decay, min_scale=min_scale, eps=eps)
        self.scheduler = TVScheduler(**hyperparameters)
        if scheduler_state is not None:
            self.scheduler.load_state_dict(scheduler_state)
        # A checkpoint of an earlier version has no `reference_min_tokens`: 0 resumes it as it ran
        self.reference_min_tokens = reference_min_tokens
        self.teacher_schedulers = {}
        for name, state in (teacher_states or {}).items():
            self.teacher_schedulers[name] = TVScheduler(**hyperparameters, reference_min_tokens=reference_min_tokens)
            if state is not None:
                self.teacher_schedulers[name].load_state_dict(state)

    def on_train_begin(self, args, state, control, **kwargs):
        # A resumed run keeps the checkpoint's scheduler, hyperparameters included: say so if the config disagrees.
        scheduler = self.scheduler
        stored = (scheduler.alpha, scheduler.ema_decay, scheduler.min_scale, scheduler.eps)
        stored = dict(zip(_CONFIG_NAMES, stored, strict=True))
        if self.teacher_schedulers:
            stored["tv_reference_min_tokens"] = self.reference_min_tokens
        configured = {name: getattr(args, name, value) for name, value in stored.items()}
        if configured != stored:
            warnings.warn(
                f"The TV scheduler restored from the checkpoint has ({', '.join(stored)}) = {tuple(stored.values())}, "
                f"but the config says {tuple(configured.values())}. The run continues with the checkpoint's values.",
                stacklevel=2,
            )

    def state(self) -> dict:
        scheduler = self.scheduler
        args = {
            "alpha": scheduler.alpha,
            "ema_decay": scheduler.ema_decay,
            "min_scale": scheduler.min_scale,
            "eps": scheduler.eps,
            "scheduler_state": scheduler.state_dict(),
        }
        if self.teacher_schedulers:
            args["teacher_states"] = {name: s.state_dict() for name, s in self.teacher_schedulers.items()}
            args["reference_min_tokens"] = self.reference_min_tokens
        return {"args": args, "attributes": {}}


class UpdateNormCallback(TrainerCallback):
    """
    Logs `update/norm`, the norm of an optimizer step's realised parameter change ||theta_k+1 - theta_k||, through
    `trainer.record_metric`, on every `args.update_norm_interval`-th optimizer step (the first included); the other
    steps take no copy and run as without it.

    With a torch optimizer that steps each parameter on its own (`bucketed_step.PER_PARAMETER_OPTIMIZERS`, without a
    gradient scaler), the logged step runs in buckets of parameters (`bucketed_step.step_in_buckets`): the extra memory
    is one bucket, about 1/64 of the trainable parameters; a larger parameter is stepped in flat slices of that size by
    an elementwise optimizer (AdamW, SGD, ...), whole by the others. The value equals the copy's to float32 rounding
    (bit for bit where no parameter is sliced), and the step is unchanged, bit for bit. Otherwise it holds one copy of
    the trainable parameters (of the local shard when sharded), taken just before `optimizer.step()` so that it never
    sits beside the activations, and turned into the update in place right after; DeepSpeed's engine steps inside the
    last micro-batch's backward, so there the copy is taken at the step's start. [`TVOPDTrainer`] adds it when
    `log_update_norm` is on.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.before = None  # the copy of all parameters
        self.squares = None  # or each parameter's squared update from the bucketed step
        self.unwrap = None  # restores the optimizer's `step` the bucketed step replaced

    def _parameters(self):
        return [p for p in self.trainer.model.parameters() if p.requires_grad]

    def _snapshot(self):
        self.before = bucketed_step.clone_locals(self._parameters())

    def on_step_begin(self, args, state, control, **kwargs):
        if self.trainer.is_deepspeed_enabled and state.global_step % args.update_norm_interval == 0:
            self._snapshot()

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self.trainer.is_deepspeed_enabled or state.global_step % args.update_norm_interval != 0:
            return
        if bucketed_step.steps_in_buckets(optimizer):
            self._wrap_step(optimizer.optimizer)
        else:
            self._snapshot()

    def _wrap_step(self, optimizer):
        """Replaces `optimizer.step` (the class's, or the learning-rate scheduler's counting wrapper: whatever is there)
        for this one step by its bucketed run."""
        step, own = optimizer.step, "step" in vars(optimizer)

        def unwrap():
            if own:
                optimizer.step = step
            else:
                del optimizer.step
            self.unwrap = None

        def step_in_buckets(closure=None):
            unwrap()
            loss = None
            if closure is not None:  # evaluated once, as the optimizer would, not once per bucket
                with torch.enable_grad():
                    loss = closure()
            parameters = [p for group in optimizer.param_groups for p in group["params"]]
            self.squares = bucketed_step.step_in_buckets(optimizer, step, parameters)
            return loss

        optimizer.step, self.unwrap, self.squares = step_in_buckets, unwrap, {}

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.unwrap is not None:  # the step never reached the optimizer
            self.unwrap()
        parameters = self._parameters()
        if self.before is not None:
            squares = bucketed_step.squared_updates(parameters, self.before)
        elif self.squares is not None:
            # The model's order, as the copy sums them
            squares = [self.squares[p] for p in parameters if p in self.squares]
        else:
            return  # not a logged step
        self.before = self.squares = None
        squared = sum(squares)
        accelerator = self.trainer.accelerator
        squared = torch.as_tensor(squared, device=accelerator.device, dtype=torch.float32)
        if any(isinstance(p, DTensor) or hasattr(p, "ds_tensor") for p in parameters):
            squared = accelerator.reduce(squared, reduction="sum")  # shards add up; replicas don't
        self.trainer.record_metric("update/norm", squared.sqrt().item())


def _decouples_weight_decay(optimizer, group):
    """Whether `optimizer` (AdamW and its kin) shrinks the weights by lr * weight_decay outside the gradient."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    return isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))


class LearningRateScaleCallback(TrainerCallback):
    """
    With `tv_scale_target="learning_rate"`, multiplies each optimizer step's learning rate by the c_k of its rollout
    batch (`trainer.rollout_scale`), and restores the schedule's value right after the step.

    AdamW normalises away a slowly changing scale of the loss, but not one of the learning rate. Its decoupled weight
    decay shrinks the weights by lr * weight_decay, so `weight_decay` is divided by c_k for the step: as with c_k on the
    advantage, only the teacher's signal is scaled (docs/method.md, section 4).
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.unscaled = None

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        scale = self.trainer.rollout_scale
        self.unscaled = [(group["lr"], group.get("weight_decay")) for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] *= scale
            if group.get("weight_decay") and _decouples_weight_decay(optimizer, group):
                group["weight_decay"] /= scale

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        for group, (learning_rate, decay) in zip(optimizer.param_groups, self.unscaled, strict=True):
            group["lr"] = learning_rate
            if decay is not None:
                group["weight_decay"] = decay
        self.unscaled = None
