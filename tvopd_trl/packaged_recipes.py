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
"""The recipes that ship inside the package (`tvopd_trl/recipes/`, which a checkout also reaches as `recipes/`): the
tiny pair's, the paper's, the study files and the accelerate configs, each named by its path under `recipes/` without
`.yaml` (`tiny/tvopd`, `qwen3-8b_to_qwen3-8b-sft/tvopd`, `accelerate_configs/zero3`)."""

import difflib
import os
import re
from pathlib import Path


RECIPES_DIR = Path(__file__).parent / "recipes"


def recipe_names():
    """The names of the packaged YAML files, sorted."""
    return sorted(str(path.relative_to(RECIPES_DIR).with_suffix("")) for path in RECIPES_DIR.glob("*/*.yaml"))


def find_recipe(name):
    """The path of recipe `name`: `name` itself if it is a file, else the packaged file it names, with or without
    `recipes/` in front and `.yaml` behind (so the repository's paths, `recipes/tiny/tvopd.yaml`, work anywhere)."""
    if os.path.isfile(name):
        return name
    relative = name.removeprefix("./").removeprefix("recipes/").removesuffix(".yaml")
    path = RECIPES_DIR / f"{relative}.yaml"
    if path.is_file():
        return str(path)
    close = difflib.get_close_matches(relative, recipe_names(), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise FileNotFoundError(
        f"No recipe {name!r}: no such file, and no packaged recipe of that name{hint}. `tvopd-trl recipes` lists the "
        "packaged ones."
    )


def describe(name):
    """What packaged recipe `name` runs: the head of its first comment line, up to a colon or a full stop."""
    with open(RECIPES_DIR / f"{name}.yaml", encoding="utf-8") as f:
        return re.split(r"[:.](?:\s|$)", f.readline().removeprefix("#").strip())[0]
