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
"""A dress rehearsal of the paper's recipes on a small real model (`tvopd-trl rehearse`).

Every recipe of the paper's two pairs runs as written, through `tvopd-trl train --config` (`sft.yaml` through `trl
sft`, as its header says), with only flags changed:

- the models: one real pretrained model as every teacher, and as every student that model after the SFT recipe's
  steps (the 8B pair's student is what `sft.yaml` writes): a student that differs from its teacher, so that the
  updates are not zero;
- lengths, steps and batch (`SHRINK`): 2 steps of one micro-batch of 2 prompts (3 under SP) cut to their last 64
  tokens, with 8-token responses, a checkpoint at step 2;
- the launch: each GPU accelerate config's CPU form (`CPU_LAUNCH`), in float32 (bf16 is refused on a CPU);
- the data: local copies of the recipes' datasets where `data_dir` has them (`LOCAL_DATASETS`);
- vLLM: one server of vLLM's CPU build on loopback where a recipe asks for a server (the student's rollouts, or the
  teacher pool's replicas); the colocated engine runs in the trainer's process.

Each run is evaluated once it has trained (`tvopd-trl eval`; the first of each pair with `--student`, the report's
Student row), and its weights are then deleted unless asked to keep them; each pair's runs are selected and reported
together (`tvopd-trl report`). A recipe that cannot run in this environment is not run and says why
(`Rehearsal.reason`).
"""

import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys
import time

import yaml

from .checkpoints import heavy_parts
from .packaged_recipes import RECIPES_DIR, recipe_names


PAPER_PAIRS = ("justrl-1.5b_to_ds-distill-qwen-1.5b", "qwen3-8b_to_qwen3-8b-sft")
SFT_RECIPE = "qwen3-8b_to_qwen3-8b-sft/sft"

# Each GPU accelerate config's CPU form: the same engine over as few CPU processes as it allows
CPU_LAUNCH = {
    "zero3": ["--accelerate_config", "zero3_cpu", "--num_processes", "1"],
    # One SP group (the recipes' layouts have 2 to 4), of 3 processes where the recipes' are 2: Ulysses gives each
    # process whole heads, and SmolLM2-135M has 9 attention heads and 3 KV heads. Its rollout is 3 rows, one each.
    "zero3_sp": [
        "--accelerate_config",
        "zero3_sp_cpu",
        "--num_processes",
        "3",
        "--parallelism_config_sp_size",
        "3",
        "--parallelism_config_dp_shard_size",
        "1",
        "--per_device_train_batch_size",
        "3",
    ],  # fmt: skip
    "single_gpu": [],
}

# vLLM's CPU build, for the servers and the colocated engine: its eager model code without the warm-up (its own CPU
# CI's switch), and threads the scheduler places rather than pinned all to one core (docs/vllm.md)
VLLM_CPU_ENV = {"VLLM_CPU_CI_ENV": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}

STEPS = 2
SHRINK = [
    "--max_steps", str(STEPS), "--save_steps", str(STEPS), "--per_device_train_batch_size", "2",
    "--gradient_accumulation_steps", "1", "--max_prompt_length", "64", "--max_completion_length", "8",
    "--bf16", "false", "--report_to", "none", "--disable_tqdm", "true",
]  # fmt: skip

# Local copies of the recipes' datasets, by Hub id: files of `data_dir` (the repository's tests/data/train has both)
LOCAL_DATASETS = {
    "open-r1/DAPO-Math-17k-Processed": "dapo_math_17k_sample.jsonl",
    "zwhe99/DeepMath-103K": "deepmath_103k_sample.jsonl",
}

# The evaluation of every checkpoint and of the Student row (a few problems and tokens of one benchmark), and the
# selection's and the report's protocol
PROTOCOL = ["--k", "1", "--benchmarks", "math500"]
EVAL = [*PROTOCOL, "--limit", "2", "--max_new_tokens", "16"]


@dataclasses.dataclass
class Rehearsal:
    """One recipe's rehearsal: the command it ran, its log, its outcome and wall time, or why it did not run."""

    recipe: str
    command: list = dataclasses.field(default_factory=list)
    log: str | None = None
    status: str = "not run"  # "passed", "failed" or "not run"
    seconds: float = 0.0
    reason: str = ""


