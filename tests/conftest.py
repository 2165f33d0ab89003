import functools
import os

import pytest
import torch

from tvopd_trl.testing import build_model, build_tokenizer, tiny_pair_trainer
from tvopd_trl.tiny import prompt_dataset

from .timeouts import (  # noqa: F401  (hooks: TVOPD_TEST_TIMEOUT_SCALE scales the tests' time limits)
    pytest_configure,
    pytest_report_header,
    pytest_runtest_makereport,
    pytest_timeout_set_timer,
)


os.environ.setdefault("OMP_NUM_THREADS", "1")
# vLLM's own switch for its CPU CI, inherited by the servers and engines the tests start: eager model code instead of
# inductor's C++ compile and no warm-up (a tiny server was ready in 51 s instead of 155 s on this machine).
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
# vLLM's CPU worker pins its threads to the cores it picks, the same for every server and engine: here each one ran on
# core 0 alone, a second server's start took 6 minutes beside a busy one, and the other core idled. The scheduler
# spreads unpinned ones over both.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
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
    return prompt_dataset("opd", n=64)


@pytest.fixture
def make_trainer(model_dirs, prompts, tokenizer):
    """`tiny_pair_trainer` on the untrained on-disk pair instead of the shipped one: `make_trainer(args,
    trainer_class=None, **kwargs)`, whose keyword arguments override those."""
    return functools.partial(
        tiny_pair_trainer,
        model=model_dirs["student"],
        teacher_model=model_dirs["teacher"],
        train_dataset=prompts,
        processing_class=tokenizer,
    )
