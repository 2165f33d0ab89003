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
"""`tvopd-trl study --config tiny/study`: runs a (method x seed) grid of the main job, resuming a
partial one, then writes the paper's tables and figures from it (`tvopd_trl.study`)."""

from ..console import OneLineErrors


def make_parser(prog=None):
    parser = OneLineErrors(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="The study file, or a packaged one's name (tiny/study).")
    parser.add_argument("--parallel", type=int, default=None, help="Runs at a time (default: the study file's).")
    parser.add_argument("--skip_analysis", action="store_true", help="Run the grid only.")
    parser.add_argument("--analysis_only", action="store_true", help="Write tables and figures from a finished grid.")
    return parser


def run(argv=None):
    from ..study import analyze, load_study, run_grid

    args = make_parser(prog="tvopd-trl study").parse_args(argv)
    study = load_study(args.config)
    if args.parallel is not None:
        study.parallel = args.parallel
    if not args.analysis_only:
        run_grid(study)
    if not args.skip_analysis:
        analyze(study)
    return 0
