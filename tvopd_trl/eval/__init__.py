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
"""The TV-OPD paper's evaluation protocol: benchmarks, mean@k, checkpoint selection, retention metrics, reports."""

import importlib

from .accuracy import mean_at_k, pass_at_k, summarize
from .benchmarks import (
    BENCHMARKS,
    DEFAULT_PROMPT_TEMPLATE,
    PAPER_BENCHMARKS,
    Benchmark,
    Problem,
    get_benchmark,
    load_problems,
    read_problems,
    register_benchmark,
)
from .evaluate import evaluate, retention, right_problems, step_dir
from .grading import grade, grade_answer, grade_responses, last_boxed
from .selection import (
    PAPER_LATE_WINDOW,
    PAPER_STAGES,
    aggregate_score,
    aggregate_selections,
    align_runs,
    best_over_training,
    late_mean,
    load_run,
    mean_std,
    peak_drop,
    select_checkpoint,
    stage_averages,
    trajectory_average,
)


# Names whose modules import torch or TRL, imported on first use (PEP 562): reading benchmarks, grading and selecting
# checkpoints need neither.
_LAZY = {
    "BenchmarkEvalCallback": "callback",
    "SamplingSettings": "generation",
    "TransformersGenerator": "generation",
    "VLLMGenerator": "generation",
    "local_generator": "generation",
}

__all__ = [
    "BENCHMARKS",
    "DEFAULT_PROMPT_TEMPLATE",
    "PAPER_BENCHMARKS",
    "PAPER_LATE_WINDOW",
    "PAPER_STAGES",
    "Benchmark",
    "BenchmarkEvalCallback",
    "Problem",
    "SamplingSettings",
    "TransformersGenerator",
    "VLLMGenerator",
    "aggregate_score",
    "aggregate_selections",
    "align_runs",
    "best_over_training",
    "evaluate",
    "get_benchmark",
    "local_generator",
    "grade",
    "grade_answer",
    "grade_responses",
    "last_boxed",
    "late_mean",
    "load_problems",
    "load_run",
    "mean_at_k",
    "mean_std",
    "pass_at_k",
    "peak_drop",
    "read_problems",
    "register_benchmark",
    "retention",
    "right_problems",
    "select_checkpoint",
    "stage_averages",
    "step_dir",
    "summarize",
    "trajectory_average",
]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