def paper_recipes():
    """The names of the paper pairs' recipes, the SFT one first (the 8B pair's student comes from it)."""
    names = [name for name in recipe_names() if name.split("/")[0] in PAPER_PAIRS]
    return sorted(names, key=lambda name: (name != SFT_RECIPE, name))


def read_recipe(name):
    with open(RECIPES_DIR / f"{name}.yaml", encoding="utf-8") as f:
        return yaml.safe_load(f)


def needs_server(recipe):
    """Whether a recipe's training talks to a vLLM server: server-mode rollouts, or a pool of served teachers."""
    return (recipe.get("use_vllm") and recipe.get("vllm_mode") == "server") or bool(
        recipe.get("teacher_model_server_url")
    )


def why_not(recipe, has_vllm):
    """Why a recipe cannot be rehearsed in this environment, or `""`."""
    if (recipe.get("use_vllm") or recipe.get("teacher_model_server_url")) and not has_vllm:
        return "needs vLLM's CPU build, which this environment lacks: the README's vLLM command installs it"
    config = recipe.get("accelerate_config")
    if config is not None and config not in CPU_LAUNCH:
        return f"its accelerate config {config!r} has no CPU form here (CPU_LAUNCH)"
    return ""


def local_dataset(name, data_dir):
    if data_dir is None or name not in LOCAL_DATASETS:
        return name
    path = os.path.join(data_dir, LOCAL_DATASETS[name])
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: --data_dir must hold {', '.join(LOCAL_DATASETS.values())}")
    return path


def sft_conversations(data_dir, path):
    """A stand-in for the SFT recipe's OpenThoughts conversations, in their ShareGPT form: DeepMath's questions and final
    answers as two-turn conversations. Written to `path`, which is returned."""
    with open(os.path.join(data_dir, LOCAL_DATASETS["zwhe99/DeepMath-103K"]), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f][:32]
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            turns = [
                {"from": "human", "value": row["question"]},
                {"from": "gpt", "value": f"The answer is $\\boxed{{{row['final_answer']}}}$."},
            ]
            f.write(json.dumps({"conversations": turns}) + "\n")
    return path


def sft_command(model, output_dir, data_dir):
    """`trl sft` on a copy of the SFT recipe with two keys replaced, which `trl sft` takes from no flag where a recipe
    sets them: `accelerate_config` (its CPU form) and, with `data_dir`, `datasets` (a local stand-in); and flags."""
    os.makedirs(output_dir, exist_ok=True)
    recipe = read_recipe(SFT_RECIPE)
    recipe["accelerate_config"] = str(RECIPES_DIR / "accelerate_configs" / "zero3_cpu.yaml")
    if data_dir is not None:
        conversations = sft_conversations(data_dir, os.path.join(output_dir, "sft.jsonl"))
        recipe["datasets"] = [
            {**entry, "path": "json", "data_files": conversations, "split": "train"} for entry in recipe["datasets"]
        ]
    recipe_path = os.path.join(output_dir, "sft_recipe.yaml")
    with open(recipe_path, "w", encoding="utf-8") as f:
        yaml.safe_dump(recipe, f)
    flags = ["--model_name_or_path", model, "--output_dir", os.path.join(output_dir, "model"), "--num_processes", "1"]
    flags += ["--max_steps", str(STEPS), "--gradient_accumulation_steps", "2", "--max_length", "256"]
    flags += ["--dtype", "float32", "--bf16", "false"]  # bf16 is refused on a CPU
    # flash-attention is CUDA's; TRL's generation-tagged template for the loss on responses only is Qwen3's
    flags += ["--attn_implementation", "sdpa", "--assistant_only_loss", "false", "--dataset_num_proc", "1"]
    flags += ["--save_strategy", "no", "--logging_steps", "1", "--disable_tqdm", "true"]
    trl_of_this_interpreter = [sys.executable, "-c", "import sys; from trl.cli import main; sys.exit(main())"]
    return [*trl_of_this_interpreter, "sft", "--config", recipe_path, *flags]


