"""Dependencies point one way and the distribution installs one import name
(docs/architecture.md, "Layers").

engine (Ray-free) <- replica shells and data path (Ray, torch.distributed) <- cluster, router.
Read from the source with `ast`, so an import inside a function counts too."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("workers", "router", "cluster", "benchmarks")
# The engine is workers/ less these two folders: replica/ (Serve shells, the TP group, metrics,
# the replica side of the data path: the only place that imports Ray) and kv_transfer/ (the
# wire protocol: Ray-free, never imports replica/).
REPLICA, WIRE = "workers.replica", "workers.kv_transfer"


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _modules() -> dict[str, set[str]]:
    """module name (without `mtpserve.`) -> absolute names it imports."""
    out = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts).removesuffix(".__init__")
            package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            imports: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imports |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom):
                    if node.level:  # relative: resolve against this module's package
                        base = package[: len(package) - node.level + 1]
                        module = ".".join(["mtpserve", *base, *filter(None, [node.module])])
                    else:
                        module = node.module or ""
                    imports.add(module)
                    # `from mtpserve import router` imports the layer itself.
                    imports |= {f"{module}.{a.name}" for a in node.names}
            out[name] = imports
    return out


def _layer(imported: str) -> str | None:
    parts = imported.split(".")
    if parts[0] == "mtpserve" and len(parts) > 1:
        return parts[1]
    return None


def test_every_import_uses_the_one_import_name() -> None:
    bare = {m: sorted(i for i in imps if i.split(".")[0] in LAYERS)
            for m, imps in _modules().items()}
    assert not {m: b for m, b in bare.items() if b}, "import them as mtpserve.<layer>"


def test_workers_never_import_router_or_cluster() -> None:
    bad = {m: sorted(i for i in imps if _layer(i) in ("router", "cluster"))
           for m, imps in _modules().items() if m.startswith("workers")}
    assert not {m: b for m, b in bad.items() if b}


def test_the_engine_is_ray_free() -> None:
    """Only replica/ imports Ray."""
    bad = {m: sorted(i for i in imps if i.split(".")[0] == "ray")
           for m, imps in _modules().items()
           if m.startswith("workers") and not _in(m, REPLICA)}
    assert not {m: b for m, b in bad.items() if b}


def test_the_engine_never_imports_the_replica_or_the_wire() -> None:
    """The folder line is the layer line: the engine imports neither replica/ nor kv_transfer/,
    and the wire protocol does not import the replica."""
    bad = {}
    for m, imps in _modules().items():
        if not m.startswith("workers") or _in(m, REPLICA):
            continue
        banned = (REPLICA,) if _in(m, WIRE) else (REPLICA, WIRE)
        hits = sorted(i for i in imps if any(_in(i.removeprefix("mtpserve."), b) for b in banned))
        if hits:
            bad[m] = hits
    assert not bad


@pytest.mark.parametrize("source, check", [
    ("def f():\n    from mtpserve.router.api import build_api\n",
     test_workers_never_import_router_or_cluster),
    ("from mtpserve import cluster\n", test_workers_never_import_router_or_cluster),
    ("from ..router import api\n", test_workers_never_import_router_or_cluster),
    ("def f():\n    import ray\n", test_the_engine_is_ray_free),
    ("from workers.engine import Engine\n", test_every_import_uses_the_one_import_name),
    ("from mtpserve.workers.replica.tp_group import TPDriver\n",
     test_the_engine_never_imports_the_replica_or_the_wire),
    ("def f():\n    from mtpserve.workers.kv_transfer import KVSender\n",
     test_the_engine_never_imports_the_replica_or_the_wire),
    ("from .replica import metrics\n", test_the_engine_never_imports_the_replica_or_the_wire),
])
def test_the_checks_see_a_violation(source: str, check) -> None:
    """The scanner itself: each kind of violation, in a probe module of workers/, is found
    (absolute, `from mtpserve import <layer>`, relative, a Ray import, a bare layer name)."""
    probe = ROOT / "workers" / "_layering_probe.py"
    probe.write_text(source)
    try:
        with pytest.raises(AssertionError):
            check()
    finally:
        probe.unlink()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # setuptools stages files in ./build/lib: a stale copy of a moved module would ship.
    shutil.rmtree(ROOT / "build" / "lib" / "mtpserve", ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(ROOT)], check=True, timeout=300)
    (whl,) = out.glob("mtpserve-*.whl")
    return whl


def test_the_wheel_installs_only_mtpserve(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"mtpserve", wheel.name.split("-")[0] + "-"
                                                 + wheel.name.split("-")[1] + ".dist-info"}
    for data in ("models/tiny-code-mtp/model.safetensors", "models/tiny-code-mtp/config.json",
                 "models/tiny-code-mtp/tokenizer.json", "models/tiny-code-mtp/draft_vocab.json",
                 "configs/local-cpu.yaml", "cluster/app.py", "workers/messages.py"):
        assert f"mtpserve/{data}" in names, data
    assert not any(n.startswith("mtpserve/tests/") for n in names)


def test_the_wheel_runs_from_any_directory(wheel: Path, tmp_path: Path) -> None:
    """A fresh virtual environment with only the wheel installed (its dependencies come from
    this environment's site-packages on PYTHONPATH, where no mtpserve lives) runs `mtpserve
    check` and `mtpserve generate` on the embedded model from an empty directory."""
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                    "--no-deps", str(wheel)], check=True, timeout=300)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("MTPSERVE_MODEL", "PYTHONPATH")}
    env["PYTHONPATH"] = sysconfig.get_paths()["purelib"]
    where = subprocess.run([str(py), "-c", "import mtpserve; print(mtpserve.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(venv)), where.stdout
    check = subprocess.run([str(venv / "bin" / "mtpserve"), "check"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
    assert "0 problem(s)" in check.stdout
    gen = subprocess.run([str(venv / "bin" / "mtpserve"), "generate", "--prompt",
                          "def add(a, b):\n", "--max-tokens", "8"], cwd=work, env=env,
                         capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert gen.stdout.strip()
