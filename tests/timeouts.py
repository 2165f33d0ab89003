"""The tests' time limits, and the one knob that stretches them all on a slow or busy machine.

`TVOPD_TEST_TIMEOUT_SCALE` (a factor > 0, default 1) multiplies every limit that bounds how long a test may run:
pytest-timeout's (setup.cfg's `timeout`, a `timeout` mark, `--timeout`), and each subprocess, launch, server start and
wait the tests bound themselves, which they write as `time_limit(seconds)`. Limits that belong to the behaviour under
test (a server timeout a test expects to fire) are not scaled. A test that fails on a limit says that the machine may
be slow and names the variable: the launch helpers in their own message, every other `subprocess.TimeoutExpired`,
`TimeoutError` and pytest-timeout failure in a section that `pytest_runtest_makereport` adds to its report.

tests/conftest.py imports the hooks below; this module imports only the standard library and pytest, so that a
pytest session of its own can use them (`tests/test_timeouts.py`).
"""

import asyncio
import math
import os
import subprocess

import pytest


SCALE_VARIABLE = "TVOPD_TEST_TIMEOUT_SCALE"


def timeout_scale():
    """The factor `TVOPD_TEST_TIMEOUT_SCALE` sets (1 when it is unset or empty); `ValueError` unless a number > 0."""
    value = os.environ.get(SCALE_VARIABLE, "").strip()
    if not value:
        return 1.0
    try:
        scale = float(value)
    except ValueError:
        scale = math.nan
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(
            f"{SCALE_VARIABLE}={value!r}: expected a number > 0, the factor by which the tests' time limits grow "
            f"(1 when unset; e.g. {SCALE_VARIABLE}=3 on a slow or busy machine)"
        )
    return scale


def time_limit(seconds):
    """A test's limit of `seconds`, times `TVOPD_TEST_TIMEOUT_SCALE`."""
    return seconds * timeout_scale()


def slow_machine_note():
    """What a test that ran past one of its limits adds to its failure."""
    scale = timeout_scale()
    return (
        f"The machine may be slow or busy: {SCALE_VARIABLE} multiplies every time limit of the tests (now "
        f"{scale:g}); rerun with e.g. {SCALE_VARIABLE}={3 if scale < 3 else 2 * scale:g}."
    )


def _time_limit_errors():
    errors = [subprocess.TimeoutExpired, TimeoutError, asyncio.TimeoutError]  # the last one differs on Python 3.10
    try:
        import requests

        errors.append(requests.exceptions.Timeout)
    except ImportError:
        pass
    return tuple(errors)


def is_time_limit_failure(error):
    """Whether `error`, which failed a test, is a time limit's, and does not name the variable yet."""
    if SCALE_VARIABLE in str(error):
        return False  # the launch helpers' own message
    if isinstance(error, pytest.fail.Exception):
        return "from pytest-timeout" in error.msg
    return isinstance(error, _time_limit_errors())


def _output_tail(error, characters=3000):
    """What a subprocess that `subprocess.run` ended at its timeout had written, its last `characters`."""
    parts = []
    for name in ("stdout", "stderr"):
        output = getattr(error, name, None)
        if isinstance(output, bytes):
            output = output.decode(errors="replace")
        if output:
            parts.append(f"{name}:\n{output[-characters:]}")
    return "\n".join(parts)


# ----------------------------------------------------------------------------------------------------------------------
# Hooks (imported by tests/conftest.py)
# ----------------------------------------------------------------------------------------------------------------------


def pytest_configure(config):
    try:
        timeout_scale()
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None


def pytest_report_header(config):
    scale = timeout_scale()
    if scale != 1:
        return f"time limits: x{scale:g} ({SCALE_VARIABLE})"
    return None


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's own timer, on the scaled limit (whether it came from setup.cfg, a mark or the command line)."""
    import pytest_timeout

    return pytest_timeout.pytest_timeout_set_timer(item, settings._replace(timeout=time_limit(settings.timeout)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    error = call.excinfo.value if call.excinfo is not None else None
    if report.failed and error is not None and is_time_limit_failure(error):
        if hasattr(report.longrepr, "addsection"):
            output = _output_tail(error) if isinstance(error, subprocess.TimeoutExpired) else ""
            if output:
                report.longrepr.addsection("output before the time limit", output)
            report.longrepr.addsection("time limit", slow_machine_note())
    return report