def tvopd_trl_command(*args):
    return [sys.executable, "-m", "tvopd_trl.cli", *args]


def train_command(name, recipe, student, teacher, output_dir, data_dir, server_url=None):
    flags = ["--model_name_or_path", student, "--teacher_model_name_or_path", teacher, "--output_dir", output_dir]
    flags += SHRINK + CPU_LAUNCH[recipe.get("accelerate_config", "single_gpu")]
    if "dataset_name" in recipe:
        flags += ["--dataset_name", local_dataset(recipe["dataset_name"], data_dir)]
    if recipe.get("use_vllm") and recipe.get("vllm_mode") == "server":
        host, port = server_url.removeprefix("http://").split(":")
        flags += ["--vllm_server_host", host, "--vllm_server_port", port]
    if recipe.get("use_vllm") and recipe.get("vllm_mode") == "colocate":
        # On a CPU the share is of the RAM, and it holds the whole process (the trainer's models too) and the KV cache:
        # the recipe's half took 18 GB here, 0.05 left no room for the cache
        flags += ["--vllm_max_model_length", "512", "--vllm_gpu_memory_utilization", "0.2"]
    if recipe.get("teacher_model_server_url"):
        # The pool's replicas (a JSON list on the command line): the one server, twice
        flags += ["--teacher_model_server_url", json.dumps([server_url, server_url])]
    return tvopd_trl_command("train", "--config", name, *flags)


