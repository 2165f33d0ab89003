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

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .tv import TVScheduler


_CONFIG_NAMES = ("tv_alpha", "tv_ema_decay", "tv_min_scale", "tv_eps")


class TVScheduleCallback(TrainerCallback, ExportableState):
    """
    Holds the [`TVScheduler`] of a [`TVOPDTrainer`] run and carries its state through checkpoints.

    The trainer reads `scheduler.scale` at the first step of each rollout batch and calls `scheduler.update` after the
    last optimizer step that uses it. Being an `ExportableState`, the scheduler is written into every checkpoint's
    `trainer_state.json`; on resume with `restore_callback_states_from_checkpoint=True`, transformers rebuilds this
    callback from those arguments, so the trainer always looks the instance up afresh instead of keeping a reference.
    """

    def __init__(
        self,
        alpha: float = 0.5,
        ema_decay: float = 0.95,
        min_scale: float = 0.1,
        eps: float = 1e-5,
        scheduler_state: dict | None = None,
    ):
        self.scheduler = TVScheduler(alpha=alpha, ema_decay=ema_decay, min_scale=min_scale, eps=eps)
        if scheduler_state is not None:
            self.scheduler.load_state_dict(scheduler_state)

    def on_train_begin(self, args, state, control, **kwargs):
        # A resumed run keeps the checkpoint's scheduler, hyperparameters included: say so if the config disagrees.
        scheduler = self.scheduler
        stored = (scheduler.alpha, scheduler.ema_decay, scheduler.min_scale, scheduler.eps)
        configured = tuple(getattr(args, name, value) for name, value in zip(_CONFIG_NAMES, stored, strict=True))
        if configured != stored:
            warnings.warn(
                f"The TV scheduler restored from the checkpoint has (tv_alpha, tv_ema_decay, tv_min_scale, tv_eps) = "
                f"{stored}, but the config says {configured}. The run continues with the checkpoint's values.",
                stacklevel=2,
            )

    def state(self) -> dict:
        scheduler = self.scheduler
        return {
            "args": {
                "alpha": scheduler.alpha,
                "ema_decay": scheduler.ema_decay,
                "min_scale": scheduler.min_scale,
                "eps": scheduler.eps,
                "scheduler_state": scheduler.state_dict(),
            },
            "attributes": {},
        }
