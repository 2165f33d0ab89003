"""The local Hub stand-in (`tests/hub_stand_in.py`) against the real `huggingface_hub` and `transformers` clients."""

import json
import os
import subprocess
import sys

import huggingface_hub.constants
import pytest
import torch
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import HfHubHTTPError
from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer, TrainingArguments

from .hub_stand_in import local_hub
from .timeouts import time_limit


@pytest.fixture
def hub():
    with local_hub(token="hf_test") as hub:
        yield hub


@pytest.fixture
def folder(tmp_path):
    """A folder like a small checkpoint: a text file, a ~2 MB binary file in a subfolder, and a file to ignore."""
    root = tmp_path / "upload"
    (root / "weights").mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"hidden_size": 16}))
    (root / "weights" / "model.safetensors").write_bytes(os.urandom(2 * 1024 * 1024 + 3))
    (root / "optimizer.pt").write_bytes(b"not uploaded")
    return root


@pytest.mark.parametrize("disable_xet", [False, True], ids=["pipelined", "create_commit"])
def test_upload_folder_round_trips_bytes(hub, folder, tmp_path, monkeypatch, disable_xet):
    # With hf_xet installed, upload_folder streams through the pipelined uploader; without it, through create_commit.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", disable_xet)
    api = HfApi(endpoint=hub.endpoint, token="hf_test")
    assert api.whoami()["name"] == "user"
    url = api.create_repo("user/tiny", private=True, exist_ok=True)
    assert url.repo_id == "user/tiny"
    assert api.create_repo("user/tiny", exist_ok=True).repo_id == "user/tiny"  # exists: 409, tolerated

    info = api.upload_folder(
        repo_id="user/tiny", folder_path=folder, commit_message="Add weights", ignore_patterns=["*.pt"]
    )
    assert info.oid == hub.commits[-1]["oid"]
    files = {p: (folder / p).read_bytes() for p in ("config.json", "weights/model.safetensors")}
    assert hub.repos["user/tiny"] == files
    assert hub.commits == [
        {
            "repo_id": "user/tiny",
            "repo_type": "model",
            "message": "Add weights",
            "description": "",
            "files": sorted(files),
            "deleted": [],
            "oid": info.oid,
        }
    ]
    api.upload_file(path_or_fileobj=b"# tiny\n", path_in_repo="README.md", repo_id="user/tiny", commit_message="Card")
    assert hub.repos["user/tiny"]["README.md"] == b"# tiny\n"

    # Reading it back through the client.
    assert sorted(api.list_repo_files("user/tiny")) == ["README.md", "config.json", "weights/model.safetensors"]
    model_info = api.model_info("user/tiny")
    assert model_info.private and model_info.sha == hub.commits[-1]["oid"]
    assert {s.rfilename: s.size for s in model_info.siblings}["weights/model.safetensors"] == len(
        files["weights/model.safetensors"]
    )
    path = hf_hub_download(
        "user/tiny", "weights/model.safetensors", endpoint=hub.endpoint, token="hf_test", cache_dir=tmp_path / "cache"
    )
    with open(path, "rb") as f:
        assert f.read() == files["weights/model.safetensors"]

    # Re-uploading unchanged files makes no commit, like the Hub.
    api.upload_folder(repo_id="user/tiny", folder_path=folder, ignore_patterns=["*.pt"])
    assert len(hub.commits) == 2


@pytest.mark.parametrize("token", [False, "hf_wrong"], ids=["no-token", "wrong-token"])
def test_write_without_valid_token_is_401(hub, folder, token):
    HfApi(endpoint=hub.endpoint, token="hf_test").create_repo("user/tiny")
    api = HfApi(endpoint=hub.endpoint, token=token)
    with pytest.raises(HfHubHTTPError) as err:
        api.create_repo("user/other")
    assert err.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError) as err:
        api.upload_folder(repo_id="user/tiny", folder_path=folder)
    assert err.value.response.status_code == 401
    assert "error" in err.value.response.json()
    if token:
        with pytest.raises(HfHubHTTPError) as err:
            api.whoami()
        assert err.value.response.status_code == 401
    assert hub.repos == {"user/tiny": {}} and hub.commits == []


def test_hf_endpoint_env_var_redirects_a_subprocess(hub):
    code = "from huggingface_hub import HfApi, create_repo; create_repo('user/sub'); print(HfApi().whoami()['name'])"
    env = {**os.environ, **hub.env}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=time_limit(120)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["user"]
    assert "user/sub" in hub.repos


def test_trainer_push_to_hub(hub, tmp_path):
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    ids = torch.randint(0, 64, (8, 6))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        push_to_hub=True,
        hub_model_id="user/tiny",
        hub_token="hf_test",
        max_steps=2,
        per_device_train_batch_size=4,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
    )
    with hub.as_default():  # Trainer takes no endpoint: point huggingface_hub's defaults at the local Hub
        trainer = Trainer(model=model, args=args, train_dataset=dataset)
        assert "user/tiny" in hub.repos  # init_hf_repo created it
        trainer.train()
        trainer.push_to_hub(commit_message="End of training")
        reloaded = Qwen2ForCausalLM.from_pretrained("user/tiny", token="hf_test", cache_dir=str(tmp_path / "cache"))

    assert hub.commits[-1]["message"] == "End of training"
    files = hub.repos["user/tiny"]
    assert {"config.json", "model.safetensors", "README.md", "training_args.bin"} <= set(files)
    assert json.loads(files["config.json"])["hidden_size"] == 16
    with open(tmp_path / "out" / "model.safetensors", "rb") as f:
        assert files["model.safetensors"] == f.read()
    for name, tensor in trainer.model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor)
