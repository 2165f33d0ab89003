"""What an installed package needs and a checkout hides: the embedded default without flags, the recipes by name, the
benchmarks offline, all of it inside the wheel. `.ci/run` installs the wheel into a fresh environment and runs both
commands from a temporary directory."""

import filecmp
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from tvopd_trl import cli
from tvopd_trl.eval.benchmarks import PACKAGED_DIR
from tvopd_trl.job import DEFAULT_RECIPE
from tvopd_trl.packaged_recipes import RECIPES_DIR, find_recipe, recipe_names
from tvopd_trl.tiny import student_path

from .timeouts import time_limit


ROOT = Path(__file__).resolve().parent.parent


def parse_job(argv, monkeypatch):
    """The main job's (job_args, training_args, model_args) for `tvopd-trl train ARGV`, without training."""
    from tvopd_trl.scripts import train

    parsed = []
    monkeypatch.setattr(train, "main", lambda *args: parsed.append(args))
    assert train.run(argv) == 0
    return parsed[0]


# The embedded default


def test_without_a_recipe_the_job_runs_the_tiny_recipe_in_the_machines_precision(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    job_args, training_args, model_args = parse_job([], monkeypatch)
    reference_job, reference, reference_model = parse_job(
        ["--config", str(ROOT / "recipes" / "tiny" / "tvopd.yaml")], monkeypatch
    )
    assert (job_args, training_args.to_dict(), model_args) == (reference_job, reference.to_dict(), reference_model)
    assert DEFAULT_RECIPE == "tiny/tvopd" and training_args.output_dir == "outputs/tiny/tvopd"
    assert (training_args.max_steps, training_args.learning_rate, training_args.bf16) == (300, 1e-3, False)
    assert parse_job(["--max_steps", "3"], monkeypatch)[1].max_steps == 3  # flags override it


def test_the_precision_follows_the_hardware_unless_set(monkeypatch, tmp_path):
    import tvopd_trl.config

    # A bf16-capable GPU, as transformers sees it (`use_cpu`: this machine's TrainingArguments would refuse bf16).
    monkeypatch.setattr(tvopd_trl.config, "is_torch_bf16_gpu_available", lambda: True)
    assert parse_job(["--use_cpu", "true", "--output_dir", str(tmp_path)], monkeypatch)[1].bf16 is True
    assert parse_job(["--use_cpu", "true", "--bf16", "false"], monkeypatch)[1].bf16 is False
    recipe = tmp_path / "fp32.yaml"
    recipe.write_text(Path(find_recipe("tiny/tvopd")).read_text() + "bf16: false\n")
    assert parse_job(["--config", str(recipe), "--use_cpu", "true"], monkeypatch)[1].bf16 is False


def test_a_model_of_ones_own_does_not_get_the_tiny_recipe(monkeypatch):
    from tvopd_trl.scripts.train import make_parser

    flags = ["--model_name_or_path", "me/student", "--teacher_model_name_or_path", "me/teacher"]
    _, training_args, _ = make_parser().parse_args_and_config(flags)
    assert training_args.max_completion_length != 8 and training_args.output_dir != "outputs/tiny/tvopd"


# Recipes by name


def test_the_checkouts_recipes_folder_is_the_packaged_one():
    assert (ROOT / "recipes").resolve() == RECIPES_DIR.resolve()
    files = sorted(str(path.relative_to(RECIPES_DIR)) for path in RECIPES_DIR.rglob("*") if path.is_file())
    assert "tiny/tvopd.yaml" in files and "slurm/train.slurm" in files and "README.md" in files
    assert recipe_names() == sorted(name.removesuffix(".yaml") for name in files if name.endswith(".yaml"))


def test_a_recipe_is_found_by_name_or_by_its_repository_path_from_anywhere(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    packaged = str(RECIPES_DIR / "tiny" / "tvopd.yaml")
    for name in ("tiny/tvopd", "tiny/tvopd.yaml", "recipes/tiny/tvopd.yaml", "./recipes/tiny/tvopd"):
        assert find_recipe(name) == packaged, name
    (tmp_path / "mine.yaml").write_text("max_steps: 1\n")
    assert find_recipe("mine.yaml") == "mine.yaml"  # a file always wins
    with pytest.raises(FileNotFoundError, match="did you mean qwen3-8b_to_qwen3-8b-sft/tvopd"):
        find_recipe("qwen3-8b_to_qwen3-8b_sft/tvopd")


def test_recipes_lists_and_prints_the_packaged_ones(capsys):
    assert cli.main(["recipes"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in recipe_names())
    assert "tiny/tvopd " in listing and "tvopd on the embedded tiny pair" in listing
    assert cli.main(["recipes", "tiny/raw"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["advantage_mode"] == "raw"


def test_names_work_for_a_study_and_for_our_accelerate_configs(monkeypatch, tmp_path):
    from tvopd_trl.job import accelerate_launch_args
    from tvopd_trl.study import load_study

    monkeypatch.chdir(tmp_path)
    assert load_study("tiny/study_smoke").recipe == "recipes/tiny/tvopd.yaml"  # resolved by the runs' own parser
    ours = str(RECIPES_DIR / "accelerate_configs" / "zero3_cpu.yaml")
    for name in ("zero3_cpu", "accelerate_configs/zero3_cpu", "recipes/accelerate_configs/zero3_cpu.yaml"):
        assert accelerate_launch_args([], ["--accelerate_config", name]) == ["--config_file", ours], name
    # A name both ship is ours, so that an edit to recipes/accelerate_configs/zero3.yaml takes effect; TRL's others
    # are still found by name
    zero3 = str(RECIPES_DIR / "accelerate_configs" / "zero3.yaml")
    assert accelerate_launch_args(["--accelerate_config", "zero3"], []) == ["--config_file", zero3]
    assert accelerate_launch_args([], ["--accelerate_config", "zero1"])[1].endswith(
        "trl/accelerate_configs/zero1.yaml"
    )


# Benchmarks offline, and the wheel


def test_eval_runs_offline_on_the_packaged_benchmark(monkeypatch, tmp_path):
    import json

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr("datasets.load_dataset", offline)
    monkeypatch.delenv("TVOPD_BENCHMARK_DIR", raising=False)
    argv = ["eval", "--benchmarks", "aime24", "--k", "1", "--max_new_tokens", "8", "--model", student_path()]
    assert cli.main([*argv, "--output_dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["benchmarks"]["aime24"]["problems"] == 30


def test_the_wheel_carries_the_recipes_the_benchmarks_and_the_embedded_pair(tmp_path):
    # With build isolation: pip fetches the setuptools pyproject.toml asks for (a fresh venv may have none).
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), "."],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=time_limit(300),
    )
    (wheel,) = tmp_path.glob("tvopd_trl-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path / "unpacked")
    unpacked = tmp_path / "unpacked" / "tvopd_trl"
    package = ROOT / "tvopd_trl"
    for folder in ("recipes", "eval/data", "tiny/checkpoints"):
        files = [path.relative_to(package) for path in (package / folder).rglob("*") if path.is_file()]
        assert files, folder
        missing = [str(path) for path in files if not (unpacked / path).is_file()]
        assert not missing, f"left out of the wheel: {missing}"
        assert all(filecmp.cmp(package / path, unpacked / path, shallow=False) for path in files)
    assert Path(PACKAGED_DIR) == package / "eval" / "data" and (unpacked / "eval" / "data" / "README.md").is_file()
