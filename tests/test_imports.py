"""Importing the library, and the `tvopd-trl` command's light paths, are quiet and quick: they import neither torch nor
TRL's trainers and the trackers these pull in (TRL imports wandb and trackio whenever they are installed).

What is imported is asserted, not the wall time, which a loaded machine makes flaky; the times are in
docs/performance.md."""

import inspect
import json
import os
import subprocess
import sys

import pytest

import tvopd_trl
import tvopd_trl.eval
from tvopd_trl import tiny

from .timeouts import time_limit


HEAVY = ("torch", "transformers", "trl", "trackio", "wandb", "deepspeed", "peft", "math_verify", "datasets")


def _imported_by(code):
    """The `HEAVY` modules a fresh interpreter has imported after running `code`, and what `code` printed."""
    probe = f"import json, sys\n{code}\nprint(json.dumps([name for name in {HEAVY!r} if name in sys.modules]))"
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=time_limit(300), env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    *printed, modules = result.stdout.splitlines()
    return json.loads(modules), printed


def test_importing_the_tiny_pair_prints_nothing():
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    code = "import tvopd_trl.tiny as t; print(t.student_path())"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=time_limit(300), env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [tiny.student_path()]


@pytest.mark.parametrize(
    "code",
    [
        "import tvopd_trl",
        "import tvopd_trl.tiny",
        "import tvopd_trl.eval",
        "from tvopd_trl.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
    ],
    ids=["package", "tiny", "eval", "help"],
)
def test_light_imports_load_no_framework(code):
    modules, _ = _imported_by(code)
    assert modules == []


def test_listing_the_recipes_loads_no_framework():
    modules, printed = _imported_by("from tvopd_trl.cli import main\nmain(['recipes'])")
    assert any("tiny/tvopd" in line for line in printed)
    assert modules == []


def test_every_public_name_still_imports():
    for module in (tvopd_trl, tvopd_trl.eval):
        for name in module.__all__:
            assert getattr(module, name) is not None, (module.__name__, name)
    from tvopd_trl import TVOPDConfig, TVOPDTrainer
    from tvopd_trl.eval import evaluate

    assert TVOPDTrainer.__module__ == "tvopd_trl.trainer" and TVOPDConfig.__module__ == "tvopd_trl.config"
    assert inspect.isfunction(evaluate)  # the function, not the module of the same name
    with pytest.raises(AttributeError, match="no attribute 'TVOPDTrainr'"):
        tvopd_trl.TVOPDTrainr  # noqa: B018


def test_the_trainer_imports_without_the_optional_extras():
    """What only the extras bring (vLLM's client and its `requests` / `urllib3`, the test tools) is imported where it is
    used, never by the package's modules themselves: the base install lacks them (the wheel's check found a top-level
    `urllib3` import)."""
    blocked = ("requests", "urllib3", "vllm", "pytest")
    code = (
        f"import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n"
        "import tvopd_trl.trainer, tvopd_trl.job, tvopd_trl.scripts.train, tvopd_trl.scripts.evaluate\nprint('imported')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=time_limit(300))
    assert result.returncode == 0 and result.stdout.splitlines() == ["imported"], result.stderr[-3000:]
