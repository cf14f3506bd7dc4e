"""The engine core in its own process (`engine_core: process`, docs/reliability.md).

The Serve replica keeps asyncio I/O only; a child process it starts owns the `CoreHost`
(rank 0 of the TP group, the engine thread, KV pullers / senders, compiled graphs), so the
engine's Python work and the replica's streaming no longer share one GIL.

The boundary (`engine_core_channel`): a shared-memory ring per direction (shm_channel.py;
the default on Linux), or one Unix socket pair (multiprocessing `Connection` framing). Either
way pickles plain messages; tensors never cross it: KV moves between ranks and replicas as
before, and held extras stay in the child. With rings, the socket pair carries only doorbell
bytes (to wake a sleeping reader) and signals death by its EOF. Shell -> core: `gen` (add a
request and stream it), `call` (a named `CoreHost` command with a reply), `cast` (no reply),
`abort`, `stop`. Core -> shell:
one message per engine wake-up holding every chunk and reply that piled up since the last
(`AsyncEngine.on_tick`), plus the core's failed flag when it changes and a heartbeat.

Failure semantics: the shell's reader thread sees the socket close (or the process exit)
at once when the core dies; every open stream then ends with an `ERROR_ENGINE` chunk (the
orchestrator migrates it), pending calls raise `ReplicaUnavailableError`, and
`check_health` fails. A live but stuck core stops its heartbeat; `check_health` fails once
it is older than the health deadline. The core dies with its shell: `PR_SET_PDEATHSIG` (set
from a thread that lives as long as the shell's core), a watchdog on the parent pid, and EOF
on the socket, so a `kill -9` of the replica leaves no orphan.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from mtpserve.workers.async_engine import coalesced
from mtpserve.workers.child_process import child_env, die_with_parent
from mtpserve.workers.messages import (
    ERROR_ENGINE,
    GenerateRequest,
    KVTransferParams,
    TokenChunk,
)
from mtpserve.workers.replica import shm_channel
from mtpserve.workers.replica.engine_core import ReplicaUnavailableError

logger = logging.getLogger(__name__)

# The child sends a heartbeat at least this often while its engine thread turns (an idle
# engine thread wakes every 0.5 s: workers/async_engine.py _IDLE_WAIT_S).
HEARTBEAT_S = 1.0


def _pickle_exc(e: BaseException) -> BaseException:
    """`e` if it survives pickling, else a RuntimeError naming it (class names matter to the
    orchestrator, router/errors.py)."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


