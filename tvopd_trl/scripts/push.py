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
"""`tvopd-trl push RUN_DIR --repo_id USER/NAME`: uploads a finished run's selected checkpoint to the Hub.

Which checkpoint, what the commit holds and what stays local: `tvopd_trl.push`.
"""

from ..console import OneLineErrors
from ..push import PushError, push_run  # noqa: F401  (PushError: moved to `tvopd_trl.push`; this import keeps working)


def make_parser(prog=None):
    parser = OneLineErrors(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="The run's output_dir.")
    parser.add_argument("--repo_id", "--repo-id", required=True, help="Hub repository, USER/NAME or ORG/NAME.")
    parser.add_argument("--checkpoint", default=None, help="Upload this folder instead of the selected checkpoint.")
    parser.add_argument("--private", action="store_true", default=None, help="Create the repository as private.")
    parser.add_argument("--revision", default=None, help="Branch to push to (created if missing; default: main).")
    parser.add_argument("--commit_message", default=None, help="Commit message.")
    parser.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the cached login).")
    return parser


def run(argv=None):
    args = make_parser(prog="tvopd-trl push").parse_args(argv)
    url = push_run(**vars(args))
    print(f"pushed to {url}")
    return 0
