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
"""`tvopd-trl doctor`: checks a teacher/student pair, with the config a run would use, for silent scoring bugs.

```bash
tvopd-trl doctor --config recipes/tiny/tvopd.yaml       # the embedded pair
tvopd-trl doctor --config recipes/qwen3-8b_to_qwen3-8b-sft/tvopd.yaml --doctor_prompts 16
```

It takes the recipe (or the same flags as `tvopd-trl train`), loads the pair as training would, in one process, and
prints a verdict per check with a fix for each failure (`tvopd_trl.doctor`). Exit status 1 when a check fails.
"""

import json
from dataclasses import asdict, dataclass, field


@dataclass
class DoctorArguments:
    """
    Arguments of `tvopd-trl doctor` beyond those of `tvopd-trl train`.

    Parameters:
        > Parameters that control the examination

        doctor_prompts (`int`, *optional*, defaults to `8`):
            Prompts rolled out (the first ones of the job's dataset).
        doctor_max_completion_length (`int`, *optional*, defaults to `128`):
            Cap on the rollouts' length (the config's `max_completion_length` if smaller).
        doctor_tolerance (`float`, *optional*, defaults to `1e-3`):
            Largest |delta|, in nats, allowed when the student is scored as its own teacher.
        doctor_z_threshold (`float`, *optional*, defaults to `5.0`):
            Largest |z| of the sampling and TV-estimate tests (standard normal when all is well).
        doctor_output_json (`str`, *optional*):
            Also write the verdicts to this JSON file.
    """

    doctor_prompts: int = field(default=8, metadata={"help": "Prompts rolled out."})
    doctor_max_completion_length: int = field(default=128, metadata={"help": "Cap on the rollouts' length."})
    doctor_tolerance: float = field(default=1e-3, metadata={"help": "Largest self-delta |delta| (nats)."})
    doctor_z_threshold: float = field(default=5.0, metadata={"help": "Largest |z| of the statistical tests."})
    doctor_output_json: str | None = field(default=None, metadata={"help": "Also write the verdicts here."})


def make_parser(prog=None):
    from ..job import job_parser

    return job_parser(DoctorArguments, prog=prog)


def run(argv=None):
    from rich.console import Console
    from rich.table import Table

    from ..doctor import FAIL, diagnose
    from ..job import check_launch_options

    doctor_args, job_args, training_args, model_args, remaining = make_parser(
        prog="tvopd-trl doctor"
    ).parse_args_and_config(args=argv, return_remaining_strings=True)
    check_launch_options(remaining)  # a recipe's `accelerate launch` keys are fine; a typo is not
    checks = diagnose(
        job_args,
        training_args,
        model_args,
        num_prompts=doctor_args.doctor_prompts,
        max_completion_length=doctor_args.doctor_max_completion_length,
        tolerance=doctor_args.doctor_tolerance,
        z_threshold=doctor_args.doctor_z_threshold,
    )
    table = Table(title="tvopd-trl doctor", show_lines=True)
    for column in ("check", "verdict", "detail", "fix"):
        table.add_column(column, overflow="fold")
    colors = {"PASS": "green", "FAIL": "red", "WARN": "yellow"}
    for check in checks:
        verdict = f"[{colors.get(check.status, 'white')}]{check.status}[/]"
        table.add_row(check.name, verdict, check.detail, check.fix)
    Console(width=160).print(table)
    if doctor_args.doctor_output_json:
        with open(doctor_args.doctor_output_json, "w") as f:
            json.dump([asdict(check) for check in checks], f, indent=2)
    return 1 if any(check.status == FAIL for check in checks) else 0
