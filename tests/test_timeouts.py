"""`TVOPD_TEST_TIMEOUT_SCALE` (tests/timeouts.py): read and checked, it stretches pytest-timeout's limits and the tests'
own, and a test that runs past one says that the machine may be slow and names the variable. The hooks run in a
pytest session of their own, in a subprocess, on a few tests that sleep."""

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from .timeouts import SCALE_VARIABLE, slow_machine_note, time_limit, timeout_scale


REPO = Path(__file__).resolve().parent.parent
INNER_CONFTEST = """from tests.timeouts import (
    pytest_configure, pytest_report_header, pytest_runtest_makereport, pytest_timeout_set_timer
)
"""
INNER_TESTS = """
import subprocess, sys, time

import pytest

from tests.timeouts import time_limit


@pytest.mark.timeout(0.5)
def test_within_a_scaled_mark():
    time.sleep(1)


def test_within_the_scaled_ini_timeout():
    time.sleep(1)


@pytest.mark.timeout(0.25)
def test_past_a_scaled_mark():
    time.sleep(60)


@pytest.mark.timeout(10)
def test_a_subprocess_past_its_limit():
    code = "print('started', flush=True); import time; time.sleep(60)"
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=time_limit(1))


def test_another_failure():
    assert 1 == 2
"""


def test_the_scale_is_read_from_the_variable(monkeypatch):
    monkeypatch.delenv(SCALE_VARIABLE, raising=False)
    assert timeout_scale() == 1.0 and time_limit(300) == 300
    monkeypatch.setenv(SCALE_VARIABLE, "")
    assert timeout_scale() == 1.0
    monkeypatch.setenv(SCALE_VARIABLE, " 2.5 ")
    assert timeout_scale() == 2.5 and time_limit(300) == 750
    assert "(now 2.5); rerun with e.g. TVOPD_TEST_TIMEOUT_SCALE=3." in slow_machine_note()
    monkeypatch.setenv(SCALE_VARIABLE, "4")
    assert "(now 4); rerun with e.g. TVOPD_TEST_TIMEOUT_SCALE=8." in slow_machine_note()


@pytest.mark.parametrize("value", ["abc", "0", "-2", "nan", "inf", "3s"])
def test_a_scale_that_is_not_a_positive_number_is_refused_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv(SCALE_VARIABLE, value)
    with pytest.raises(ValueError, match=f"^{SCALE_VARIABLE}='{value}': expected a number > 0"):
        timeout_scale()
    with pytest.raises(ValueError, match=SCALE_VARIABLE):
        time_limit(300)


def _inner_session(directory, scale):
    """`pytest` on `INNER_TESTS` with the hooks of tests/timeouts.py, pytest-timeout and `timeout = 0.5` in its ini,
    under `TVOPD_TEST_TIMEOUT_SCALE=scale`: `(completed process, {test name: failure text or None})`."""
    (directory / "pytest.ini").write_text("[pytest]\ntimeout = 0.5\n")
    (directory / "conftest.py").write_text(INNER_CONFTEST)
    (directory / "test_inner.py").write_text(textwrap.dedent(INNER_TESTS))
    env = {**os.environ, SCALE_VARIABLE: scale, "PYTHONPATH": str(REPO), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    command = [sys.executable, "-m", "pytest", "-p", "pytest_timeout", "-p", "no:cacheprovider"]
    command += ["--junitxml", str(directory / "report.xml"), "test_inner.py"]
    process = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=time_limit(120))
    if not (directory / "report.xml").exists():
        return process, None
    failures = {}
    for case in ElementTree.parse(directory / "report.xml").iter("testcase"):
        failure = case.find("failure")
        failures[case.get("name")] = None if failure is None else f"{failure.get('message')}\n{failure.text}"
    return process, failures


def test_limits_scale_and_a_test_past_one_names_the_variable(tmp_path):
    process, failures = _inner_session(tmp_path, "4")
    output = process.stdout + process.stderr
    assert failures is not None, output
    # 1 s of sleep is past the 0.5 s of the mark and of the ini setting, within the 2 s they scale to
    assert failures["test_within_a_scaled_mark"] is None, failures["test_within_a_scaled_mark"]
    assert failures["test_within_the_scaled_ini_timeout"] is None, failures["test_within_the_scaled_ini_timeout"]
    note = "The machine may be slow or busy: TVOPD_TEST_TIMEOUT_SCALE multiplies every time limit of the tests (now 4)"
    # pytest-timeout's failure, at 0.25 s x 4
    past_mark = failures["test_past_a_scaled_mark"]
    assert "Timeout (>1.0s) from pytest-timeout" in past_mark and note in past_mark, past_mark
    # subprocess.run's, at 1 s x 4, with what the process had printed
    past_run = failures["test_a_subprocess_past_its_limit"]
    assert "TimeoutExpired" in past_run and "timed out after 4.0 seconds" in past_run, past_run
    assert note in past_run and "output before the time limit" in past_run, past_run
    assert "\nstdout:\nstarted\n" in past_run, past_run  # the section's, not the test's source line
    # a failure of another kind says nothing of time limits
    other = failures["test_another_failure"]
    assert "assert 1 == 2" in other and SCALE_VARIABLE not in other, other
    assert process.returncode == 1 and "3 failed, 2 passed" in output, output
    assert f"time limits: x4 ({SCALE_VARIABLE})" in process.stdout, output  # the session's header


def test_a_session_with_an_invalid_scale_stops_at_once_naming_the_variable(tmp_path):
    process, failures = _inner_session(tmp_path, "fast")
    assert process.returncode == pytest.ExitCode.USAGE_ERROR and failures is None, process.stdout + process.stderr
    assert f"{SCALE_VARIABLE}='fast': expected a number > 0" in process.stderr, process.stderr