# Shell side --------------------------------------------------------------------------------
class ProcessCore:
    """The shell's handle on an engine core process; the same surface as `ThreadCore`
    (engine_core.py): `call`, `cast`, `generate`, `ping`, `failed`, `shutdown`.

    A reader thread (which also started the child, so PDEATHSIG fires only when the shell's
    process ends) receives the core's batched messages and hands chunks to each request's
    asyncio queue, one `call_soon_threadsafe` per event loop per batch."""

    def __init__(self, cfg, role: str, replica_id: str | None,
                 startup_timeout_s: float = 900.0) -> None:
        from mtpserve.workers.replica.engine_core import rank_spec, role_settings

        self.role = role
        side = role_settings(cfg, role)
        self.channel: str = getattr(side, "engine_core_channel", "shm")
        spec = rank_spec(cfg, role)
        self.workers: list = []
        rendezvous = pending = None
        if spec.tp_size > 1:  # ranks >= 1 are Ray actors of this replica, as in thread mode
            from mtpserve.workers.replica.tp_workers import spawn_workers

            spec, self.workers, pending, rendezvous = spawn_workers(
                spec, side.cpus_per_rank, side.gpus_per_rank)
        self._conn: Connection | shm_channel.ShmChannel | None = None
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._replies: dict[int, concurrent.futures.Future] = {}
        self._listeners: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # _replies, _listeners, _dead
        self._dead: str | None = None  # why the core is gone
        self._core_failed = False
        self.heartbeat = time.monotonic()  # last message from the core
        self.proc: subprocess.Popen | None = None
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        boot = {"cfg": cfg, "role": role, "replica_id": replica_id, "spec": spec}
        self._thread = threading.Thread(target=self._run, args=(boot,), daemon=True,
                                        name=f"engine-core-io-{role}")
        self._thread.start()
        try:
            info = self._ready.result(timeout=startup_timeout_s)
            addresses = [info["kv_address"]]
            if pending is not None:
                import ray

                addresses += ray.get(pending, timeout=startup_timeout_s)
        except BaseException:
            self.shutdown()
            for w in self.workers:
                _kill_actor(w)
            raise
        finally:
            if rendezvous is not None:
                rendezvous.close()  # every rank has joined (or the replica fails to start)
        self.pid: int = info["pid"]
        self.kv_addresses: list[str | None] = addresses
        self.num_kv_blocks: int = info["num_kv_blocks"]
        self._post(("call", None, "set_kv_addresses", (addresses,)))

    # The reader thread ---------------------------------------------------------------------
    def _run(self, boot: dict) -> None:
        parent_sock, child_sock = socket.socketpair()
        argv = [sys.executable, "-m", "mtpserve.workers.replica.engine_core_proc",
                str(child_sock.fileno()), str(os.getpid())]
        fds = [child_sock.fileno()]
        rings = None
        if self.channel == "shm" and shm_channel.available():
            rings = shm_channel.Ring.create(), shm_channel.Ring.create()  # to core, to shell
            argv.append(shm_channel.fds_arg(*rings))
            fds += [fd for ring in rings for fd in ring.fds()]
        try:
            self.proc = subprocess.Popen(argv, pass_fds=fds, env=child_env(), close_fds=True)
        except BaseException as e:
            self._ready.set_exception(e)
            return
        finally:
            child_sock.close()
        if rings is not None:
            conn = self._conn = shm_channel.ShmChannel(*rings, sock=parent_sock)
        else:
            conn = self._conn = Connection(parent_sock.detach())
        try:
            conn.send(boot)
            while True:
                batch = conn.recv()  # EOF at once when the core dies (it holds the only peer)
                self.heartbeat = time.monotonic()
                self._dispatch(batch)
        except (EOFError, OSError):
            pass
        except Exception:
            logger.exception("engine core reader failed")
        if self.proc.poll() is None:  # the channel broke under a live core: it cannot serve
            self.proc.kill()
        code = self.proc.wait()
        self._on_death(f"the engine core process exited (code {code})")
        with self._send_lock:  # no send is under way (and none follows: _dead is set)
            conn.close()
            if isinstance(conn, shm_channel.ShmChannel):
                conn.release()

    def _dispatch(self, batch: list) -> None:
        per_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for msg in batch:
            kind = msg[0]
            if kind == "chunk":
                _, rid, chunk = msg
                with self._lock:
                    target = (self._listeners.pop(rid, None) if chunk.finished
                              else self._listeners.get(rid))
                if target is not None:
                    per_loop.setdefault(target[0], []).append((target[1], chunk))
            elif kind == "reply":
                _, call_id, ok, value = msg
                with self._lock:
                    fut = self._replies.pop(call_id, None)
                if fut is not None and fut.set_running_or_notify_cancel():
                    (fut.set_result if ok else fut.set_exception)(value)
            elif kind == "state":
                self._core_failed = msg[1]
            elif kind == "ready":
                self._ready.set_result(msg[1])
            elif kind == "boot_failed":
                self._ready.set_exception(RuntimeError(f"engine core failed to start:\n{msg[1]}"))
        for loop, items in per_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _on_death(self, why: str) -> None:
        with self._lock:
            self._dead = why
            listeners, self._listeners = self._listeners, {}
            replies, self._replies = self._replies, {}
        if not self._ready.done():
            self._ready.set_exception(RuntimeError(why))
        for loop, q in listeners.values():
            chunk = TokenChunk([], finished=True, finish_reason="error", error=why,
                               error_kind=ERROR_ENGINE)
            loop.call_soon_threadsafe(q.put_nowait, chunk)
        for fut in replies.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(ReplicaUnavailableError(why))
        if self.proc is not None and self.proc.poll() is None:
            logger.error("%s; killing it", why)

    # Sending ---------------------------------------------------------------------------------
    def _post(self, msg: tuple) -> None:
        if self._dead is not None:
            raise ReplicaUnavailableError(self._dead)
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError) as e:  # the core is gone; the reader says why soon
            raise ReplicaUnavailableError(f"the engine core is gone: {e}") from e

    def _request(self, kind: str, *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._ids)
        with self._lock:
            if self._dead is not None:
                raise ReplicaUnavailableError(self._dead)
            self._replies[call_id] = fut
        try:
            self._post((kind, call_id, *args))
        except BaseException:
            with self._lock:
                self._replies.pop(call_id, None)
            raise
        return fut

    # The core surface --------------------------------------------------------------------
    @property
    def failed(self) -> bool:
        return self._dead is not None or self._core_failed

    @property
    def dead(self) -> str | None:
        return self._dead

    async def call(self, name: str, *args: Any) -> Any:
        return await asyncio.wrap_future(self._request("call", name, args))

    def call_sync(self, name: str, *args: Any, timeout_s: float | None = None) -> Any:
        """`call` from a thread without an event loop."""
        return self._request("call", name, args).result(timeout_s)

    def cast(self, name: str, *args: Any) -> None:
        try:
            self._post(("call", None, name, args))
        except ReplicaUnavailableError:
            pass  # nothing to undo in a core that is gone

    async def generate(self, req: GenerateRequest, params: KVTransferParams | None = None,
                       abort_on_exit: bool = True, interval_s: float = 0.0
                       ) -> AsyncIterator[TokenChunk]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        rid = req.request_id
        with self._lock:
            if self._dead is not None:
                raise ReplicaUnavailableError(self._dead)
            self._listeners[rid] = (loop, q)  # before the core can send a chunk
        finished = False
        try:
            # Inside the try: a caller cancelled while the add is in flight still aborts it.
            await asyncio.wrap_future(self._request("gen", req, params))
            async for chunk in coalesced(q, interval_s):
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:
                with self._lock:
                    self._listeners.pop(rid, None)
                try:
                    self._post(("abort", rid, abort_on_exit))
                except ReplicaUnavailableError:
                    pass

    async def ping(self, deadline_s: float) -> None:
        """Raise if the core is gone, its heartbeat is older than `deadline_s`, or it did
        not answer a ping of every TP rank within `deadline_s`."""
        if self._dead is not None:
            raise ReplicaUnavailableError(self._dead)
        age = time.monotonic() - self.heartbeat
        if age > deadline_s:
            raise TimeoutError(f"the engine core's last heartbeat is {age:.1f}s old")
        fut = self._request("call", "ping", ())
        try:
            await asyncio.wait_for(asyncio.wrap_future(fut), deadline_s)
        except asyncio.TimeoutError as e:
            raise TimeoutError(f"the engine core did not answer within {deadline_s:.1f}s") from e

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core (politely, then SIGKILL past `timeout_s`) and wait for it."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                with self._send_lock:
                    if self._conn is not None:
                        self._conn.send(("stop",))
            except (OSError, ValueError):
                pass
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for w in self.workers:
            _kill_actor(w)
        self.workers = []


