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
"""The benchmark registry: the paper's six math benchmarks, the embedded tiny task, and your own files.

A benchmark is a list of [`Problem`]s (`id`, `problem`, `answer`). Each of the paper's benchmarks loads from a local
JSONL file with exactly those fields when `data_dir` holds `<name>.jsonl`, from its usual Hugging Face dataset when
`data_dir` is `"hub"` (ids and field mappings in `BENCHMARKS`; the Hub loaders are written against the datasets'
published schemas and could not be run in the environment this library is tested in, which has no Hub access), and
otherwise from the copy that ships in the package (`PACKAGED_DIR`, provenance in its README.md), offline.
"""

import importlib
import json
import os
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import NamedTuple


DEFAULT_PROMPT_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."
PAPER_BENCHMARKS = ("aime24", "aime25", "aime26", "amc23", "hmmt_feb_2025", "math500")
FIELDS = ("id", "problem", "answer")
PACKAGED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
HUB = "hub"  # the `data_dir` that loads the Hub datasets instead of local files


class Problem(NamedTuple):
    id: str
    problem: str
    answer: str


@dataclass(frozen=True)
class Benchmark:
    """Where a benchmark's problems come from and how they are prompted.

    `hub_fields` maps our fields (`id`, `problem`, `answer`) to the Hub dataset's columns; an `id` mapped to `None`
    numbers the rows. `loader`, if set, returns the problems itself (the embedded tiny task). `prompt_template` turns
    a problem into the user turn: `{problem}` is replaced by the problem text (other braces are literal).
    `generator`, if set, answers the benchmark instead of plain generation: `generator(model, tokenizer, batch_size)`
    returns a generator with [`TransformersGenerator`]'s call (the embedded tool task's tool loop). `grader`, if set,
    grades a response instead of the last `\\boxed{}`'s math-verify: `grader(response, gold)` returns (the answer
    recorded, `"correct"` or `"incorrect"`), in the evaluating process (a behaviour, not a math answer: the real
    model's terse task, `tvopd_trl.terse_task`)."""

    name: str
    title: str
    hub_id: str | None = None
    hub_split: str = "test"
    hub_fields: dict = field(default_factory=lambda: {key: key for key in FIELDS})
    path: str | None = None
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    loader: Callable[[], list] | None = None
    generator: Callable | None = None
    grader: Callable[[str, str], tuple] | None = None

    def prompt(self, problem, template=None):
        """The chat messages (one user turn) that pose `problem`."""
        return [{"role": "user", "content": (template or self.prompt_template).replace("{problem}", problem.problem)}]


class BenchmarkRegistry(MutableMapping):
    """The benchmarks by name: a `Benchmark`, or a `"module:function"` reference to a function that returns one.

    A reference is resolved (its module imported) on the first lookup of its name. That is how a package that builds
    on this one registers its benchmark (the embedded tiny task, `tvopd_trl.tiny`) without this package importing it
    and forming an import cycle."""

    def __init__(self, entries):
        self._entries = dict(entries)

    def __getitem__(self, name):
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, function = entry.partition(":")
            entry = self._entries[name] = getattr(importlib.import_module(module), function)()
        return entry

    def __setitem__(self, name, benchmark):
        self._entries[name] = benchmark

    def __delitem__(self, name):
        del self._entries[name]

    def __iter__(self):
        return iter(self._entries)

    def __len__(self):
        return len(self._entries)

    def __contains__(self, name):  # without resolving: a name check imports nothing
        return name in self._entries


BENCHMARKS = BenchmarkRegistry(
    {
        "aime24": Benchmark("aime24", "AIME24", "HuggingFaceH4/aime_2024", "train"),
        "aime25": Benchmark(
            "aime25",
            "AIME25",
            "MathArena/aime_2025",
            "train",
            {"id": "problem_idx", "problem": "problem", "answer": "answer"},
        ),
        "aime26": Benchmark(
            "aime26",
            "AIME26",
            "MathArena/aime_2026",
            "train",
            {"id": "problem_idx", "problem": "problem", "answer": "answer"},
        ),
        "amc23": Benchmark(
            "amc23", "AMC23", "math-ai/amc23", "test", {"id": "id", "problem": "question", "answer": "answer"}
        ),
        "hmmt_feb_2025": Benchmark(
            "hmmt_feb_2025",
            "HMMT25",
            "MathArena/hmmt_feb_2025",
            "train",
            {"id": "problem_idx", "problem": "problem", "answer": "answer"},
        ),
        "math500": Benchmark(
            "math500",
            "MATH500",
            "HuggingFaceH4/MATH-500",
            "test",
            {"id": "unique_id", "problem": "problem", "answer": "answer"},
        ),
        # The embedded tasks' held-out splits, defined beside the tasks.
        "tiny": "tvopd_trl.tiny:tiny_benchmark",
        "tiny-subtraction": "tvopd_trl.tiny.accuracy:tiny_subtraction_benchmark",
        "tiny-long-addition": "tvopd_trl.tiny.accuracy:tiny_long_addition_benchmark",
        "tiny-tools": "tvopd_trl.tiny.tool_task:tiny_tools_benchmark",
        # The default pair's held-out split with each answer shown as a hint (the hint family's privileged context)
        "tiny-hinted": "tvopd_trl.tiny.hint_task:tiny_hinted_benchmark",
        # The real model's terse task (`tvopd_trl.terse_task`): held-out questions, the same after the few-shot turns,
        # and the control set
        "terse": "tvopd_trl.terse_task:terse_benchmark",
        "terse-fewshot": "tvopd_trl.terse_task:terse_fewshot_benchmark",
        "facts": "tvopd_trl.terse_task:facts_benchmark",
        "facts-fewshot": "tvopd_trl.terse_task:facts_fewshot_benchmark",
    }
)


