"""The CI version of the soak run (300 steps): no crash, bounded memory growth. Step times are reported by
`python -m tests.reliability.soak`, never asserted."""

import pytest

from .soak import soak


@pytest.mark.long
def test_300_steps_finish_without_memory_growth(tmp_path):
    report = soak(300, str(tmp_path))
    assert report["finished"] and report["steps"] == 300
    assert report["rss_growth"] < 0.05, report