def _put_all(items: list[tuple[asyncio.Queue, TokenChunk]]) -> None:
    for q, chunk in items:
        q.put_nowait(chunk)


def _kill_actor(actor) -> None:
    try:
        import ray

        ray.kill(actor)
    except Exception:
        pass


# Core side ---------------------------------------------------------------------------------
class _Outbox:
    """Messages to the shell, shipped as one batch per engine wake-up (`flush` is the
    engine's `on_tick`) or at once for replies from other threads."""

    def __init__(self, conn: Connection | shm_channel.ShmChannel) -> None:
        self.conn = conn
        self._items: list[tuple] = []
        self._lock = threading.Lock()  # _items
        self._send_lock = threading.Lock()  # one batch at a time, in order
        self._last_sent = time.monotonic()
        self.failed: bool | None = None  # the host's failed flag as last reported
        self.host = None

    def put(self, msg: tuple) -> None:
        with self._lock:
            self._items.append(msg)

    def chunk(self, rid: str, chunk: TokenChunk) -> None:
        self.put(("chunk", rid, chunk))

    def flush(self) -> None:
        host = self.host
        if host is not None and host.failed != self.failed:
            self.failed = host.failed
            self.put(("state", self.failed))
        with self._send_lock:
            with self._lock:
                items, self._items = self._items, []
            if not items:
                if time.monotonic() - self._last_sent < HEARTBEAT_S:
                    return
                items = [("hb",)]
            self.conn.send(items)
            self._last_sent = time.monotonic()


