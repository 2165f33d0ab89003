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

import importlib


# Public names -> the module that defines them, imported on first use (PEP 562): importing the package, or a light
# module of it (`tvopd_trl.tiny`, the `tvopd-trl` command), does not pull in torch, TRL's trainers and the trackers
# they import.
_LAZY = {
    "ADVANTAGE_MODES": "advantages",
    "ADVANTAGE_MODE_REGISTRY": "advantages",
    "AdvantageMode": "advantages",
    "compute_advantages": "advantages",
    "TVScheduleCallback": "callbacks",
    "TVOPDConfig": "config",
    "BenchmarkEvalCallback": "eval",
    "TVOPDTrainer": "trainer",
    "TVScheduler": "tv",
    "tv_estimate": "tv",
}


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


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
