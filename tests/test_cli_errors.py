"""Every command turns a user error into one line that names the fix, exit status 2 and no traceback; `tvopd-trl
--debug` and `TVOPD_TRL_DEBUG=1` show the traceback instead."""

import os
import re
import subprocess
import sys

import pytest

from tvopd_trl import cli
from tvopd_trl.console import DEBUG_VARIABLE

from .timeouts import time_limit


MISSING = "no/such/../folder"  # not a folder, and not a Hub id either

# (command line, what the one line must say): at least one per command.
CASES = {
    "train: a mistyped recipe": (
        ["train", "--config", "tiny/tvpod"],
        "No recipe 'tiny/tvpod'.*did you mean tiny/tvopd",
    ),
    "train: --config without a value": (["train", "--config"], "argument --config: expected one argument"),
    "train: a bad flag value": (["train", "--learning_rate", "fast"], "--learning_rate.*invalid float value: 'fast'"),
    "train: a typo in a flag": (
        ["train", "--tv_alhpa", "0.3"],
        "Unknown option --tv_alhpa \\(did you mean --tv_alpha",
    ),
    "train: an accelerate config": (
        ["train", "--accelerate_config", "zero4"],
        "'zero4' is neither a file nor one of our accelerate configs \\(ddp_cpu.*or TRL's \\(fsdp1",
    ),
    "eval: a missing model": (["eval", "--model", MISSING, "--benchmarks", "aime24"], "is neither a model folder nor"),
    "eval: an unknown benchmark": (
        ["eval", "--model", "x", "--benchmarks", "aime2024"],
        "Unknown benchmark 'aime2024'",
    ),
    "eval: the Hub offline": (
        ["eval", "--model", "x", "--benchmarks", "aime24", "--data_dir", "hub"],
        "Could not load benchmark 'aime24' from the Hub.*Leave `data_dir` unset",
    ),
    "eval: a bad flag value": (["eval", "--model", "x", "--k", "many"], "argument --k: invalid int value: 'many'"),
    "select: a missing run": (["select", MISSING], "has no evaluations"),
    "report: a bad --method": (["report", "--method", "TV-OPD", "--output_dir", "out"], "expected NAME=RUN_DIR"),
    "push: a missing run": (["push", MISSING, "--repo_id", "user/name"], "is not a directory: give the run's"),
    "doctor: a missing model": (
        ["doctor", "--model_name_or_path", MISSING, "--teacher_model_name_or_path", MISSING],
        "`model_name_or_path` 'no/such/../folder' is neither a model folder nor a Hub model id",
    ),
    "doctor: a mistyped recipe": (["doctor", "--config", "tiny/tvopd.yml"], "No recipe 'tiny/tvopd.yml'"),
    "study: a missing study file": (
        ["study", "--config", "tiny/stduy"],
        "No recipe 'tiny/stduy'.*did you mean tiny/study",
    ),
    "recipes: an unknown name": (["recipes", "tiny/nope"], "No recipe 'tiny/nope'.*`tvopd-trl recipes` lists"),
    "an unknown command": (["trian"], "invalid choice: 'trian'"),
}


@pytest.fixture
def no_debug(monkeypatch):
    monkeypatch.setenv(DEBUG_VARIABLE, "0")  # and `--debug` setting it is undone after the test


@pytest.fixture
def hub_offline(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr("datasets.load_dataset", offline)


def _status(argv):
    try:
        return cli.main(argv)
    except SystemExit as exit:  # argparse's errors exit from inside the parser
        return exit.code


@pytest.mark.parametrize("argv, message", CASES.values(), ids=CASES.keys())
def test_a_user_error_is_one_line_and_exit_status_2(
    argv, message, capsys, monkeypatch, no_debug, hub_offline, tmp_path
):
    monkeypatch.chdir(tmp_path)  # a checkout's files are not what makes these fail
    assert _status(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    prog = "tvopd-trl" if argv[0] not in cli.COMMANDS else f"tvopd-trl {argv[0]}"
    assert err.startswith(f"{prog}: error: "), err
    assert re.search(message, err), err


def test_debug_shows_the_traceback(monkeypatch, no_debug):
    with pytest.raises(FileNotFoundError, match="No recipe 'tiny/nope'"):
        cli.main(["--debug", "recipes", "tiny/nope"])
    assert os.environ[DEBUG_VARIABLE] == "1"  # what `tvopd-trl train`'s launched processes read
    monkeypatch.setenv(DEBUG_VARIABLE, "1")
    with pytest.raises(FileNotFoundError, match="No recipe 'tiny/nope'"):
        cli.main(["recipes", "tiny/nope"])


def _tvopd_trl(*argv, cwd, **env):
    return subprocess.run(
        [sys.executable, "-m", "tvopd_trl.cli", *argv],
        capture_output=True,
        text=True,
        timeout=time_limit(300),
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env},
    )


@pytest.mark.compat_skip
def test_an_error_in_the_launched_training_process_is_one_line_too(tmp_path):
    # The model is loaded in the process `accelerate launch` starts: its error, not the launcher's traceback, is what
    # the user sees, with the status it exited with.
    flags = ["--model_name_or_path", str(tmp_path / "student"), "--teacher_model_name_or_path", str(tmp_path)]
    result = _tvopd_trl("train", *flags, "--eval_problems", "0", cwd=tmp_path, **{DEBUG_VARIABLE: "0"})
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"tvopd-trl train: error: `model_name_or_path` '{tmp_path / 'student'}' is neither a model folder nor a Hub "
        "model id (namespace/name). Check the path (a relative one starts from the current directory)."
    ]
    debugged = _tvopd_trl("--debug", "train", *flags, "--eval_problems", "0", cwd=tmp_path)
    assert debugged.returncode != 0 and "Traceback" in debugged.stderr


def test_train_help_names_the_launch_and_the_job_s_own_options(capsys):
    """The inherited options (a thousand lines of them) wait behind `--help-all`."""
    assert cli.main(["train", "--help"]) == 0
    short = capsys.readouterr().out
    for text in ("--config RECIPE", "--accelerate_config", "--num_processes", "goes to `accelerate launch`"):
        assert text in short, text
    for option in ("--self_distillation", "--tv_alpha", "--eval_control_benchmark", "--learning_rate", "--use_peft"):
        assert re.search(rf"^  {option} ", short, re.MULTILINE), option
    assert "--adam_beta1" not in short and "--eval-k" not in short and len(short.splitlines()) < 300
    with pytest.raises(SystemExit) as exit_status:
        cli.main(["train", "--help-all"])
    assert exit_status.value.code == 0 and "--adam_beta1" in capsys.readouterr().out
