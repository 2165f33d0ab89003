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
"""`tvopd-trl select RUN_DIR [RUN_DIR ...]`: each run's checkpoint by the paper's rule, from its saved evaluations.

```bash
tvopd-trl select runs/tv-s0 runs/tv-s1 runs/tv-s2 --k 16
```

It writes `<run>/selection.json` (what `tvopd-trl push` uploads) and prints the per-run and aggregated scores
(`tvopd_trl.scripts.report.select`).
"""

from ..console import OneLineErrors
from .report import add_selection_arguments, select


def make_parser(prog=None):
    parser = OneLineErrors(prog=prog, description=select.__doc__)
    parser.add_argument("runs", nargs="+", help="Run directories with eval/mean@<k>/step-<N>/ evaluations.")
    add_selection_arguments(parser)
    return parser


def run(argv=None):
    select(make_parser(prog="tvopd-trl select").parse_args(argv))
    return 0
