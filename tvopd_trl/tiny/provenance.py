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
"""What an embedded family's build depends on and what it wrote, recorded in its ``build.json``.

A build is bit-identical from run to run on one software stack and one kind of CPU kernel (one thread, seeded), so
two builds with the same inputs write the same files. CI uses that: it rebuilds a family only when the inputs differ
from those of its last verified rebuild (``.ci/rebuilds/<family>.json``), and rebuilds one family every time to check
that its outputs still match their record byte for byte (CONTRIBUTING.md, "Continuous integration").
"""

import hashlib
import importlib
import importlib.metadata
import os
import platform
import sys

import torch


# The libraries that compute the weights and write the tokenizer and the files. Others (rich, requests, ...) take no
# part in the result, and their releases must not force a rebuild.
NUMERIC_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")


def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def build_inputs(family, overrides, modules=None):
    """The inputs of a build of `family` with the builder's `overrides` (its command-line options): the SHA-256 of
    each of our `modules`' sources (by default every module of this package loaded now, which at the end of a build
    is everything it ran), the versions of `NUMERIC_PACKAGES`, Python's, and the CPU kernels torch dispatches to."""
    if modules is None:
        modules = sorted(name for name in sys.modules if name.split(".")[0] == __package__.split(".")[0])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sources = {}
    for name in modules:
        path = importlib.import_module(name).__file__
        sources[name] = {"file": os.path.relpath(path, root), "sha256": _sha256(path)}
    return {
        "family": family,
        "overrides": overrides,
        "sources": sources,
        "packages": {name: importlib.metadata.version(name) for name in NUMERIC_PACKAGES},
        "python": platform.python_version(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def build_outputs(output_dir):
    """The SHA-256 of every file a build wrote under `output_dir` but its own ``build.json``, by relative path."""
    outputs = {}
    for folder, _, files in os.walk(output_dir):
        for name in files:
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, output_dir)
            if relative != "build.json":
                outputs[relative] = _sha256(path)
    return dict(sorted(outputs.items()))


def changed_inputs(record, family, overrides):
    """What differs between the inputs `record` (a build's ``build.json``) was built from and those a build of `family`
    with `overrides` would have now: a list of lines, empty when nothing does."""
    recorded = record.get("inputs")
    if recorded is None:
        return ["the record holds no inputs (a build before provenance was recorded)"]
    try:
        current = build_inputs(family, overrides, modules=list(recorded["sources"]))
    except ImportError as error:
        return [f"a recorded module no longer imports: {error}"]
    changes = [
        f"{key}: {recorded[key]!r} then, {current[key]!r} now"
        for key in ("family", "overrides", "packages", "python", "cpu_capability")
        if recorded[key] != current[key]
    ]
    changes += [
        f"{source['file']} changed"
        for name, source in current["sources"].items()
        if recorded["sources"][name] != source
    ]
    return changes
