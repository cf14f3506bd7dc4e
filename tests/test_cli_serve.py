"""`mtpserve up`'s compile progress lines: read from a `/v1/mtpserve/stats` answer, formatted
as a pure function, printed while the decode replicas compile and once when they are done.
(The command itself, with a real cluster: tests/test_cli_up.py.)"""

from __future__ import annotations

import threading

from mtpserve.cluster.cli_serve import (
    compile_progress_line,
    compile_progress_of,
    format_duration,
    watch_compile,
)


def _progress(done: int, total: int = 47, state: str = "compiling", eta: float | None = 370.0,
              elapsed: float = 100.0, compiled: int = 3) -> dict:
    return {"total": total, "done": done, "adopted": done, "compiling": [],
            "state": state, "seconds_per_bucket": 20.0, "eta_s": eta, "elapsed_s": elapsed,
            "compiled": compiled}


def test_durations() -> None:
    assert [format_duration(s) for s in (0, 44.6, 60, 370, 902, 3599.6, 3720)] == \
        ["0s", "45s", "1m00s", "6m10s", "15m02s", "1h00m", "1h02m"]


def test_progress_lines() -> None:
    assert compile_progress_line([]) is None  # eager decode: nothing to report
    assert compile_progress_line([_progress(12)]) == \
        "compiling decode graphs: 12/47 buckets, ETA 6m10s"
    assert compile_progress_line([_progress(4, eta=None)]) == \
        "compiling decode graphs: 4/47 buckets, ETA after the first bucket"
    assert compile_progress_line([_progress(47, state="done", eta=0.0, elapsed=902)]) == \
        "decode graphs: all 47 compiled (15m02s)"
    assert compile_progress_line([_progress(47, state="done", eta=0.0, elapsed=4,
                                            compiled=0)]) == \
        "decode graphs: all 47 loaded from the compile cache (4s)"
    assert compile_progress_line([_progress(4, state="stopped", eta=None)]) == (
        "decode graphs: 4/47 compiled; the other 43 run eagerly (warm-up budget spent, "
        "background compile off or stopped)")
    # Two replicas: summed buckets, the later ETA.
    two = [_progress(12, eta=370.0), _progress(20, eta=100.0)]
    assert compile_progress_line(two) == \
        "compiling decode graphs: 32/94 buckets, ETA 6m10s (2 decode replicas)"


def test_progress_from_the_stats_answer() -> None:
    a, b = _progress(3), _progress(5)
    # Every live decode replica's, from the metrics hub's snapshots ...
    stats = {"decode": {"compile": a},
             "replicas": [{"role": "prefill", "compile": _progress(1)},
                          {"role": "decode", "compile": a}, {"role": "decode", "compile": b}]}
    assert compile_progress_of(stats) == [a, b]
    # ... else (no snapshot yet) the decode replica that answered; eager decode: none.
    assert compile_progress_of({"decode": {"compile": a}, "replicas": []}) == [a]
    assert compile_progress_of({"decode": {"compile": None}, "replicas": []}) == []


def test_watch_prints_while_compiling_then_the_final_line_once() -> None:
    answers = [None,  # the stats endpoint did not answer: asked again
               {"decode": {"compile": _progress(12)}},
               {"decode": {"compile": _progress(30, eta=120.0)}},
               {"decode": {"compile": _progress(47, state="done", eta=0.0, elapsed=902)}},
               {"decode": {"compile": _progress(47, state="done", eta=0.0)}}]
    lines: list[str] = []
    watch_compile(lambda: answers.pop(0), threading.Event(), 0.0, lines.append)
    assert lines == ["compiling decode graphs: 12/47 buckets, ETA 6m10s",
                     "compiling decode graphs: 30/47 buckets, ETA 2m00s",
                     "decode graphs: all 47 compiled (15m02s)"]
    assert len(answers) == 1  # it stopped asking after the final line
    # Eager decode: returns at the first answer, printing nothing; a stop ends it at once.
    lines.clear()
    watch_compile(lambda: {"decode": {"compile": None}}, threading.Event(), 0.0, lines.append)
    stop = threading.Event()
    stop.set()
    watch_compile(lambda: {"decode": {"compile": _progress(1)}}, stop, 0.0, lines.append)
    assert lines == []