def register_benchmark(name, path, *, title=None, prompt_template=DEFAULT_PROMPT_TEMPLATE, overwrite=False):
    """Registers a local JSONL file (fields `id`, `problem`, `answer`) as benchmark `name`, and returns it.

    The file is read (and validated) when the benchmark is loaded."""
    if name in BENCHMARKS and not overwrite:
        raise ValueError(f"A benchmark named {name!r} is already registered; pass `overwrite=True` to replace it.")
    if "{problem}" not in prompt_template:
        raise ValueError(
            f"`prompt_template` must contain `{{problem}}`, where the problem text goes: {prompt_template!r}"
        )
    BENCHMARKS[name] = Benchmark(name, title or name, path=os.path.abspath(path), prompt_template=prompt_template)
    return BENCHMARKS[name]


def get_benchmark(name):
    """The registered benchmark `name`, or one read from `name` if it is a path to a JSONL file.

    A file named after a registered benchmark (`…/aime24.jsonl`) keeps that benchmark's title and prompt."""
    if isinstance(name, Benchmark):
        return name
    if name in BENCHMARKS:
        return BENCHMARKS[name]
    if name.endswith(".jsonl") and os.path.isfile(name):
        stem = os.path.splitext(os.path.basename(name))[0]
        known = BENCHMARKS.get(stem, Benchmark(stem, stem))
        return Benchmark(stem, known.title, path=os.path.abspath(name), prompt_template=known.prompt_template)
    raise ValueError(
        f"Unknown benchmark {name!r}. Known benchmarks: {', '.join(BENCHMARKS)}. A path to a JSONL file with fields "
        f"{', '.join(FIELDS)} also works, or register one with `register_benchmark`."
    )


def read_problems(path):
    """The problems of a JSONL file with fields `id`, `problem` and `answer` (strings; numbers are accepted)."""
    problems = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}, line {line_number}: not valid JSON ({error}).") from None
            missing = [key for key in FIELDS if key not in row or row[key] is None or not str(row[key]).strip()]
            if missing:
                raise ValueError(
                    f"{path}, line {line_number}: missing field {', '.join(repr(key) for key in missing)}. Each line "
                    f"needs a non-empty {', '.join(FIELDS)}."
                )
            problems.append(Problem(*(_as_text(row[key]) for key in FIELDS)))
    if not problems:
        raise ValueError(f"{path} holds no problems.")
    ids = [problem.id for problem in problems]
    if len(set(ids)) != len(ids):
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"{path}: duplicate ids {duplicates[:5]}; records are keyed by problem id.")
    return problems


def load_problems(benchmark, data_dir=None, limit=None):
    """The problems of `benchmark` (a `Benchmark`, a registered name or a JSONL path), the first `limit` if given.

    The registered file, else `<data_dir>/<name>.jsonl`, else, with `data_dir="hub"`, the Hub dataset, else the
    packaged copy (`PACKAGED_DIR`). `data_dir` defaults to the environment variable `TVOPD_BENCHMARK_DIR`."""
    benchmark = get_benchmark(benchmark)
    data_dir = data_dir or os.environ.get("TVOPD_BENCHMARK_DIR")
    if benchmark.loader is not None:
        problems = benchmark.loader()
    elif benchmark.path is not None:
        problems = read_problems(benchmark.path)
    elif data_dir == HUB:
        problems = _load_from_hub(benchmark)
    else:
        path = os.path.join(data_dir or PACKAGED_DIR, f"{benchmark.name}.jsonl")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"No {benchmark.name}.jsonl in {data_dir or 'the package'} (benchmark {benchmark.name!r}). Pass "
                f"`data_dir` (`--data_dir`) a folder that holds it, or `{HUB}` to load {benchmark.hub_id} instead."
            )
        problems = read_problems(path)
    return problems if limit is None else problems[:limit]


def _load_from_hub(benchmark):
    from datasets import load_dataset

    try:
        rows = load_dataset(benchmark.hub_id, split=benchmark.hub_split)
    except Exception as error:
        raise ConnectionError(
            f"Could not load benchmark {benchmark.name!r} from the Hub ({benchmark.hub_id}: {error}). Leave `data_dir` "
            f"unset (and TVOPD_BENCHMARK_DIR) to read the copy shipped in the package, or pass a folder with "
            f"{benchmark.name}.jsonl (fields {', '.join(FIELDS)})."
        ) from error
    columns = benchmark.hub_fields
    missing = [column for column in columns.values() if column is not None and column not in rows.column_names]
    if missing:
        raise ValueError(f"{benchmark.hub_id} has no column {missing}; its columns are {rows.column_names}.")
    return [
        Problem(
            _as_text(row[columns["id"]]) if columns["id"] else str(index),
            _as_text(row[columns["problem"]]),
            _as_text(row[columns["answer"]]),
        )
        for index, row in enumerate(rows)
    ]


def _as_text(value):
    # Some sources store integer answers as floats (`27.0`); the boxed answer a model writes is `27`.
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
