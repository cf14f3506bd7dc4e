"""The faster malloc (workers/allocator.py): which library, the variables that give a new
process it, and processes started with them really running on it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mtpserve.workers import allocator

FOUND = allocator.malloc_library()
needs_library = pytest.mark.skipif(
    FOUND is None, reason="no tcmalloc or jemalloc on this machine (Debian: libtcmalloc-minimal4)")
PROBE = "from mtpserve.workers.allocator import preloaded; print(preloaded())"


def _bare_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.ENV)}
    return env


def test_system_asks_for_glibc_and_a_bad_path_is_refused(tmp_path) -> None:
    assert allocator.malloc_library("system") is None
    assert allocator.preload_vars({allocator.ENV: "system"}) == {}
    with pytest.raises(ValueError, match="MTPSERVE_MALLOC"):
        allocator.malloc_library(str(tmp_path / "libnothing.so"))


def test_an_explicit_library_goes_ahead_of_the_existing_preload(tmp_path) -> None:
    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")
    got = allocator.preload_vars({allocator.ENV: str(lib), "LD_PRELOAD": "/x/libother.so"})
    assert got["LD_PRELOAD"] == f"{lib}:/x/libother.so"
    # Already named: nothing to add (no second copy, no loop in reexec_with_preload).
    assert allocator.preload_vars({"LD_PRELOAD": f"{lib}"}) == {}


@needs_library
def test_a_process_started_with_the_variables_runs_on_the_library() -> None:
    bare = _bare_env()
    plain = subprocess.run([sys.executable, "-c", PROBE], env=bare, capture_output=True,
                           text=True, check=True).stdout.strip()
    assert plain == "None"
    env = bare | allocator.preload_vars(bare)
    on = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                        text=True, check=True).stdout.strip()
    assert os.path.basename(FOUND).split(".so")[0] in on


@needs_library
def test_reexec_restarts_the_same_command_under_the_library() -> None:
    code = ("import sys; from mtpserve.workers.allocator import reexec_with_preload, preloaded; "
            "reexec_with_preload(); print(preloaded(), sys.argv[1:])")
    out = subprocess.run([sys.executable, "-c", code, "a", "b"], env=_bare_env(),
                         capture_output=True, text=True, check=True).stdout.strip()
    assert "malloc" in out and out.endswith("['a', 'b']"), out
    # Asked for glibc: no restart.
    out = subprocess.run([sys.executable, "-c", code], env=_bare_env() | {allocator.ENV: "system"},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out.startswith("None"), out


@pytest.mark.parametrize("command", [["generate", "--prompt", "x", "--max-tokens", "2"], ["up"]])
def test_a_bad_setting_is_a_clear_cli_error(tmp_path, command: list[str]) -> None:
    env = _bare_env() | {allocator.ENV: str(tmp_path / "libnothing.so")}
    out = subprocess.run([sys.executable, "-m", "mtpserve.cluster.cli", *command], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "MTPSERVE_MALLOC" in out.stderr and "Traceback" not in out.stderr
