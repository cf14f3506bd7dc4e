"""Child processes that must not outlive their parent (the engine core, the background graph
compiler): the parent-death signal and a parent-pid watchdog."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
# How often a child checks that its parent is still there (PDEATHSIG's backstop).
PARENT_POLL_S = 0.5


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Linux: this process gets `sig` when the thread that started it exits (False
    elsewhere, or if prctl failed)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def child_env() -> dict[str, str]:
    """This process's environment with its import path (Ray's runtime_env may have added to
    sys.path), for a `python -m mtpserve...` child."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(PARENT_POLL_S)


def die_with_parent(parent_pid: int, death_signal: bool = True) -> None:
    """Exit when `parent_pid` is gone: PDEATHSIG, plus a watchdog thread as its backstop (it
    is not inherited past exec by every runtime, and the parent may have died before it was
    set). `death_signal` False: the watchdog only (PDEATHSIG fires when the *thread* that
    started this process exits, which is too early where that thread is short-lived)."""
    if death_signal:
        set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                     name="parent-watch").start()
