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
"""Evaluate a model on benchmarks: generate k responses per problem, grade them, score them, write the records.

An evaluation writes, into its output folder, `<benchmark>.jsonl` (one record per response: `problem_id`, `sample`,
`answer` (the extracted ``\\boxed{}`` content, or null), `correct`, `status`) and `results.json` (the settings and
each benchmark's scores). A run's evaluations live beside its checkpoints, in `<run dir>/eval/mean@<k>/step-<N>/`: one
folder per protocol, so that the paper's mean@4 training curves and mean@16 checkpoint selection never overwrite each
other. Checkpoint selection and the reports read them there.
"""

import glob
import json
import os
import re
import time

from .accuracy import summarize
from .benchmarks import get_benchmark, load_problems
from .grading import CORRECT, DEFAULT_TIMEOUT_SECONDS, INVALID_GOLD, NO_ANSWER, TIMEOUT, grade_responses


RESULTS_FILE = "results.json"


def step_dir(run_dir, step, k):
    """Where a run's mean@`k` evaluation at `step` lives."""
    return os.path.join(run_dir, "eval", f"mean@{k}", f"step-{step}")


def evaluated_steps(run_dir, k):
    """The steps with a mean@`k` evaluation (a `results.json`) in `run_dir`, in increasing order."""
    steps = []
    for path in glob.glob(os.path.join(run_dir, "eval", f"mean@{k}", "step-*", RESULTS_FILE)):
        match = re.fullmatch(r"step-(\d+)", os.path.basename(os.path.dirname(path)))
        if match:
            steps.append(int(match.group(1)))
    return sorted(steps)


