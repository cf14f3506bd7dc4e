"""Run AOTInductor packages without holding the GIL.

`torch._inductor.aoti_load_package(...)(*args)` keeps the GIL for the whole graph run (measured
here: a Python thread next to it stalled 42 ms, the length of the run). A decode replica runs
its graphs on the engine thread while the same process streams tokens on its event loop and
receives KV on its puller threads; each of those waited for the end of a forward whenever it
needed the interpreter. A few lines of C++ (built once per machine, ~30 s, with the compiler
inductor already needs on CPU) run the same package with the GIL released; the outputs are
identical. Where the build fails, packages load the stock way (logged once).

`MTPSERVE_AOTI_RELEASE_GIL=0` keeps the stock loader.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

log = logging.getLogger(__name__)

ENV = "MTPSERVE_AOTI_RELEASE_GIL"

_SOURCE = r"""
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/utils/pybind.h>

namespace {
// The package's loader, run with the GIL released: the compiled code touches no Python
// object (a Python custom op in the graph takes the GIL back itself).
class Package {
 public:
  explicit Package(const std::string& path) : loader_(path) {}
  std::vector<at::Tensor> run(std::vector<at::Tensor> inputs) {
    pybind11::gil_scoped_release released;
    return loader_.boxed_run(std::move(inputs));
  }
  std::vector<std::string> call_spec() { return loader_.get_call_spec(); }

 private:
  torch::inductor::AOTIModelPackageLoader loader_;
};
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Package>(m, "Package")
      .def(pybind11::init<const std::string&>())
      .def("run", &Package::run)
      .def("call_spec", &Package::call_spec);
}
"""


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


@functools.cache
def _extension(build_root: str) -> Any | None:
    """The built extension, or None where it cannot be built here (logged once)."""
    from torch.utils.cpp_extension import load_inline

    tag = torch.__version__.replace("+", "_").replace(".", "_")
    build = Path(build_root) / f"aoti_nogil-{tag}"
    try:
        build.mkdir(parents=True, exist_ok=True)
        return load_inline(f"mtpserve_aoti_nogil_{tag}", cpp_sources=[_SOURCE],
                           extra_cflags=["-O2"], build_directory=str(build))
    except Exception as e:  # no compiler, read-only cache, header drift: run the stock way
        log.warning("AOTInductor graphs hold the GIL while they run: building the GIL-free "
                    "runner in %s failed (%s)", build, str(e).splitlines()[0] if str(e) else e)
        return None


class ReleasedGILPackage:
    """A loaded AOTInductor package called like the stock one: `fn(*args) -> outputs`."""

    def __init__(self, package: Any) -> None:
        self._package = package
        self._out_spec = pytree.treespec_loads(package.call_spec()[1])

    def __call__(self, *args: Any) -> Any:
        flat = [x for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]
        return pytree.tree_unflatten(self._package.run(flat), self._out_spec)


def load_package(path: str | Path, build_root: str | Path) -> Callable[..., Any]:
    """Load an AOTInductor package, GIL-free when the runner builds (in `build_root`)."""
    ext = _extension(str(build_root)) if enabled() else None
    if ext is None:
        return torch._inductor.aoti_load_package(str(path))
    return ReleasedGILPackage(ext.Package(str(path)))
