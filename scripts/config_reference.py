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
"""The configuration reference (docs/config-reference.md), generated from the dataclass docstrings.

```bash
python scripts/config_reference.py   # rewrites docs/config-reference.md; a test fails while it is stale
```
"""

import inspect
import os
import re

from tvopd_trl.config import TVOPDConfig
from tvopd_trl.job import MainJobArguments
from tvopd_trl.scripts.doctor import DoctorArguments
from tvopd_trl.scripts.evaluate import EvalArguments


PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "config-reference.md")


def _classes():
    return [
        (
            TVOPDConfig,
            "`TVOPDConfig`: the trainer (and `tvopd-trl train`)",
            "Every field of `trl.DistillationConfig` and "
            "`transformers.TrainingArguments` applies too; these are the ones TV-OPD adds or changes.",
        ),
        (
            MainJobArguments,
            "`MainJobArguments`: `tvopd-trl train` beyond the trainer",
            "The student and how it loads are TRL's `trl.ModelConfig`, as in TRL's own scripts: `model_name_or_path` "
            "(default: the embedded tiny student), `dtype` (`float32`, `bfloat16`, `float16` or `auto`; default: "
            "float32 for the student and each teacher's `teacher_model_init_kwargs`, else its checkpoint's dtype; set, "
            "it loads the teachers too), `attn_implementation` (student and teachers), `model_revision`, LoRA "
            "(`use_peft`, `lora_r`, `lora_alpha`, `lora_dropout`, `lora_target_modules`, ...: the run saves an adapter) "
            "and `load_in_4bit` / `load_in_8bit` (bitsandbytes, on a GPU; not verified here). A recipe's "
            "`model_init_kwargs` / `teacher_model_init_kwargs` win over them.",
        ),
        (EvalArguments, "`EvalArguments`: `tvopd-trl eval`", None),
        (DoctorArguments, "`DoctorArguments`: `tvopd-trl doctor` beyond the options of `tvopd-trl train`", None),
    ]


# Not a dataclass field: how sequence parallelism is configured, after `TVOPDConfig`'s fields.
SEQUENCE_PARALLELISM = """\
## Sequence parallelism: accelerate's `parallelism_config`

Not a field that TV-OPD adds: `parallelism_config` is `transformers.TrainingArguments`' (an
`accelerate.ParallelismConfig`), which TRL's `DistillationConfig` refuses with `sp_size` or `cp_size` above 1.
`TVOPDConfig` accepts `sp_size` above 1 with `sp_backend="deepspeed"`: DeepSpeed's Ulysses, in the loss phase, under a
DeepSpeed launch (`distributed_type: DEEPSPEED`, any ZeRO stage). It is set in one of three places:

- the accelerate config file's `parallelism_config` section: `parallelism_config_sp_size`,
  `parallelism_config_sp_backend: deepspeed`, `parallelism_config_sp_attn_implementation` (the student's attention:
  `sdpa`, `flash_attention_2` or `flash_attention_3`) and, with several SP groups, `parallelism_config_dp_shard_size`
  = processes / sp_size, from which accelerate counts DeepSpeed's batch size
  (`recipes/accelerate_configs/zero3_sp.yaml`: 8 GPUs, sp_size 2, dp_shard_size 4);
- `accelerate launch` flags of the same names (`--parallelism_config_sp_size 2`, or `--parallelism-config-sp-size 2`),
  also through `tvopd-trl train`; they override a config file's section and do nothing without one;
- in Python, `TVOPDConfig(parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed", dp_shard_size=4))`.

An SP group of sp_size processes is one data-parallel replica: `per_device_train_batch_size` is rows per micro-batch
per SP group, and a step takes `per_device_train_batch_size` x `gradient_accumulation_steps` x (processes / sp_size)
prompts. Refused, each with an error that names the fix: an sp_size that does not divide the processes, the student's
attention heads, or its KV heads (which may also divide sp_size); a student attention implementation other than
`sdpa`, `flash_attention_2` or `flash_attention_3`, or other than the config's `sp_attn_implementation`;
`sp_seq_length_is_variable: false`; `cp_size` above 1 (use sp_size); FSDP or FSDP2 with sp_size above 1 (use a
DeepSpeed ZeRO-3 config); `padding_free`; `max_tokens_per_micro_batch`; rollout rows per SP group
(`per_device_train_batch_size` x `gradient_accumulation_steps` x `steps_per_generation`) that sp_size does not
divide. What it changes and what it saves: [scaling.md](scaling.md#10-sequence-parallelism).
"""
AFTER = {TVOPDConfig: SEQUENCE_PARALLELISM}


def _parameters(docstring):
    """(group title, [(signature line, description)]) pairs of a TRL-style "Parameters:" docstring section."""
    lines = inspect.cleandoc(docstring).splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "Parameters:")
    groups, entry = [], None
    for line in lines[start + 1 :]:
        if line and not line.startswith("    "):  # the section ends at the next unindented line
            break
        text = line.strip()
        if text.startswith("> "):
            groups.append((text[2:], []))
        elif re.match(r"^ {4}\S", line):
            entry = [text.rstrip(":"), []]
            groups[-1][1].append(entry)
        elif text and entry is not None:
            entry[1].append(text)
    return [(title, [(signature, " ".join(words)) for signature, words in entries]) for title, entries in groups]


def documented_fields(cls):
    """The field names that `cls`'s docstring documents."""
    names = set()
    for _, entries in _parameters(cls.__doc__):
        for signature, _ in entries:
            head = signature.split(" (")[0] if "(" in signature else signature
            names.update(name.strip() for name in head.split(","))
    return names


def render():
    """The whole reference, as Markdown."""
    out = [
        "# Configuration reference",
        "",
        "Generated from the dataclass docstrings by `python scripts/config_reference.py`; do not edit by hand.",
        "Recipes set these as YAML keys, and the command line as `--name value` flags.",
    ]
    for cls, title, note in _classes():
        out += ["", f"## {title}", ""]
        if note:
            out += [note, ""]
        for group, entries in _parameters(cls.__doc__):
            out += [f"### {group}", ""]
            for signature, description in entries:
                if "(" in signature:  # "name (`type`, *optional*, defaults to ...)"
                    name, _, rest = signature.partition(" ")
                    out.append(f"- **`{name}`** {rest}: {description}")
                else:  # several fields described together: "a, b, c"
                    names = ", ".join(f"**`{name.strip()}`**" for name in signature.split(","))
                    out.append(f"- {names}: {description}")
            out.append("")
        if cls in AFTER:
            out += ["", AFTER[cls]]
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    with open(PATH, "w", encoding="utf-8") as f:
        f.write(render())
    print(f"wrote {PATH}")
