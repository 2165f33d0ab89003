"""Publishing: `tvopd-trl push` (the selected checkpoint and its card) and the main job's `push_to_hub`, against a local
stand-in of the Hub (`tests/hub_stand_in.py`); and the failures without network or token, which leave the run as it was.
"""

import contextlib
import hashlib
import os
from unittest import mock

import pytest

from tvopd_trl.cli import main as cli
from tvopd_trl.eval import BenchmarkEvalCallback, SamplingSettings
from tvopd_trl.push import PushError, push_run
from tvopd_trl.scripts.train import run as train
from tvopd_trl.testing import tiny_config, tiny_pair_trainer

from .hub_stand_in import local_hub


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished 3-step run with a checkpoint and a mean@1 evaluation per step, and `tvopd-trl select`'s choice."""
    output_dir = tmp_path_factory.mktemp("run")
    args = tiny_config(output_dir, max_steps=3, save_strategy="steps", save_steps=1, learning_rate=0.05)
    trainer = tiny_pair_trainer(args, prompts=16)
    settings = SamplingSettings(k=1, max_new_tokens=8)
    trainer.add_callback(BenchmarkEvalCallback(trainer, ["tiny"], 1, settings=settings, limit=8, at_start=False))
    trainer.train()
    trainer.save_model()
    assert cli(["select", str(output_dir), "--benchmarks", "tiny", "--k", "1"]) == 0
    return output_dir


def _snapshot(folder):
    return {
        os.path.relpath(os.path.join(root, name), folder): hashlib.sha256(
            open(os.path.join(root, name), "rb").read()
        ).hexdigest()
        for root, _, names in os.walk(folder)
        for name in names
    }


def test_push_uploads_the_selected_checkpoint_with_its_card(run_dir):
    import json

    selection = json.loads((run_dir / "selection.json").read_text())
    checkpoint = run_dir / f"checkpoint-{selection['step']}"
    before = _snapshot(run_dir)
    with local_hub() as hub, hub.as_default():
        assert cli(["push", str(run_dir), "--repo-id", "user/tiny-tvopd", "--token", "hf_test"]) == 0
    assert _snapshot(run_dir) == before  # the run is only read
    files = hub.repos["user/tiny-tvopd"]
    assert len(hub.commits) == 1
    for name in ("model.safetensors", "config.json", "tokenizer.json", "generation_config.json"):
        assert files[name] == (checkpoint / name).read_bytes(), name
    assert not {"optimizer.pt", "scheduler.pt", "rng_state.pth"} & set(files)  # training internals stay local
    card = files["README.md"].decode()
    # The card saved with that checkpoint: the run up to its step, then how it was chosen and its scores.
    assert "## TV-OPD training" in card and f"- Optimizer steps: {selection['step']}" in card
    assert f"This repository holds step {selection['step']}, chosen by `tvopd-trl select`" in card
    assert f"| tiny | {100 * selection['scores']['tiny']:.1f} |" in card
    assert (
        card.index("## TV-OPD training") < card.index("## Selected checkpoint") < card.index("### Framework versions")
    )


def test_push_without_a_selection_uploads_the_final_model(run_dir, tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    for name in ("model.safetensors", "config.json", "README.md"):
        (final / name).write_bytes((run_dir / name).read_bytes())
    with local_hub() as hub:
        with hub.as_default():
            push_run(str(final), "user/final", token="hf_test")
    assert hub.repos["user/final"]["model.safetensors"] == (run_dir / "model.safetensors").read_bytes()
    assert "the run's final model (no selection.json" in hub.repos["user/final"]["README.md"].decode()


@pytest.mark.parametrize("failure", ["no network", "no token"])
def test_a_failed_push_says_why_and_leaves_the_run_untouched(run_dir, failure, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(run_dir.parent / "hf-home"))  # no saved login either
    before = _snapshot(run_dir)
    with local_hub() as hub, hub.as_default(), contextlib.ExitStack() as stack:
        if failure == "no network":
            # Nothing listens on the discard port. Undone before `as_default` restores the real endpoint: a
            # monkeypatch, undone after that, would leave the stand-in's endpoint to later tests.
            stack.enter_context(mock.patch.object(constants, "ENDPOINT", "http://127.0.0.1:9"))
            token = "hf_test"
        else:
            token = False  # no Authorization header at all
        with pytest.raises(PushError, match="Nothing under .* was changed") as error:
            push_run(str(run_dir), "user/tiny-tvopd", token=token)
    assert "token with write access" in str(error.value) and "hf_test" not in str(error.value)
    assert ("401" in str(error.value)) == (failure == "no token")
    assert hub.repos == {} and _snapshot(run_dir) == before


def test_push_refuses_a_folder_without_weights(run_dir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "global_step3").mkdir()
    assert cli(["push", str(run_dir), "--repo_id", "user/x", "--checkpoint", str(tmp_path / "empty")]) == 2
    assert "zero_to_fp32.py" in capsys.readouterr().err


def test_the_main_job_pushes_with_hub_model_id(tmp_path):
    output_dir = tmp_path / "job"
    flags = ["--config", "recipes/tiny/tvopd.yaml", "--output_dir", str(output_dir), "--max_steps", "2"]
    flags += ["--eval_problems", "0", "--per_device_train_batch_size", "8", "--logging_steps", "1"]
    with local_hub() as hub, hub.as_default():
        train([*flags, "--push_to_hub", "--hub_model_id", "user/tiny-job", "--hub_token", "hf_test"])
    files = hub.repos["user/tiny-job"]
    assert files["model.safetensors"] == (output_dir / "model.safetensors").read_bytes()
    card = files["README.md"].decode()
    assert "## TV-OPD training" in card and "- Optimizer steps: 2" in card and "| `tv/scale` |" in card
    assert "hf_test" not in card and all(b"hf_test" not in content for content in files.values())


def test_the_hub_token_is_never_pickled(tmp_path):
    import pickle

    args = tiny_config(tmp_path, hub_token="hf_secret")
    assert pickle.loads(pickle.dumps(args)).hub_token is None and args.hub_token == "hf_secret"
