"""The compile progress's arithmetic: seconds per bucket from the background compiler's finish
times and the ETA from it. The report of a real replica (done <= total, done reaching total
when the background compiler finishes, the /metrics gauges) is checked where the background
compiler runs: tests/test_compile_cache.py."""

from __future__ import annotations

import pytest

from mtpserve.workers.model.compile_progress import eta_s, seconds_per_bucket


def test_seconds_per_bucket_between_finishes() -> None:
    assert seconds_per_bucket([], 100.0) is None
    # The first bucket alone: counted from the compiler's start (its own start-up included).
    assert seconds_per_bucket([130.0], 100.0) == 30.0
    # Two or more: between the first and the last finish, so the start-up drops out.
    assert seconds_per_bucket([150.0, 130.0, 170.0], 100.0) == 20.0


def test_eta_counts_the_bucket_in_progress_but_never_as_done() -> None:
    assert eta_s(0, None, None, 0.0) == 0.0  # done
    assert eta_s(5, None, 100.0, 110.0) is None  # nothing measured yet
    assert eta_s(5, 20.0, 100.0, 100.0) == 100.0
    assert eta_s(5, 20.0, 100.0, 108.0) == pytest.approx(92.0)  # 8 s into the current one
    # The current bucket runs longer than the mean: the four after it are still to come.
    assert eta_s(5, 20.0, 100.0, 190.0) == 80.0