def run_logged(command, log_path, env=None):
    """Runs `command` with its output in `log_path`; (passed, seconds)."""
    start = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.run(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**VLLM_CPU_ENV, **os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
    return process.returncode == 0, time.monotonic() - start


def log_tail(path, lines=15):
    with open(path, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def rehearse(model, output_dir, data_dir=None, recipes=None, keep_weights=False, log=print):
    """Rehearses `recipes` (every paper recipe by default; the SFT one always runs, as their student's source) with
    `model`, in `output_dir`: `<pair>/<recipe>/` runs, `logs/`, `report/<pair>/`. Each run is evaluated as soon as it
    has trained; then, unless `keep_weights`, its weights and optimizer states are deleted (the runs' records, logs and
    evaluations stay): 30 runs would otherwise take about 33 GB. Returns the `Rehearsal` of each."""
    from trl.import_utils import is_vllm_available

    from .job import check_model_source
    from .testing import LocalVLLMServer

    unknown = sorted(set(recipes or ()) - set(paper_recipes()))
    if unknown:
        raise ValueError(
            f"{', '.join(unknown)}: not a paper recipe; the rehearsal runs those of {' and '.join(PAPER_PAIRS)} "
            "(`tvopd-trl recipes` lists them)"
        )
    check_model_source(model, "The rehearsal's model")
    output_dir = os.path.abspath(output_dir)
    logs = os.path.join(output_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    has_vllm = is_vllm_available()
    names = [name for name in (recipes or paper_recipes()) if name != SFT_RECIPE]
    sft_dir = os.path.join(output_dir, SFT_RECIPE)
    student = os.path.join(sft_dir, "model")

    def run(rehearsal, env=None):
        rehearsal.log = os.path.join(logs, rehearsal.recipe.replace("/", "__") + ".log")
        log(f"{rehearsal.recipe}: {' '.join(rehearsal.command[1:])}")
        passed, rehearsal.seconds = run_logged(rehearsal.command, rehearsal.log, env)
        rehearsal.status = "passed" if passed else "failed"
        log(f"{rehearsal.recipe}: {rehearsal.status} in {rehearsal.seconds:.0f} s")
        if not passed:
            log(log_tail(rehearsal.log))
        return rehearsal

    results = [run(Rehearsal(SFT_RECIPE, sft_command(model, sft_dir, data_dir)), env={"DS_ACCELERATOR": "cpu"})]
    plans = {name: read_recipe(name) for name in names}
    evaluated = {pair: [] for pair in PAPER_PAIRS}  # each pair's evaluated runs
    servers = {}
    try:
        for name, recipe in plans.items():
            rehearsal = Rehearsal(name, reason=why_not(recipe, has_vllm))
            if results[0].status != "passed" and not rehearsal.reason:
                rehearsal.reason = f"its student, {SFT_RECIPE}'s, failed"
            if rehearsal.reason:
                log(f"{name}: not run: {rehearsal.reason}")
                results.append(rehearsal)
                continue
            url = None
            if needs_server(recipe):
                # The student's rollouts from a server of the student (each run loads its weights at its first
                # step), the pool's teacher from one of the teacher
                role = "teacher" if recipe.get("teacher_model_server_url") else "rollouts"
                if role not in servers:
                    served = model if role == "teacher" else student
                    servers[role] = LocalVLLMServer(served, logs, max_model_len=512, env=VLLM_CPU_ENV)
                    servers[role].wait_ready()
                url = servers[role].url
            run_dir = os.path.join(output_dir, name)
            rehearsal.command = train_command(name, recipe, student, model, run_dir, data_dir, url)
            results.append(run(rehearsal))
            if rehearsal.status == "passed":
                pair = name.split("/")[0]
                # The Student row once a pair: `tvopd-trl report` takes it from the first run that has it
                rehearsal.status = evaluate(rehearsal, student if not evaluated[pair] else None, run)
                if rehearsal.status == "passed":
                    evaluated[pair].append(rehearsal)
                if not keep_weights:
                    delete_weights(run_dir)
    finally:
        for server in servers.values():
            server.stop()
    results += [report(pair, runs, output_dir, run) for pair, runs in evaluated.items() if runs]
    return results


def evaluate(rehearsal, student, run):
    """`tvopd-trl eval` of a run's checkpoint (and, given `student`, of the model it started from): the rehearsal's
    new status, "failed" with the reason where the evaluation failed."""
    run_dir = rehearsal.command[rehearsal.command.index("--output_dir") + 1]
    command = tvopd_trl_command("eval", "--model", run_dir, *EVAL)
    if student is not None:
        command += ["--student", student]
    done = run(Rehearsal(f"{rehearsal.recipe}-eval", command=command))
    rehearsal.seconds += done.seconds
    if done.status != "passed":
        rehearsal.reason, rehearsal.log = "its evaluation (`tvopd-trl eval`) failed", done.log
    return done.status


def report(pair, runs, output_dir, run):
    """`tvopd-trl select` and `report` over a pair's evaluated runs: one `Rehearsal` named `<pair>/report`, failed at
    the first command that fails."""
    folders = [os.path.join(output_dir, r.recipe) for r in runs]
    methods = [f"--method={r.recipe.split('/')[1]}={folder}" for r, folder in zip(runs, folders, strict=True)]
    steps = [
        tvopd_trl_command("select", *folders, *PROTOCOL),
        tvopd_trl_command("report", *methods, *PROTOCOL, "--output_dir", os.path.join(output_dir, "report", pair)),
    ]
    total = Rehearsal(f"{pair}/report", command=steps[-1], status="passed")
    for index, step in enumerate(steps):
        done = run(Rehearsal(f"{pair}/report-{index}", command=step))
        total.seconds += done.seconds
        if done.status != "passed":
            total.status, total.log, total.reason = "failed", done.log, f"`tvopd-trl {step[3]}` failed"
            break
    return total


def delete_weights(run_dir):
    """Deletes a run's weights and optimizer states, its final model's and its checkpoints', keeping their records."""
    for folder in [run_dir, *glob.glob(os.path.join(run_dir, "checkpoint-*"))]:
        for path in heavy_parts(folder):
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)


def summary_table(results):
    """A Markdown table of the rehearsals: recipe, outcome, seconds, and why not where one did not run."""
    lines = ["| recipe | outcome | seconds | why not / log |", "| --- | --- | ---: | --- |"]
    for r in results:
        note = r.reason or (os.path.basename(r.log) if r.log and r.status == "failed" else "")
        lines.append(f"| {r.recipe} | {r.status} | {r.seconds:.0f} | {note} |")
    return "\n".join(lines) + "\n"
