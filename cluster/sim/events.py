"""The discrete-event core: a time-ordered queue of callbacks. Ties run in scheduling order
(a sequence number breaks them), so a run is a pure function of its inputs."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class EventQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = 0

    def push(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        heapq.heappush(self._heap, (t, self._seq, fn, args))
        self._seq += 1

    def pop(self) -> tuple[float, Callable[..., Any], tuple]:
        t, _, fn, args = heapq.heappop(self._heap)
        return t, fn, args

    def __len__(self) -> int:
        return len(self._heap)
