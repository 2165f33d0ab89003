import os

import pytest
import torch

from tvopd_trl import TVOPDConfig
from tvopd_trl.testing import arithmetic_prompts, build_model, build_tokenizer


os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer):
    """Student and teacher checkpoints on disk, each with the shared tokenizer, like Hub checkpoints."""
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for name, seed, hidden in (("student", 0, 32), ("teacher", 1, 48)):
        path = root / name
        build_model(tokenizer, seed, hidden_size=hidden).save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = str(path)
    return paths


@pytest.fixture
def prompts():
    return arithmetic_prompts(64, seed=1)


def tiny_config(output_dir, **overrides):
    defaults = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        max_steps=3,
        max_completion_length=8,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    defaults.update(overrides)
    return TVOPDConfig(**defaults)
