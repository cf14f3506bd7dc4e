"""`mtpserve up` with a given Serve config, as a context manager for benchmarks that compare
configurations one after another in one run."""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import yaml


def merge(base: dict, over: dict) -> dict:
    """`base` with `over` merged in, recursively (dicts merge, anything else replaces)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def variant_config(base: Path, over: dict, port: int) -> dict:
    """The Serve config file `base` with its app's args overridden, on 127.0.0.1:`port`."""
    cfg = yaml.safe_load(base.read_text())
    app = cfg["applications"][0]
    # No background compile while measuring (it would share the cores with the load): the
    # buckets a benchmark hits are compiled beforehand, by an earlier start of the config
    # that ran long enough, into the compile cache. `over` may turn it back on.
    app["args"] = merge(merge(app["args"], {"engine": {"background_compile": False}}), over)
    app["args"]["http"] = {"host": "127.0.0.1", "port": port}
    cfg["http_options"] = {"host": "127.0.0.1", "port": port}
    return cfg


@contextlib.contextmanager
def running_server(cfg: dict, timeout_s: float) -> Iterator[float]:
    """Start `mtpserve up` on `cfg` in its own process group; yields the seconds it took to
    report healthy; stops it (SIGTERM, then SIGKILL) on exit. MTPSERVE_COMPILE is not passed
    on, so the config decides."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(cfg, f)
    env = {k: v for k, v in os.environ.items() if k != "MTPSERVE_COMPILE"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "mtpserve.cluster.cli", "up", "--config",
                             f.name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    try:
        for line in proc.stdout:
            if "is serving" in line:
                break
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError("server did not start")
        else:
            raise RuntimeError(f"mtpserve up exited with {proc.wait()}")
        start_s = time.perf_counter() - t0
        # Keep reading the server's output so a full pipe never blocks it.
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        yield start_s
    finally:
        stop_process_group(proc, 120)
        Path(f.name).unlink(missing_ok=True)


def stop_process_group(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM to a server started with `start_new_session=True` and its children, then
    SIGKILL if it has not exited within `timeout_s`."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
