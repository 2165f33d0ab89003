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
"""A study: a grid of (method x seed) runs of the main job, run a few at a time and resumed where it stopped.

A study file (`recipes/tiny/study.yaml`) names the main job's recipe, the settings every run shares, the methods (each
a set of recipe overrides) and the seeds. Run `i` of the grid lives in `<output_dir>/<method>/seed-<seed>/`; it is
finished when it holds `summary.json`, which the main job writes last. A run folder without one was interrupted: it is
cleared and run again. A finished run whose settings differ from the study's is an error, never silently reused.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field


@dataclass
class Study:
    """A parsed study file. `methods` maps a folder name to `{"name": title, **recipe overrides}`."""

    recipe: str
    output_dir: str
    results_dir: str
    seeds: list
    methods: dict
    parallel: int = 2
    overrides: dict = field(default_factory=dict)
    analysis: dict = field(default_factory=dict)


@dataclass
class Run:
    method: str
    name: str
    seed: int
    directory: str
    settings: dict

    @property
    def finished(self):
        return os.path.isfile(os.path.join(self.directory, "summary.json"))


def load_study(path):
    """Parses a study file as data (`yaml.safe_load`), refusing unknown keys and methods without a name."""
    import yaml

    with open(path) as f:
        raw = yaml.safe_load(f)
    known = set(Study.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; a study file has {sorted(known)}.")
    study = Study(**raw)
    for slug, method in study.methods.items():
        if not isinstance(method, dict) or "name" not in method:
            raise ValueError(f"{path}: method {slug!r} needs a `name` (its title in tables) and its recipe overrides.")
    if not os.path.isfile(study.recipe):
        raise FileNotFoundError(f"{path}: the recipe {study.recipe} does not exist (paths are relative to the cwd).")
    return study


def grid(study):
    """Every run of the study, method by method."""
    runs = []
    for slug, method in study.methods.items():
        overrides = {key: value for key, value in method.items() if key != "name"}
        for seed in study.seeds:
            directory = os.path.join(study.output_dir, slug, f"seed-{seed}")
            settings = {**study.overrides, **overrides, "seed": seed, "output_dir": directory}
            runs.append(Run(slug, method["name"], seed, directory, settings))
    return runs


def _flags(settings):
    flags = []
    for key, value in settings.items():
        text = (
            json.dumps(value)
            if isinstance(value, dict | list)
            else str(value).lower()
            if isinstance(value, bool)
            else str(value)
        )
        flags += [f"--{key}", text]
    return flags


def _check_settings(study, run):
    """A finished run must have been made with the settings the study asks for now."""
    with open(os.path.join(run.directory, "study_run.json")) as f:
        recorded = json.load(f)
    expected = {"recipe": study.recipe, "settings": run.settings}
    if recorded != expected:
        changed = sorted(
            key
            for key in set(recorded["settings"]) | set(run.settings)
            if recorded["settings"].get(key) != run.settings.get(key)
        )
        raise ValueError(
            f"{run.directory} was run with other settings ({changed or 'the recipe'} differ). Give the study another "
            "output_dir, or delete that run to redo it."
        )


def _execute(study, run, log):
    if os.path.isdir(run.directory):
        log(f"{run.directory}: interrupted earlier, starting it again")
        shutil.rmtree(run.directory)
    os.makedirs(run.directory)
    with open(os.path.join(run.directory, "study_run.json"), "w") as f:
        json.dump({"recipe": study.recipe, "settings": run.settings}, f, indent=2)
    command = [sys.executable, "-m", "tvopd_trl.scripts.train", "--config", study.recipe, *_flags(run.settings)]
    start = time.perf_counter()
    with open(os.path.join(run.directory, "train.log"), "w") as output:
        # One thread per run: `parallel` runs share the cores without oversubscribing them.
        result = subprocess.run(
            command, stdout=output, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
    if result.returncode != 0:
        raise RuntimeError(
            f"{run.method} seed {run.seed} failed (exit {result.returncode}): see {run.directory}/train.log"
        )
    return time.perf_counter() - start


def run_grid(study, log=print):
    """Runs every unfinished run of the grid, `study.parallel` at a time; returns {(method, seed): seconds} of the runs
    it executed (empty when the grid was already complete)."""
    from tqdm.auto import tqdm

    runs = grid(study)
    for run in runs:
        if run.finished:
            _check_settings(study, run)
    pending = [run for run in runs if not run.finished]
    log(
        f"{len(runs) - len(pending)} of {len(runs)} runs already finished; {len(pending)} to run, {study.parallel} at a time"
    )
    seconds = {}
    if not pending:
        return seconds
    with ThreadPoolExecutor(study.parallel) as pool, tqdm(total=len(pending), desc="study runs") as bar:
        futures = {pool.submit(_execute, study, run, log): run for run in pending}
        for future, run in futures.items():
            seconds[(run.method, run.seed)] = future.result()
            bar.update()
    return seconds
