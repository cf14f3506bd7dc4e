"""Writes docs/configuration.md from `ClusterConfig`'s field descriptions (cluster/config.py), so
the page is the code's own words and cannot drift: `tests/test_docs.py` regenerates it and fails
when the committed page differs.

    python -m mtpserve.cluster.config_docs > docs/configuration.md
    python -m mtpserve.cluster.config_docs --write      # the same, into docs/configuration.md

The environment variables the code reads (`MTPSERVE_*`) are listed too; a variable found in the
source without a description here is an error, so a new one cannot go undocumented.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from mtpserve.cluster.config import ClusterConfig
from mtpserve.workers.paths import PACKAGE_ROOT

OUTPUT = Path("docs") / "configuration.md"
# Folders scanned for environment variables (tests and benchmarks set them, they do not read).
_SOURCES = ("workers", "router", "cluster")
_ENV = re.compile(r"MTPSERVE_[A-Z0-9_]+")

ENV_VARS: dict[str, str] = {
    "MTPSERVE_MODEL": "Checkpoint folder used when `model` is not set (default: the embedded "
    "`models/tiny-code-mtp`).",
    "MTPSERVE_API_KEY": "The API key `mtpserve warm` sends when `--api-key` is not given "
    "(the server's own key comes from `auth`).",
    "MTPSERVE_COMPILE": "`auto` | `on` | `off`: overrides `engine.compile` (and "
    "`EngineConfig.compile`) everywhere.",
    "MTPSERVE_DECODE_GRAPHS": "Older spelling: `1` means `MTPSERVE_COMPILE=on`.",
    "MTPSERVE_COMPILE_CACHE": "Folder of the on-disk compile cache when "
    "`engine.compile_cache_dir` is not set (default `~/.cache/mtpserve/compile`).",
    "MTPSERVE_GRAMMAR_CACHE": "Folder of compiled structured-output grammars shared by the "
    "processes of a machine and kept between starts (default `~/.cache/mtpserve/grammars`; "
    "`off`: memory only).",
    "MTPSERVE_AOTI_RELEASE_GIL": "`0` loads compiled graphs with the stock AOTInductor loader, "
    "which holds the GIL during a call (default: a small extension releases it).",
    "MTPSERVE_BF16_WEIGHTS": "`0` keeps float32 weights for every linear (default: a "
    "float32 model's linears whose weights bf16 holds exactly, as a bf16 checkpoint's do, "
    "stream them as bf16 through an AVX-512 kernel; workers/model/bf16_weights.py).",
    "MTPSERVE_CPU_ATTENTION": "`0` keeps inductor's code for the compiled CPU graphs' "
    "paged attention (default: a C++ AVX-512 operator for float32 queries and cache; "
    "workers/model/cpu_paged_attention.py).",
    "MTPSERVE_DRAFT_DTYPE": "`model` | a dtype: what `speculation.draft_dtype: auto` "
    "resolves to in every replica and offline engine (the test suite pins `model`).",
    "MTPSERVE_GREEDY_ROUNDS": "`1` runs a whole greedy k = 1 round as one compiled graph "
    "(TP = 1) in every engine, `0` in none; unset: in CPU engines at a fixed k = 1 that are "
    "not disaggregated replicas.",
    "MTPSERVE_SHM_COLLECTIVES": "`0` makes CPU TP groups all-reduce over gloo instead of "
    "shared memory (for comparison).",
    "MTPSERVE_MALLOC": "`auto` | `system` | a library's path: the malloc CPU replicas (and "
    "the offline commands) preload; auto: tcmalloc, else jemalloc, when the machine has one "
    "(Debian: `libtcmalloc-minimal4`), else glibc's.",
    "MTPSERVE_KV_HOST": "Address KV senders listen on when `kv_transfer.host` is not set.",
    "MTPSERVE_KV_POLL_COMPLETION": "`1` makes gloo KV pairs poll their ops against the "
    "deadline as NCCL pairs do (tests run the NCCL control flow on CPU).",
    "MTPSERVE_HEALTH_DEADLINE_S": "Seconds a replica's health check waits for every TP rank "
    "(default 30).",
    "MTPSERVE_ENGINE_CORE": "`thread` | `process`: overrides `prefill.engine_core` and "
    "`decode.engine_core` in every replica (to run a test suite either way).",
    "MTPSERVE_LINEAR_ATTENTION": "`auto` | `torch` | `fla`: the Gated DeltaNet kernels of "
    "hybrid models (auto: flash-linear-attention on CUDA when it imports, else torch; fla: "
    "refuse to build without it).",
    "MTPSERVE_TRACE_HOPS": "`1` stamps every streamed chunk with the hops it passed "
    "(`mtpserve_trace` in SSE events); off by default.",
    "MTPSERVE_ENABLE_FAULT_INJECTION": "`1` enables the replicas' fault-injection methods "
    "(tests only).",
}


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " \\| ".join(repr(a).replace("'", '"') for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "section"
    return getattr(tp, "__name__", str(tp))


def _bounds(field: FieldInfo) -> str:
    """`ge=1, le=8` as ` >= 1, <= 8` (pydantic keeps them as annotated_types metadata)."""
    out = []
    for m in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                out.append(f"{sign} {getattr(m, attr)}")
    return f" ({', '.join(out)})" if out else ""


def _section_type(tp: Any) -> type[BaseModel] | None:
    """The settings class of a nested field (`X` or `X | None`), else None."""
    for t in (tp, *typing.get_args(tp)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return ""
        if isinstance(value, (str, Path)) and str(value).startswith(str(PACKAGE_ROOT)):
            return f"`{Path(value).relative_to(PACKAGE_ROOT)}`"
    else:
        value = field.default
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`' if value else '`""`'
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _doc(cls: type[BaseModel]) -> str:
    return " ".join((cls.__doc__ or "").split())


def _table(cls: type[BaseModel], prefix: str, rendered: dict[type, str],
           sections: list[tuple[str, type[BaseModel]]]) -> list[str]:
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        key = f"{prefix}{name}"
        sub = _section_type(field.annotation)
        desc = field.description or ""
        if sub is not None:
            if sub in rendered:
                desc = f"{desc} Same keys as [`{rendered[sub]}`](#{_anchor(rendered[sub])})."
            else:
                rendered[sub] = key
                sections.append((key, sub))
                desc = f"{desc} See [`{key}`](#{_anchor(key)})."
        rows.append(f"| `{key}` | {_type_name(field.annotation)}{_bounds(field)} | "
                    f"{_default(field)} | "
                    f"{_cell(desc)} |")
    return rows


def _anchor(key: str) -> str:
    return re.sub(r"[^a-z0-9_ -]", "", key.lower()).replace(" ", "-")


def env_vars_in_source(root: Path = PACKAGE_ROOT) -> set[str]:
    """Every `MTPSERVE_*` name the serving code mentions."""
    found: set[str] = set()
    for folder in _SOURCES:
        for path in (root / folder).rglob("*.py"):
            found |= set(_ENV.findall(path.read_text()))
    return found


def render() -> str:
    """The whole page, deterministic for a given tree."""
    found = env_vars_in_source()
    if found - set(ENV_VARS):
        raise SystemExit(f"describe {sorted(found - set(ENV_VARS))} in cluster/config_docs.py "
                         "ENV_VARS")
    if set(ENV_VARS) - found:
        raise SystemExit(f"{sorted(set(ENV_VARS) - found)} are no longer read by the code: "
                         "remove them from cluster/config_docs.py ENV_VARS")
    out = [
        "# Configuration",
        "",
        "<!-- Generated by `python -m mtpserve.cluster.config_docs --write` from the field",
        "     descriptions in cluster/config.py. Do not edit by hand: tests/test_docs.py fails",
        "     when this page and the code disagree. -->",
        "",
        "A Serve deploy config holds one application whose `import_path` is",
        "`mtpserve.cluster.app:build_app` and whose `args:` is a `ClusterConfig`",
        "(`cluster/config.py`). `mtpserve up --config FILE`, `serve run FILE` and `serve deploy",
        "FILE` read such a file; the Helm chart renders one from its `serve.args` value",
        "(`helm/mtpserve/README.md`). Unknown keys are errors, values are",
        "type-checked, and cross-field checks run when the config is loaded (for example a",
        "`tp_size` must divide the model's attention heads and divide its KV heads or be a",
        "multiple of them (KV heads are then replicated), `kv_transfer.backend: nccl` needs",
        "`device: cuda`); the error names the field.",
        "",
        "```yaml",
        "applications:",
        "  - name: mtpserve",
        "    route_prefix: /",
        "    import_path: mtpserve.cluster.app:build_app",
        "    args:            # a ClusterConfig: every key below is optional",
        "      decode: {replicas: 1, tp_size: 1}",
        "      speculation: {num_speculative_tokens: 2}",
        "```",
        "",
        "The shipped files are in `configs/` (see the README). `prefix_caching: false` is",
        "short for `prefix_caching: {enabled: false}`.",
        "",
        "## Top level",
        "",
        _doc(ClusterConfig),
        "",
    ]
    rendered: dict[type, str] = {}
    sections: list[tuple[str, type[BaseModel]]] = []
    out += _table(ClusterConfig, "", rendered, sections)
    while sections:
        key, cls = sections.pop(0)
        out += ["", f"## {key}", ""]
        if _doc(cls):
            out += [_doc(cls), ""]
        out += _table(cls, f"{key}.", rendered, sections)
    out += ["", "## Environment variables", "",
            "Read by the serving code (`workers/`, `router/`, `cluster/`); a config key, where",
            "there is one, is the usual way to set the same thing.", "",
            "| variable | effect |", "|---|---|"]
    out += [f"| `{name}` | {_cell(text)} |" for name, text in sorted(ENV_VARS.items())]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help=f"write {OUTPUT} (in a source checkout) instead of printing")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        (PACKAGE_ROOT / OUTPUT).write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
