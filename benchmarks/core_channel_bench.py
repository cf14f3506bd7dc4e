"""The boundary between a replica and its engine core process, alone: the socket pair against
the shared-memory rings (workers/replica/shm_channel.py), with the messages the core sends.

Two processes, as in a replica: this one is the shell, a child started the same way as the
engine core is the core. Per channel, side by side in one run:
- *wake-up latency*: the core sends one batch holding one token chunk and the shell echoes a
  one-byte reply, one at a time with a pause between, so every message finds its receiver
  asleep (a paced stream: one message per 20 ms); p50 / p99 of the one-way time (round trip / 2);
- *throughput*: the core sends N batches of `--chunks` token chunks as fast as it can; the
  shell receives and unpickles them; messages per second and each side's CPU microseconds per
  message (the cost that competes with the engine and the streaming for the cores).

    python -m mtpserve.benchmarks.core_channel_bench --json benchmarks/results/core-channel-cpu.json
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from mtpserve.workers.messages import TokenChunk
from mtpserve.workers.replica import shm_channel

CHANNELS = ("socket", "shm")


def _batch(n: int, i: int) -> list[tuple]:
    """What the core sends per engine wake-up: `n` streams' chunks of one k=2 round."""
    return [("chunk", f"req-{j}", TokenChunk([1000 + i, 2000 + i, 3000 + i],
                                             num_prompt_tokens=128, num_output_tokens=i * 3,
                                             num_drafted=2 * i, num_accepted=i, num_rounds=i))
            for j in range(n)]


def _connect(kind: str, sock_fd: int, rings_arg: str | None):
    sock = socket.socket(fileno=sock_fd)
    if kind == "shm":
        return shm_channel.child_channel(rings_arg, sock)
    return Connection(sock.detach())


def _child(argv: list[str]) -> None:
    """The core's side: answers the shell's commands over the channel."""
    kind, sock_fd = argv[0], int(argv[1])
    conn = _connect(kind, sock_fd, argv[2] if len(argv) > 2 else None)
    while True:
        cmd = conn.recv()
        if cmd[0] == "ping":  # wake-up latency: send, wait for the echo, pause, again
            _, n, chunks, pause_s = cmd
            for i in range(n):
                t0 = time.perf_counter()
                conn.send(_batch(chunks, i))
                conn.recv()
                conn.send(time.perf_counter() - t0)
                time.sleep(pause_s)
        elif cmd[0] == "stream":
            _, n, chunks = cmd
            batches = [_batch(chunks, i) for i in range(n)]
            c0 = time.process_time()
            for b in batches:
                conn.send(b)
            conn.send(("done", time.process_time() - c0))
        else:
            return


def _run(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    ours, theirs = socket.socketpair()
    argv = [sys.executable, "-m", "mtpserve.benchmarks.core_channel_bench", "--child", kind,
            str(theirs.fileno())]
    fds = [theirs.fileno()]
    rings = None
    if kind == "shm":
        rings = shm_channel.Ring.create(), shm_channel.Ring.create()
        argv.append(shm_channel.fds_arg(*rings))
        fds += [fd for r in rings for fd in r.fds()]
    proc = subprocess.Popen(argv, pass_fds=fds)
    theirs.close()
    conn = (shm_channel.ShmChannel(*rings, sock=ours) if rings
            else Connection(ours.detach()))
    try:
        conn.send(("ping", args.pings, args.chunks, args.pause_ms / 1e3))
        one_way = []
        for _ in range(args.pings):
            conn.recv()
            conn.send(b"k")
            one_way.append(conn.recv() / 2 * 1e6)
        conn.send(("stream", args.messages, args.chunks))
        t0, c0 = time.perf_counter(), time.process_time()
        received = 0
        while True:
            msg = conn.recv()
            if isinstance(msg, tuple) and msg[0] == "done":
                sender_cpu = msg[1]
                break
            received += 1
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        conn.send(("stop",))
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    one_way.sort()
    return {"one_way_us_p50": statistics.median(one_way),
            "one_way_us_p99": one_way[int(0.99 * (len(one_way) - 1))],
            "messages_per_s": received / wall,
            "sender_cpu_us_per_msg": sender_cpu / received * 1e6,
            "receiver_cpu_us_per_msg": cpu / received * 1e6}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=4, help="token chunks per batch (streams)")
    ap.add_argument("--pings", type=int, default=300)
    ap.add_argument("--pause-ms", type=float, default=20.0)
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per channel")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not shm_channel.available():
        sys.exit("shared-memory rings need Linux (memfd_create)")
    runs: dict[str, list[dict]] = {k: [] for k in CHANNELS}
    for _ in range(args.repeats):  # alternate, so drift on the host hits both alike
        for kind in CHANNELS:
            runs[kind].append(_run(kind, args))
    result = {"args": {k: v for k, v in vars(args).items() if k != "json"},
              "channels": {k: {m: statistics.median(r[m] for r in rs) for m in rs[0]}
                           for k, rs in runs.items()}}
    keys = list(result["channels"]["socket"])
    print(f"{'metric (median of ' + str(args.repeats) + ' runs)':34}" +
          "".join(f"{k:>12}" for k in CHANNELS) + f"{'shm/socket':>12}")
    for m in keys:
        a, b = (result["channels"][k][m] for k in CHANNELS)
        print(f"{m:34}{a:12.1f}{b:12.1f}{b / a:12.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
