"""The shared-memory channel between a replica and its engine core process
(workers/replica/shm_channel.py), between two real processes.

Covers: messages arrive whole and in order both ways, including ones larger than the ring
(the writer waits for the reader to drain) and thousands of small ones sent while the reader
alternates between draining and sleeping (a lost wake-up would hang the exchange: every recv
has a deadline); a dead peer is EOFError on the other side at once; an idle recv times out;
a send to a closed channel raises instead of blocking.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from mtpserve.workers.replica import shm_channel

pytestmark = pytest.mark.skipif(not shm_channel.available(), reason="Linux memfd_create")

# The child echoes every message back until it gets None, then exits; "die" exits at once.
_ECHO = """
import os, socket, sys
from mtpserve.workers.replica import shm_channel
ch = shm_channel.child_channel(sys.argv[2], socket.socket(fileno=int(sys.argv[1])))
while True:
    msg = ch.recv(timeout_s=30)
    if msg is None:
        break
    if msg == "die":
        os._exit(3)
    ch.send(msg)
"""


@pytest.fixture
def echo():
    """The shell's end of a channel to an echoing child process, with small rings."""
    ours, theirs = socket.socketpair()
    to_child, to_parent = shm_channel.Ring.create(1 << 12), shm_channel.Ring.create(1 << 12)
    fds = [theirs.fileno(), *to_child.fds(), *to_parent.fds()]
    proc = subprocess.Popen(
        [sys.executable, "-c", _ECHO, str(theirs.fileno()),
         shm_channel.fds_arg(to_child, to_parent)], pass_fds=fds)
    theirs.close()
    ch = shm_channel.ShmChannel(to_child, to_parent, sock=ours)
    yield ch, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    ch.close()
    ch.release()


def test_messages_round_trip_in_order_including_ones_larger_than_the_ring(echo) -> None:
    ch, proc = echo
    big = os.urandom(50_000)  # 12x the 4 KiB ring: sent in pieces as the reader drains
    sent = [("chunk", i, "x" * (i % 300)) for i in range(2000)] + [big, {"k": [1, 2, 3]}]
    # Sent from a thread: the echo fills our ring while we still send (as a socket would).
    sender = threading.Thread(target=lambda: [ch.send(m) for m in sent])
    sender.start()
    got = [ch.recv(timeout_s=30) for _ in sent]
    sender.join()
    assert got == sent
    ch.send(None)
    assert proc.wait(10) == 0


def test_a_sleeping_reader_is_woken_for_every_message(echo) -> None:
    """One message at a time, so each finds the peer asleep (or about to be)."""
    ch, proc = echo
    for i in range(300):
        ch.send(i)
        assert ch.recv(timeout_s=10) == i
        if i % 50 == 0:
            time.sleep(0.02)  # let the child reach its blocking wait, not just the re-check
    ch.send(None)
    assert proc.wait(10) == 0


def test_a_dead_peer_is_eof_and_an_idle_recv_times_out(echo) -> None:
    ch, proc = echo
    with pytest.raises(TimeoutError):
        ch.recv(timeout_s=0.2)
    ch.send("die")
    t0 = time.monotonic()
    with pytest.raises(EOFError):
        ch.recv(timeout_s=10)
    assert time.monotonic() - t0 < 5
    assert proc.wait(10) == 3


def test_a_send_on_a_closed_channel_raises(echo) -> None:
    ch, _ = echo
    ch.close()
    with pytest.raises(OSError):
        ch.send("late")