def evaluate(
    generator,
    benchmarks,
    settings,
    output_dir=None,
    *,
    data_dir=None,
    limit=None,
    prompt_template=None,
    workers=2,
    timeout_seconds=DEFAULT_TIMEOUT_SECONDS,
    save_responses=False,
    model=None,
    metadata=None,
    accelerator=None,
):
    """Scores of `generator` (a [`TransformersGenerator`] or [`VLLMGenerator`]) on each of `benchmarks`.

    Returns `{"benchmarks": {name: scores}, "settings": ..., **metadata}`, where scores are [`summarize`]'s plus
    the counts of responses with no answer and of grading timeouts. With `output_dir`, writes the per-response
    records and `results.json` there; benchmarks already in that `results.json` are kept if it was written for the
    same `model` (a name for what is evaluated: a path, or a run's output directory) with the same settings, and any
    other evaluation is refused rather than mixed in. `prompt_template` overrides every benchmark's own (see
    `Benchmark`).

    With `accelerator` (an `Accelerator` or `PartialState`), every one of its processes must call this with the same
    arguments and a [`TransformersGenerator`] of the same model: each generates and grades its shard of the responses
    (see the generator's `shard`), the graded records are gathered, every process returns the scores of the whole
    set, and only the main process writes."""
    benchmarks = [get_benchmark(name) for name in benchmarks]  # unknown names fail before any generation
    protocol = evaluation_protocol(settings, limit, prompt_template, model)
    results = {"benchmarks": {}, **protocol, **(metadata or {})}
    writes = output_dir is not None and (accelerator is None or accelerator.is_main_process)
    # Read on every process: a refusal on the main process alone would leave the others waiting in generation.
    previous = None if output_dir is None else read_results(output_dir)
    if previous is not None:
        check_protocol(output_dir, previous, protocol)
        results["benchmarks"] = previous["benchmarks"]
    if writes:
        os.makedirs(output_dir, exist_ok=True)
    for benchmark in benchmarks:
        start = time.perf_counter()
        problems = load_problems(benchmark, data_dir, limit)
        prompts = [benchmark.prompt(problem, prompt_template) for problem in problems]
        if accelerator is None:
            responses = generator(prompts, settings)
        else:
            responses = generator(prompts, settings, shard=(accelerator.process_index, accelerator.num_processes))
        if len(responses) != len(problems) or any(len(samples) != settings.k for samples in responses):
            raise RuntimeError(
                f"The generator must return {settings.k} responses for each of {len(problems)} prompts."
            )
        golds = [problem.answer for problem in problems for _ in range(settings.k)]
        graded = _grade_shards(
            responses, golds, save_responses, accelerator, workers, timeout_seconds, benchmark.grader
        )
        statuses = [status for _, status, _ in graded]
        correct = [status == CORRECT for status in statuses]
        scores = summarize([correct[i : i + settings.k] for i in range(0, len(correct), settings.k)])
        scores["no_answer"] = statuses.count(NO_ANSWER)
        scores["timeouts"] = statuses.count(TIMEOUT)
        scores["invalid_gold"] = statuses.count(INVALID_GOLD)
        scores["seconds"] = time.perf_counter() - start
        if getattr(generator, "stats", None) is not None:  # a tool loop's `tools/*` frequencies
            scores["tools"] = generator.stats
        results["benchmarks"][benchmark.name] = scores
        if writes:
            with open(os.path.join(output_dir, f"{benchmark.name}.jsonl"), "w", encoding="utf-8") as f:
                for index, (answer, status, response) in enumerate(graded):
                    record = {
                        "problem_id": problems[index // settings.k].id,
                        "sample": index % settings.k,
                        "gold": golds[index],
                        "answer": answer,
                        "correct": status == CORRECT,
                        "status": status,
                    }
                    if save_responses:
                        record["response"] = response
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
            # After each benchmark, and atomically: a long evaluation that stops keeps what it finished, intact.
            path = os.path.join(output_dir, RESULTS_FILE)
            with open(f"{path}.tmp", "w") as f:
                json.dump(results, f, indent=2)
            os.replace(f"{path}.tmp", path)
    return results


def _grade_shards(responses, golds, keep_responses, accelerator, workers, timeout_seconds, grader=None):
    """(answer, status, response or `None`) of each response, in order: this process grades the responses it
    generated (the others are `None` here) with the benchmark's `grader`, else math-verify, and with `accelerator` the
    other processes' records are gathered."""
    flat = [response for samples in responses for response in samples]
    shard = [n for n, response in enumerate(flat) if response is not None]
    if grader is not None:
        answers, statuses = [], []
        for n in shard:
            answer, status = grader(flat[n], golds[n])
            answers.append(answer)
            statuses.append(status)
    else:
        answers, statuses = grade_responses(
            [flat[n] for n in shard], [golds[n] for n in shard], workers=workers, timeout_seconds=timeout_seconds
        )
    # Full responses travel only when they are kept: the paper's are up to 31,744 tokens each.
    records = [
        (n, answer, status, flat[n] if keep_responses else None)
        for n, answer, status in zip(shard, answers, statuses, strict=True)
    ]
    if accelerator is not None:
        from accelerate.utils import gather_object

        records = sorted(gather_object(records), key=lambda record: record[0])
    if [record[0] for record in records] != list(range(len(flat))):
        raise RuntimeError("The generator's shards must hold every response exactly once.")
    return [record[1:] for record in records]


def right_problems(output_dir, benchmark):
    """The ids of the problems of `benchmark` (a name) that the evaluation in `output_dir` answered right in every
    sample (greedy: its one answer)."""
    wrong, seen = set(), set()
    with open(os.path.join(output_dir, f"{benchmark}.jsonl"), encoding="utf-8") as f:
        for record in map(json.loads, f):
            seen.add(record["problem_id"])
            if not record["correct"]:
                wrong.add(record["problem_id"])
    return seen - wrong


def retention(before_dir, after_dir, benchmark):
    """The share of the problems of `benchmark` answered right in `before_dir`'s evaluation that are still right in
    `after_dir`'s (`right_problems`); None when none were right before."""
    before = right_problems(before_dir, benchmark)
    if not before:
        return None
    return len(before & right_problems(after_dir, benchmark)) / len(before)


def evaluation_protocol(settings, limit, prompt_template, model):
    """What must match for two evaluations to share a folder: the model, the sampling settings, the problem limit and
    the prompt."""
    return {"model": model, "settings": settings.to_dict(), "limit": limit, "prompt_template": prompt_template}


def check_protocol(output_dir, previous, protocol):
    """Refuses to add an evaluation to `output_dir` whose `results.json` (`previous`) was written under another
    protocol."""
    existing = {key: previous.get(key) for key in protocol}
    if existing != protocol:
        differing = {key: (existing[key], protocol[key]) for key in protocol if existing[key] != protocol[key]}
        raise ValueError(
            f"{output_dir} holds another evaluation: (there, here) = {differing}. Write this one elsewhere, or move "
            "that one away."
        )


def read_results(output_dir):
    """The `results.json` of an evaluation folder, or `None` if there is none."""
    path = os.path.join(output_dir, RESULTS_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
