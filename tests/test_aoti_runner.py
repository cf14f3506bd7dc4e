"""Compiled graphs run without the GIL: a Python thread next to a running AOTInductor package
keeps running, and the package's outputs equal the stock loader's."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mtpserve.workers.model import aoti_runner


class _Chain(torch.nn.Module):
    def forward(self, x: torch.Tensor, ys: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        for _ in range(12):
            x = torch.tanh(x @ x)
        ys[0].add_(1.0)  # an input mutated in place, as the decode graphs do with the KV cache
        return x, x.sum()


def _longest_stall(fn, args, runs: int = 3) -> float:
    """The longest a spinning Python thread went without the interpreter while `fn` ran."""
    gaps, stop = [0.0], threading.Event()

    def spin() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            gaps[0] = max(gaps[0], now - last)
            last = now

    t = threading.Thread(target=spin)
    t.start()
    try:
        time.sleep(0.02)
        for _ in range(runs):
            fn(*args)
    finally:
        stop.set()
        t.join()
    return gaps[0]


def _build_root():
    from mtpserve.workers.model.compile_cache import default_cache_dir

    return default_cache_dir() / "ext"


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    x = torch.randn(384, 384)
    ep = torch.export.export(_Chain(), (x, [torch.zeros(4)]))
    path = tmp_path_factory.mktemp("aoti") / "chain.pt2"
    torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
    return path


def test_released_gil_package_matches_stock_and_lets_threads_run(package, tmp_path) -> None:
    x, y_stock, y_ours = torch.randn(384, 384), torch.zeros(4), torch.zeros(4)
    stock = torch._inductor.aoti_load_package(str(package))
    ours = aoti_runner.load_package(package, _build_root())
    assert isinstance(ours, aoti_runner.ReleasedGILPackage)  # the runner built here
    out_stock, out_ours = stock(x, [y_stock]), ours(x, [y_ours])
    assert torch.equal(out_stock[0], out_ours[0]) and torch.equal(out_stock[1], out_ours[1])
    assert torch.equal(y_ours, torch.ones(4)) and torch.equal(y_stock, y_ours)

    t0 = time.perf_counter()
    stock(x, [y_stock])
    run_s = time.perf_counter() - t0
    # The stock loader holds the GIL for the whole run; ours lets the thread in every
    # switch interval (5 ms), so its longest stall stays well under one run.
    held = _longest_stall(stock, (x, [y_stock]))
    released = _longest_stall(ours, (x, [y_ours]))
    assert held > 0.8 * run_s, (held, run_s)
    assert released < 0.5 * held, (released, held)


def test_disabled_by_env_loads_the_stock_way(package, monkeypatch) -> None:
    monkeypatch.setenv(aoti_runner.ENV, "0")
    fn = aoti_runner.load_package(package, _build_root())
    assert not isinstance(fn, aoti_runner.ReleasedGILPackage)

