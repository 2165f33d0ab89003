# Copyright 2026 The tvopd-trl Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Grading: the last ``\\boxed{}`` of a response against the gold answer with math-verify, in a worker pool.

Each item is graded in a worker process under its own wall-clock alarm, so that a pathological expression (sympy can
run for minutes on some inputs) cannot hang an evaluation: it counts as wrong, with status ``"timeout"``. Grading is
a pure function of (answer, gold), so results do not depend on the number of workers, timeouts aside.
"""

import functools
import multiprocessing
import signal
import sys
import types
from concurrent.futures import ProcessPoolExecutor


CORRECT, INCORRECT, NO_ANSWER, TIMEOUT = "correct", "incorrect", "no_answer", "timeout"
INVALID_GOLD = "invalid_gold"  # the gold answer itself does not parse: a data problem, never the model's
DEFAULT_TIMEOUT_SECONDS = 10.0


def last_boxed(text):
    """The content of the last ``\\boxed{...}`` in `text` (nested braces allowed), or `None`."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 1, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:index]
    return None


class _GradingTimeout(BaseException):
    # A BaseException, so that math-verify's and sympy's `except Exception` handlers cannot swallow it.
    pass


_alarm_armed = False


def _raise_timeout(signum, frame):
    # An alarm that lands after the item finished (between disarming and cancelling the timer) is ignored.
    if _alarm_armed:
        raise _GradingTimeout


def _disable_math_verify_timeout_warnings():
    import math_verify.grader
    import math_verify.parser

    # Its warning says to bring our own timeout when its own is off; `grade_answer` does.
    math_verify.grader.TIMEOUT_WARNING_SHOWN = math_verify.parser.TIMEOUT_WARNING_SHOWN = True


@functools.lru_cache(maxsize=4096)
def _parse_boxed(content):
    from math_verify import parse

    _disable_math_verify_timeout_warnings()

    # Both sides go through the same boxed extraction, so gold and prediction are normalised alike. math-verify's
    # own signal-based timeouts are off: `grade_answer` puts one alarm around the whole item instead.
    return parse(f"\\boxed{{{content}}}", parsing_timeout=None)


def grade_answer(answer, gold, timeout_seconds=DEFAULT_TIMEOUT_SECONDS):
    """The status of one extracted `answer` (a ``\\boxed{}`` content, or `None`) against `gold`.

    One of `"correct"`, `"incorrect"`, `"no_answer"` (nothing boxed, or an empty box), `"timeout"` and
    `"invalid_gold"` (math-verify cannot parse the gold answer: fix the benchmark file). The alarm
    needs the main thread of a process: call this in a worker of [`grade`], not in a thread."""
    from math_verify import verify

    global _alarm_armed
    if answer is None or not answer.strip():
        return NO_ANSWER
    previous = signal.signal(signal.SIGALRM, _raise_timeout)
    try:
        _alarm_armed = True
        signal.setitimer(signal.ITIMER_REAL, timeout_seconds)
        gold_parsed = _parse_boxed(gold)
        if not gold_parsed:
            _alarm_armed = False
            return INVALID_GOLD
        answer_parsed = _parse_boxed(answer)
        equal = bool(answer_parsed) and verify(gold_parsed, answer_parsed, timeout_seconds=None)
        _alarm_armed = False
        return CORRECT if equal else INCORRECT
    except _GradingTimeout:
        return TIMEOUT
    finally:
        _alarm_armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _grade_pair(pair, timeout_seconds):
    return grade_answer(*pair, timeout_seconds=timeout_seconds)


def _worker_context():
    """Where the grading workers come from: never a fork of the caller, whose other threads (a trainer's) may hold
    CPython's locks at that moment. A child forked then can hang forever (CPython gh-112275, in Python 3.11.7 here; seen
    as an evaluation inside a 2-process run that never ended). A forkserver is one single-threaded process that forks
    the workers; spawn where there is none (Windows).

    Each worker runs the caller's main module again. The forkserver imports it once where it is a file; where it is
    ``python -m module`` (``tvopd_trl.scripts.train``: 3.5 s of imports here), it imports what the module's names come
    from, so that a worker's run finds them imported (the module itself, imported there, would make every run warn)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    preload = {"__main__", __name__, "math_verify"}
    main = sys.modules["__main__"]
    if getattr(main.__spec__, "name", None):
        origins = (
            value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
            for value in vars(main).values()
        )
        preload |= {origin for origin in origins if isinstance(origin, str) and origin not in ("__main__", "builtins")}
    # Takes effect when the forkserver starts, on this process's first pool of that kind, in place of any list set before
    context.set_forkserver_preload(sorted(preload))
    return context


def grade(answers, golds, workers=2, timeout_seconds=DEFAULT_TIMEOUT_SECONDS):
    """Statuses of extracted `answers` against `golds` (equal-length lists), in order, graded by `workers` processes.

    Items with nothing to grade (`None` or empty) never reach the pool."""
    if len(answers) != len(golds):
        raise ValueError(f"{len(answers)} answers for {len(golds)} gold answers: pass one gold answer per answer.")
    if workers < 1:
        raise ValueError(f"`workers` must be at least 1 (got {workers}): grading runs in worker processes.")
    statuses = [NO_ANSWER if answer is None or not answer.strip() else None for answer in answers]
    pending = [i for i, status in enumerate(statuses) if status is None]
    if pending:
        # A pool per call: workers kept between calls would outlive a caller that ends without its exit handlers (a
        # killed run; a rank that gloo aborts at exit), waiting forever for work, with the caller's output streams
        with ProcessPoolExecutor(max_workers=workers, mp_context=_worker_context()) as pool:
            chunksize = max(1, len(pending) // (8 * workers))
            pairs = [(answers[i], golds[i]) for i in pending]
            grader = functools.partial(_grade_pair, timeout_seconds=timeout_seconds)
            for i, status in zip(pending, pool.map(grader, pairs, chunksize=chunksize), strict=True):
                statuses[i] = status
    return statuses


def grade_responses(responses, golds, workers=2, timeout_seconds=DEFAULT_TIMEOUT_SECONDS):
    """(extracted answers, statuses) of full `responses`, each graded on its last ``\\boxed{}``."""
    answers = [last_boxed(response) for response in responses]
    return answers, grade(answers, golds, workers=workers, timeout_seconds=timeout_seconds)
