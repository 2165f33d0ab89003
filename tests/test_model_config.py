"""TRL's model arguments (`trl.ModelConfig`) on the main job's command line and in its recipes, as TRL's own scripts
take them: `--model_name_or_path`, `--dtype`, `--attn_implementation`, `--use_peft --lora_r ... --lora_target_modules
...`; and a LoRA run's adapter, which `tvopd-trl eval` and `tvopd-trl push` take."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tvopd_trl import tiny
from tvopd_trl.cli import main as cli
from tvopd_trl.job import apply_model_config
from tvopd_trl.scripts.train import make_parser

from .hub_stand_in import local_hub
from .timeouts import time_limit


ROOT = Path(__file__).resolve().parent.parent
MODEL_FLAGS = ["--use_peft", "--lora_r", "16", "--lora_target_modules", "all-linear"]
MODEL_FLAGS += ["--dtype", "bfloat16", "--attn_implementation", "sdpa"]
MODEL_KEYS = "use_peft: true\nlora_r: 16\nlora_target_modules: all-linear\n"
MODEL_KEYS += "dtype: bfloat16\nattn_implementation: sdpa\n"


def parse(*flags):
    return make_parser().parse_args_and_config(["--config", "tiny/tvopd", "--output_dir", "unused", *flags])


def test_trl_model_flags_and_recipe_keys_go_to_model_config(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((ROOT / "recipes" / "tiny" / "tvopd.yaml").read_text() + MODEL_KEYS)
    from_yaml = make_parser().parse_args_and_config(["--config", str(recipe), "--output_dir", "unused"])
    for _, training_args, model_args in (parse(*MODEL_FLAGS), from_yaml):
        assert (model_args.dtype, model_args.attn_implementation) == ("bfloat16", "sdpa")
        options = apply_model_config(model_args, training_args)
        # As TRL's distillation script: the student's and the teacher's loading options, and the LoRA wrapper
        assert training_args.model_init_kwargs == {"dtype": "bfloat16", "attn_implementation": "sdpa"}
        assert training_args.teacher_model_init_kwargs == {"dtype": "bfloat16", "attn_implementation": "sdpa"}
        peft_config = options["peft_config"]
        assert isinstance(peft_config, LoraConfig)
        assert (peft_config.r, peft_config.target_modules) == (16, "all-linear")
        assert options["quantization_config"] is None


def test_a_recipes_own_init_kwargs_win_over_the_model_flags():
    _, training_args, model_args = parse(
        "--dtype", "bfloat16", "--model_revision", "v1", "--teacher_model_init_kwargs", '{"dtype": "float32"}'
    )
    apply_model_config(model_args, training_args)
    assert training_args.model_init_kwargs == {"dtype": "bfloat16", "revision": "v1"}
    assert training_args.teacher_model_init_kwargs == {"dtype": "float32"}


def test_without_model_flags_the_job_loads_as_before():
    _, training_args, model_args = parse()
    assert model_args.model_name_or_path is None and model_args.dtype is None  # not TRL's float32: see `JobParser`
    options = apply_model_config(model_args, training_args)
    # Nothing is added: the student loads in the trainer's float32, the teacher in its checkpoint's dtype, and the
    # precision stays the machine's (`bf16` on a GPU that has it)
    assert training_args.model_init_kwargs is None and training_args.teacher_model_init_kwargs is None
    assert options == {"peft_config": None, "quantization_config": None}
    assert training_args.bf16 is False  # this machine has no GPU


def test_model_name_or_path_names_the_student():
    flags = ["--model_name_or_path", tiny.student_path(), "--teacher_model_name_or_path", tiny.teacher_path()]
    job_args, training_args, model_args = parse(*flags, "--eval_problems", "0")
    assert model_args.model_name_or_path == tiny.student_path() and not hasattr(job_args, "model_name_or_path")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """`tvopd-trl train` with TRL's LoRA flags, two steps on the embedded pair."""
    output_dir = tmp_path_factory.mktemp("lora")
    command = [sys.executable, "-m", "tvopd_trl.cli", "train", "--output_dir", str(output_dir), "--max_steps", "2"]
    command += ["--eval_problems", "0", "--learning_rate", "0.05", "--num_processes", "1", *MODEL_FLAGS]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=time_limit(600), env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir


def test_a_lora_run_saves_an_adapter(lora_run):
    config = json.loads((lora_run / "adapter_config.json").read_text())
    assert config["r"] == 16 and config["base_model_name_or_path"] == tiny.student_path()
    # "all-linear": every projection of both layers, not only the attention's
    assert {name.rsplit(".", 1)[-1] for name in config["target_modules"]} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    weights = load_file(lora_run / "adapter_model.safetensors")
    assert weights and all("lora_" in name for name in weights)
    assert not (lora_run / "model.safetensors").exists()  # the adapter only, not a copy of the base model


def test_eval_takes_the_adapter_merged_into_its_base_model(lora_run, tmp_path):
    from tvopd_trl.scripts.evaluate import _generator

    args = SimpleNamespace(backend="auto", dtype="auto", batch_size=8)
    merged = _generator(args, str(lora_run), []).model
    base = AutoModelForCausalLM.from_pretrained(tiny.student_path())
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    weight = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[weight], base.state_dict()[weight])  # the trained adapter is in it

    output_dir = tmp_path / "eval"
    flags = ["--benchmarks", "tiny", "--k", "1", "--limit", "4", "--max_new_tokens", "8"]
    flags += ["--output_dir", str(output_dir)]
    assert cli(["eval", "--model", str(lora_run), *flags]) == 0
    assert json.loads((output_dir / "results.json").read_text())["benchmarks"]["tiny"]["problems"] == 4


def test_the_vllm_backend_refuses_an_adapter_with_the_fix(lora_run):
    from tvopd_trl.scripts.evaluate import _generator

    with pytest.raises(ValueError, match="is a LoRA adapter.*--backend transformers"):
        _generator(SimpleNamespace(backend="vllm", dtype="auto", batch_size=8), str(lora_run), [])


def test_push_uploads_the_adapter(lora_run):
    with local_hub() as hub, hub.as_default():
        assert cli(["push", str(lora_run), "--repo_id", "user/tiny-lora", "--token", "hf_test"]) == 0
    files = hub.repos["user/tiny-lora"]
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json"):
        assert files[name] == (lora_run / name).read_bytes(), name
