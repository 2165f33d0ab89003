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
"""TV-Regulated On-Policy Distillation (TV-OPD) for the Hugging Face TRL ecosystem."""

__version__ = "0.1.0.dev0"

from .advantages import ADVANTAGE_MODE_REGISTRY, ADVANTAGE_MODES, AdvantageMode, compute_advantages
from .callbacks import TVScheduleCallback
from .config import TVOPDConfig
from .eval import BenchmarkEvalCallback
from .trainer import TVOPDTrainer
from .tv import TVScheduler, tv_estimate


__all__ = [
    "ADVANTAGE_MODES",
    "ADVANTAGE_MODE_REGISTRY",
    "AdvantageMode",
    "BenchmarkEvalCallback",
    "TVOPDConfig",
    "TVOPDTrainer",
    "TVScheduleCallback",
    "TVScheduler",
    "compute_advantages",
    "tv_estimate",
]