def _serve(conn: Connection | shm_channel.ShmChannel, boot: dict) -> None:
    """The child's main thread: build the host, then execute the shell's messages."""
    from mtpserve.workers.replica.engine_core import HOSTS
    from mtpserve.workers.replica.tp_group import RankCore, TPDriver

    out = _Outbox(conn)
    spec = boot["spec"]
    store = None
    if spec.tp_size > 1:  # the shell hosts the rendezvous store: join it as a client
        import torch.distributed as dist

        from mtpserve.workers.replica.tp_group import RENDEZVOUS_TIMEOUT_S

        host_, _, port = spec.init_method.removeprefix("tcp://").rpartition(":")
        from datetime import timedelta

        store = dist.TCPStore(host_, int(port), None, False,
                              timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    try:
        core = RankCore(replace(spec), 0, store)
        driver = TPDriver(core)
        host = HOSTS[boot["role"]](boot["cfg"], driver, [core.kv_address],
                                   boot["replica_id"], sink=out.chunk, on_tick=out.flush,
                                   push_metrics=False)
    except BaseException:
        conn.send([("boot_failed", traceback.format_exc())])
        raise
    out.host = host
    engine = host.engine
    conn.send([("ready", {"kv_address": core.kv_address, "pid": os.getpid(),
                          "num_kv_blocks": driver.runner.kv_cache.num_blocks})])
    pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="core-offthread")

    def reply(call_id: int | None, fut: concurrent.futures.Future, now: bool) -> None:
        if call_id is None:
            if fut.exception() is not None:
                logger.error("engine core cast failed", exc_info=fut.exception())
            return
        e = fut.exception()
        out.put(("reply", call_id, e is None, fut.result() if e is None else _pickle_exc(e)))
        if now:  # not the engine thread: its next tick may be a whole step away
            out.flush()

    def on_engine(call_id: int | None, fn) -> None:
        engine.call(fn).add_done_callback(lambda f: reply(call_id, f, False))

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the shell is gone
            break
        kind = msg[0]
        if kind == "stop":
            break
        if kind == "gen":
            _, call_id, req, params = msg

            def add(e, req=req, params=params) -> None:
                engine.register(req.request_id)
                try:
                    host.add(e, req, params)
                except BaseException:
                    engine.unregister(req.request_id)
                    raise

            on_engine(call_id, add)
        elif kind == "abort":
            _, rid, abort = msg

            def drop(e, rid=rid, abort=abort) -> None:
                engine.unregister(rid)
                if abort:
                    e.abort(rid)

            engine.call(drop)
        elif kind == "call":
            _, call_id, name, args = msg
            fn = getattr(host, name)
            if name in host.OFF_THREAD:
                pool.submit(fn, *args).add_done_callback(
                    lambda f, c=call_id: reply(c, f, True))
            else:
                on_engine(call_id, lambda e, fn=fn, args=args: fn(e, *args))
    engine.shutdown()
    driver.shutdown()


def main(argv: list[str]) -> None:
    fd, parent_pid = int(argv[0]), int(argv[1])
    die_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s engine-core %(levelname)s %(name)s: %(message)s")
    if len(argv) > 2:  # the shell made shared-memory rings: the socket only signals death
        conn = shm_channel.child_channel(argv[2], socket.socket(fileno=fd))
    else:
        conn = Connection(fd)
    boot = conn.recv()
    try:
        _serve(conn, boot)
    except BaseException:
        logger.exception("engine core failed")
        os._exit(1)
    # Daemon threads (transfer lanes, senders) must not hold the exit.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
