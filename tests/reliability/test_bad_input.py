"""Bad input gets a clear error that names the fix, before any model loads."""

import json

import pytest
import trl.trainer.distillation_trainer as distillation_trainer
from datasets import Dataset

from tvopd_trl import TVOPDTrainer, tiny
from tvopd_trl.cli import main as cli
from tvopd_trl.job import LAUNCHED_BY_CLI, check_recipe_launch
from tvopd_trl.scripts.train import check_launch_options
from tvopd_trl.scripts.train import run as train
from tvopd_trl.testing import build_tokenizer, tiny_config


@pytest.fixture(autouse=True)
def no_model_loads(monkeypatch):
    """Every error below must come before TRL loads a model."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(distillation_trainer, "create_model_from_path", refuse)


def _trainer(tmp_path, **overrides):
    kwargs = {
        "model": tiny.student_path(),
        "teacher_model": tiny.teacher_path(),
        "args": tiny_config(tmp_path),
        "train_dataset": tiny.prompt_dataset("opd", n=64),
    } | overrides
    return TVOPDTrainer(**kwargs)


def test_a_dataset_without_the_prompt_column(tmp_path):
    with pytest.raises(ValueError, match=r"no `prompt` column \(its columns: question\).*dataset_prompt_column"):
        _trainer(tmp_path, train_dataset=Dataset.from_dict({"question": ["1 + 1?"] * 8}))


def test_the_main_job_names_the_column_and_the_adapter_option(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"query": "1 + 1?", "answer": "2"}) + "\n")
    flags = ["--config", "recipes/tiny/tvopd.yaml", "--output_dir", str(tmp_path / "run"), "--eval_problems", "0"]
    with pytest.raises(ValueError, match=r"query.*dataset_prompt_column"):
        train(
            [
                *flags,
                "--model_name_or_path",
                tiny.student_path(),
                "--teacher_model_name_or_path",
                tiny.teacher_path(),
                "--dataset_name",
                str(data),
            ]
        )


def test_an_empty_dataset(tmp_path):
    with pytest.raises(ValueError, match="The training dataset is empty"):
        _trainer(tmp_path, train_dataset=Dataset.from_dict({"prompt": []}))


@pytest.mark.parametrize("role", ["model", "teacher_model"])
def test_a_path_that_does_not_exist(tmp_path, role):
    missing = str(tmp_path / "checkpoints" / "teacher")
    with pytest.raises(FileNotFoundError, match=rf"`{role}` '.*checkpoints/teacher' does not exist"):
        _trainer(tmp_path, **{role: missing})


def test_chat_prompts_without_a_chat_template(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat messages but the tokenizer has no chat template"):
        _trainer(tmp_path, processing_class=tokenizer)


@pytest.mark.parametrize("length", [0, -4])
def test_a_completion_length_below_one(tmp_path, length):
    with pytest.raises(ValueError, match=f"max_completion_length must be >= 1, got {length}"):
        tiny_config(tmp_path, max_completion_length=length)


def test_num_iterations_below_one(tmp_path):
    with pytest.raises(ValueError, match="num_iterations must be >= 1, got 0"):
        tiny_config(tmp_path, num_iterations=0)


def test_mismatched_tokenizers(tmp_path):
    teacher_tokenizer = build_tokenizer()
    teacher_tokenizer.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match=r"must share one tokenizer.*1 only in the teacher \['<extra>'\]"):
        _trainer(tmp_path, processing_class=build_tokenizer(), teacher_processing_class=teacher_tokenizer)


def test_an_unknown_recipe_key(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(open("recipes/tiny/tvopd.yaml").read() + "tv_alhpa: 0.25\n")
    with pytest.raises(ValueError, match=r"Unknown option --tv_alhpa \(did you mean --tv_alpha\?\)"):
        train(["--config", str(recipe), "--output_dir", str(tmp_path / "run")])
    assert cli(["train", "--config", str(recipe), "--output_dir", str(tmp_path / "run")]) == 2
    assert "--tv_alhpa (did you mean --tv_alpha?)" in capsys.readouterr().err
    # `accelerate launch` options stay allowed in a recipe: `tvopd-trl train` passes them on.
    check_launch_options(["--num_processes", "2", "--mixed_precision", "no", "--accelerate_config", "zero3"])


@pytest.mark.parametrize(
    "keys, message",
    [
        ("num_processes: 8\n", r"\(8 processes asked for, 1 launched\)"),
        ("accelerate_config: zero3\n", r"zero3.yaml is DEEPSPEED, this launch NO, 8 processes asked for"),
    ],
)
def test_a_recipe_s_launch_settings_are_not_dropped_outside_tvopd_trl_train(keys, message, tmp_path, monkeypatch):
    """`accelerate launch -m tvopd_trl.scripts.train --config RECIPE` (here: one plain process) does not apply the
    recipe's launch keys: a launch that differs from them is refused, unless `tvopd-trl train` (or the Slurm script)
    launched it with them."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(open("recipes/tiny/tvopd.yaml").read() + keys)
    monkeypatch.delenv(LAUNCHED_BY_CLI, raising=False)
    with pytest.raises(ValueError, match=message + r".* Run `tvopd-trl train`"):
        train(["--config", str(recipe), "--output_dir", str(tmp_path / "run")])
    check_recipe_launch(["--num_processes", "1"])  # the launch it asks for
    monkeypatch.setenv(LAUNCHED_BY_CLI, "1")
    check_recipe_launch(["--num_processes", "8"])
