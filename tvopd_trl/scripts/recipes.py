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
"""`tvopd-trl recipes`: the recipes that ship with the package, by name; `tvopd-trl recipes NAME` prints one.

```bash
tvopd-trl recipes                                   # every name, with what it runs
tvopd-trl train --config tiny/raw                   # a name works wherever a recipe's path does
tvopd-trl recipes tiny/tvopd > my_recipe.yaml       # a copy to edit
```
"""

from ..console import OneLineErrors


def make_parser(prog=None):
    parser = OneLineErrors(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("name", nargs="?", help="Print this recipe (e.g. tiny/tvopd) instead of listing them all.")
    return parser


def run(argv=None):
    from ..packaged_recipes import RECIPES_DIR, describe, find_recipe, recipe_names

    args = make_parser(prog="tvopd-trl recipes").parse_args(argv)
    if args.name is not None:
        with open(find_recipe(args.name), encoding="utf-8") as f:
            print(f.read(), end="")
        return 0
    names = recipe_names()
    width = max(len(name) for name in names)
    print(f"Recipes in {RECIPES_DIR}; name one with `--config NAME` (`recipes/NAME.yaml` in a checkout):")
    for name in names:
        print(f"  {name.ljust(width)}  {describe(name)}")
    return 0
