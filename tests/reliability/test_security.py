"""Security hygiene: no remote code unless asked, tensors through safetensors, recipes as data, tokens kept secret."""

import ast
import os
import pathlib

import pytest
import trl.trainer.distillation_trainer as distillation_trainer
import yaml

import tvopd_trl
from tvopd_trl import TVOPDTrainer, tiny
from tvopd_trl.scripts.train import make_parser
from tvopd_trl.study import load_study
from tvopd_trl.testing import tiny_config, tiny_pair_trainer


PACKAGE = pathlib.Path(tvopd_trl.__file__).parent


def test_models_load_without_remote_code_unless_asked(tmp_path, monkeypatch):
    seen = []

    def record(path, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        raise RuntimeError("recorded")

    monkeypatch.setattr(distillation_trainer, "create_model_from_path", record)
    args = tiny_config(tmp_path)
    assert args.trust_remote_code is False
    with pytest.raises(RuntimeError, match="recorded"):
        TVOPDTrainer(
            model=tiny.student_path(),
            teacher_model=tiny.teacher_path(),
            args=args,
            train_dataset=tiny.prompt_dataset("opd", n=64),
        )
    assert seen and not any(seen)


def test_the_package_never_unpickles():
    """No `pickle.load(s)`, and `torch.load` only with `weights_only=True`, anywhere in the package; models are saved
    as safetensors."""
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = getattr(node.func.value, "id", None)
                assert (owner, node.func.attr) not in {("pickle", "load"), ("pickle", "loads")}, path
                if (owner, node.func.attr) == ("torch", "load"):
                    options = {k.arg: getattr(k.value, "value", None) for k in node.keywords}
                    assert options.get("weights_only") is True, path
    for member in ("student", "teacher"):
        files = os.listdir(os.path.join(PACKAGE, "tiny", "checkpoints", member))
        assert "model.safetensors" in files and not any(f.endswith((".bin", ".pt", ".pth")) for f in files)


def test_checkpoint_weights_are_safetensors(tmp_path):
    trainer = tiny_pair_trainer(tiny_config(tmp_path, max_steps=1, save_strategy="steps", save_steps=1), prompts=16)
    trainer.train()
    files = os.listdir(tmp_path / "checkpoint-1")
    assert "model.safetensors" in files and "pytorch_model.bin" not in files


PAYLOAD = '!!python/object/apply:os.system ["touch {marker}"]'


def test_recipes_are_parsed_as_data(tmp_path):
    marker = tmp_path / "pwned"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"learning_rate: {PAYLOAD.format(marker=marker)}\n")
    with pytest.raises(yaml.constructor.ConstructorError):
        make_parser().parse_args_and_config(args=["--config", str(recipe)], return_remaining_strings=True)
    study = tmp_path / "study.yaml"
    study.write_text(f"recipe: {PAYLOAD.format(marker=marker)}\n")
    with pytest.raises(yaml.constructor.ConstructorError):
        load_study(str(study))
    assert not marker.exists()


def test_the_hub_token_never_reaches_logs_or_cards(tmp_path, capfd):
    secret = "hf_tvopdSecretToken0123456789"
    args = tiny_config(tmp_path, max_steps=2, logging_steps=1, save_strategy="steps", save_steps=2, hub_token=secret)
    trainer = tiny_pair_trainer(args, prompts=16)
    trainer.train()
    trainer.save_model()
    trainer.create_model_card(model_name="tiny")
    captured = capfd.readouterr()
    assert secret not in captured.out + captured.err
    assert secret not in str(trainer.state.log_history) and secret not in str(args.to_dict())
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), (
                path
            )  # README.md, trainer_state.json, training_args.bin...
