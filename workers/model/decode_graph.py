"""Compiled decode forwards: on CPU one dynamic-shape package per (kind, module), elsewhere one
fixed-shape graph per (kind, module, batch, query, blocks) bucket.

A decode step is dominated by fixed per-op cost (~360 small eager ops per forward), not by
arithmetic. Compiling the forward with inductor fuses the norms, RoPE, residuals and the
attention bookkeeping into a few kernels (on CPU with freezing, which also pre-packs the linear
weights). On CPU an ahead-of-time package is exported with batch, query length and table width
as dynamic dims and runs every forward at its exact shape (a dynamic torch.compile attempt,
which recompiled per shape, ran 7x slower; an exported package compiles once). Static buckets
(torch.compile / CUDA graphs, flex, a failed dynamic export) round batch B and query length S
up to powers of two, the block table to a power of two of at least `min_blocks` blocks.
Nothing in the graph branches on data: padding
query slots write their K/V into the cache's scratch block, padding table entries point at it,
and the causal mask is always a tensor built in the graph from the positions.

A fused greedy round of k = 1 (workers/model/greedy_round.py) is one more dynamic package
(batch and table width dynamic, the two query positions static): one package for every batch
and context, where its static buckets were one per (batch, table) bucket; interleaved on the
default model it also ran faster than them (b1 945 -> 976 tok/s, b4 1917 -> 2023).

Prefill (long S) stays eager. TP > 1 ranks of one CPU node compile too: their collectives are
the shared-memory custom ops of `workers.model.parallel`; every rank must warm up the same
buckets in the same order (the TP driver paces them), since a warm-up forward runs collectives.

On CPU (frozen graphs) each bucket is built ahead of time as an AOTInductor package and kept
in an on-disk cache (`workers.model.compile_cache`): a restarted replica loads its graphs
instead of compiling them. Elsewhere (`freeze=False`, CUDA) buckets go through `torch.compile`.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from mtpserve.workers.kv_cache import KVCache
from mtpserve.workers.model import bf16_weights, cpu_paged_attention
from mtpserve.workers.model.attention_metadata import graph_metadata, stage_lists
from mtpserve.workers.model.compile_cache import (
    AOTGraphCache,
    default_cache_dir,
    model_fingerprint,
)
from mtpserve.workers.model.greedy_round import greedy_round_graph
from mtpserve.workers.model.parallel import get_tp
from mtpserve.workers.model.transformer import CausalLM

log = logging.getLogger(__name__)


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def query_bucket(n: int) -> int:
    """1 for plain decode; otherwise a power of two >= 4, so k = 1..3 (verify S = 2..4, MTP
    catch-up S = 1..4) share one graph per kind: padding a few query rows costs far less than
    compiling and holding another graph."""
    return 1 if n == 1 else bucket(n, 4)


@dataclass(frozen=True)
class GraphKey:
    """A static bucket, or (`dynamic`) one forward's exact shape run by the one package of
    its (kind, module) whose batch, query length and table width are dynamic; that package's
    own key (`package`) has batch = query_len = num_blocks = 0."""

    kind: str  # "main" | "mtp" | "round" (a whole greedy round: query_len = k + 1, exact)
    module: int
    batch: int  # B bucket (dynamic: B)
    query_len: int  # S bucket (dynamic: S)
    num_blocks: int  # block-table width bucket (dynamic: the widest row's)
    dynamic: bool = False

    @staticmethod
    def dynamic_package(kind: str, module: int) -> GraphKey:
        """The key of (kind, module)'s dynamic-shape package."""
        return GraphKey(kind, module, 0, 0, 0, True)

    @property
    def package(self) -> GraphKey:
        """The key of the graph that runs this shape (itself when static)."""
        return GraphKey.dynamic_package(self.kind, self.module) if self.dynamic else self

    @property
    def name(self) -> str:
        """The bucket's name in logs, progress reports and compile-cache file names."""
        if self.dynamic:
            return f"{self.kind}{self.module}-dynamic"
        return f"{self.kind}{self.module}-b{self.batch}-s{self.query_len}-nb{self.num_blocks}"


# Example shape a dynamic package is exported at (every dynamic dim > 1, so export keeps it
# symbolic); fixed, so its compile-cache file name never depends on the first traffic.
_DYNAMIC_EXAMPLE = (4, 4, 8)  # batch, query length, table width


@dataclass
class GraphInputs:
    """Bucket-padded int inputs of one forward, built from the batch's Python lists."""

    key: GraphKey
    ids: torch.Tensor  # [Bp, Sp]
    positions: torch.Tensor  # [Bp, Sp]
    slots: torch.Tensor  # [Bp * Sp] flat KV slot written by each query slot
    tables: torch.Tensor  # [Bp, NBp]
    logit_rows: torch.Tensor  # [Bp * Sp] padded-layout rows whose logits are returned


def _main_graph(model: CausalLM, block_size: int, ids: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, tables: torch.Tensor, logit_rows: torch.Tensor,
                caches: list[torch.Tensor], inline: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor]:
    B, S = ids.shape
    attn = graph_metadata(positions, slots.reshape(-1), tables, block_size,
                          model.attention_backend, inline)
    flat = model(ids, positions, attn, caches).reshape(B * S, -1)  # [B*S, hidden]
    return flat, model.compute_logits(flat[logit_rows])


def _mtp_graph(model: CausalLM, block_size: int, module: int, ids: torch.Tensor,
               prev: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               tables: torch.Tensor, logit_rows: torch.Tensor,
               caches: list[torch.Tensor], inline: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
    B, S = ids.shape
    attn = graph_metadata(positions, slots.reshape(-1), tables, block_size,
                          model.attention_backend, inline)
    flat = model.forward_mtp(module, ids, prev, positions, attn, caches).reshape(B * S, -1)
    return flat, model.compute_mtp_logits(module, flat[logit_rows])


class _MainForward(torch.nn.Module):
    """`_main_graph` as a module, the unit AOTInductor exports."""

    def __init__(self, model: CausalLM, block_size: int) -> None:
        super().__init__()
        self.model, self.block_size = model, block_size

    def forward(self, ids, positions, slots, tables, logit_rows, caches):
        return _main_graph(self.model, self.block_size, ids, positions, slots, tables,
                           logit_rows, caches)


class _MTPForward(torch.nn.Module):
    def __init__(self, model: CausalLM, block_size: int, module: int) -> None:
        super().__init__()
        self.model, self.block_size, self.module = model, block_size, module

    def forward(self, ids, prev, positions, slots, tables, logit_rows, caches):
        return _mtp_graph(self.model, self.block_size, self.module, ids, prev, positions, slots,
                          tables, logit_rows, caches)


class _RoundForward(torch.nn.Module):
    def __init__(self, model: CausalLM, block_size: int, scratch_slot: int) -> None:
        super().__init__()
        self.model, self.block_size, self.scratch_slot = model, block_size, scratch_slot

    def forward(self, ids, positions, slots, tables, room, caches):
        # slots [B, k + 1] (export names its batch dim); the round reads them flat
        return greedy_round_graph(self.model, self.block_size, self.scratch_slot, ids,
                                  positions, slots.reshape(-1), tables, room, caches)


def _raise_recompile_limit(n: int) -> None:
    # Every bucket is one specialisation of the same two functions; dynamo's default limit (8)
    # would silently fall back to eager after the eighth.
    import torch._dynamo.config as dcfg

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(dcfg, name):
            setattr(dcfg, name, max(getattr(dcfg, name), n))


@contextlib.contextmanager
def _cpu_compile_settings(freeze: bool, cpp_wrapper: bool) -> Iterator[None]:
    """Freezing folds the weights into the graph as constants and pre-packs every linear
    (it only takes effect through the global inductor config, not `torch.compile(options=)`).
    Inductor packs fp32 linears for MKL when the batch is static; on this AMD CPU MKL's small-M
    GEMM costs ~3x a GEMV at M = 4 while oneDNN's costs about the same as one, so the packing
    is steered to oneDNN (`mkldnn._linear_pointwise`, the path inductor itself takes for
    dynamic batch sizes).

    `cpp_wrapper`: the code that calls the kernels is generated as C++ instead of Python.
    The Python wrapper costs ~75 us per call here (size/stride asserts, buffer allocation,
    tensor reinterpretation: 36 + 21 + 19 calls per forward) on top of dynamo's frame, which
    is a large share of a 0.5 ms MTP draft step."""
    if not freeze:
        yield
        return
    import torch._inductor.config as icfg
    from torch._inductor.fx_passes import mkldnn_fusion

    with icfg.patch(freezing=True, cpp_wrapper=cpp_wrapper), \
            mock.patch.object(mkldnn_fusion, "has_free_symbols", lambda _: True):
        yield


class DecodeGraphs:
    """Compiled decode forwards over one model and KV cache, created lazily per bucket (call
    `warmup` at start so no compile lands on the serving path)."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, max_query_len: int = 16,
                 min_blocks: int = 32, freeze: bool = True, cpp_wrapper: bool = True,
                 greedy_rounds: bool = False, cache_dir: str | Path | None = None,
                 ahead_of_time: bool = True, dynamic: bool = True) -> None:
        self.model = model
        self.kv = kv_cache
        self.block_size = kv_cache.block_size
        self.scratch_slot = kv_cache.scratch_block * kv_cache.block_size
        self.max_query_len = max_query_len
        self.min_blocks = min_blocks
        cfg = model.config
        self.max_positions = cfg.max_position_embeddings
        self.max_blocks = bucket(-(-cfg.max_position_embeddings // self.block_size), min_blocks)
        device = next(model.parameters()).device
        self.device = device
        _raise_recompile_limit(512)
        import torch._inductor.config as icfg

        # Compile in this process: a pool of compile workers each imports torch, which on a
        # small shared CPU competes with the first timed decode steps for tens of seconds.
        # (A GPU host keeps the parallel Triton compile: there warm-up time is the cost.)
        if device.type == "cpu":
            icfg.compile_threads = 1
        self.freeze = freeze and device.type == "cpu"
        self.cpp_wrapper = cpp_wrapper and self.freeze
        # Whole greedy rounds as one graph (workers.model.greedy_round), one MTP module only.
        self.greedy_rounds = greedy_rounds and model.config.num_mtp_modules == 1
        self._main = torch.compile(_main_graph, dynamic=False, fullgraph=True)
        self._mtp = torch.compile(_mtp_graph, dynamic=False, fullgraph=True)
        self._round = torch.compile(greedy_round_graph, dynamic=False, fullgraph=True)
        # CPU: ahead-of-time packages, cached on disk (the C++ wrapper is built in). `cache_dir`
        # None: the default folder; "": a private temporary folder (nothing reused).
        # `ahead_of_time=False`: torch.compile in this process (nothing cached).
        self.aot: AOTGraphCache | None = None
        if self.cpp_wrapper and ahead_of_time:
            if cache_dir == "":
                self._tmp = tempfile.TemporaryDirectory(prefix="mtpserve-compile-")
                cache_dir = self._tmp.name
            root = Path(cache_dir) if cache_dir else default_cache_dir()
            fp = model_fingerprint(model, self.block_size, tuple(kv_cache.buffers[0].shape),
                                   len(kv_cache.buffers), "freeze-onednn",
                                   getattr(model, "attention_backend", None),
                                   (get_tp().rank, get_tp().size),
                                   # graphs of bf16-weight linears call their kernel,
                                   # graphs built with the C++ attention op call it
                                   bf16_weights.packed_count(model),
                                   cpu_paged_attention.available())
            self.aot = AOTGraphCache(root, fp, lambda: _cpu_compile_settings(True, False))
        # One ahead-of-time package per (kind, module) with dynamic batch, query length and
        # table width instead of one per static bucket: 2 packages cover the default config
        # where it had 72 static buckets of ~30 s each, and every forward runs at its exact
        # shape (no rows padded to a power of two, no table padded to 32 blocks: 10 rows of
        # ~280 positions ran the 16-row, 32-block bucket in 18 ms, the exact shape in 12).
        # Static buckets stay for torch.compile (CUDA graphs need fixed shapes) and for a
        # model whose dynamic export fails (`_run_dynamic`).
        # (FlexAttention's block mask does not export with dynamic dims: flex stays static.)
        self.dynamic = (dynamic and self.aot is not None
                        and getattr(model, "attention_backend", None) != "flex")
        self._fns: dict[GraphKey, Callable] = {}
        self.compiled: set[GraphKey] = set()
        # After `warmup`, a bucket it did not compile (e.g. a short prefill chunk) runs eagerly
        # instead of compiling on the serving path.
        self.warmed = False
        # Compile progress (workers/model/compile_progress.py reads these): every bucket a
        # warm-up covered, in its order; when the first warm-up began and when each bucket
        # became built (wall clock: here, or the background compiler's package mtime); the
        # seconds of each bucket compiled (not loaded) in this process; the finish times of
        # the packages the background compiler built.
        self.planned: list[GraphKey] = []
        self.started_at: float | None = None
        self.ready_at: dict[GraphKey, float] = {}
        self.compile_seconds: list[float] = []
        self.background_finished: list[float] = []

    def key_for(self, kind: str, module: int, lens: list[int],
                tables: list[list[int]]) -> GraphKey | None:
        """The bucket for this batch, or None when it must run eagerly."""
        S = max(lens)
        if S > self.max_query_len:
            return None
        widest = max(len(t) for t in tables)
        if self.dynamic and kind != "round":
            if widest > self.max_blocks:
                return None
            key = GraphKey(kind, module, len(lens), S, widest, True)
            return None if self.warmed and key.package not in self.compiled else key
        nb = bucket(widest, self.min_blocks)
        if nb > self.max_blocks:
            return None
        key = GraphKey(kind, module, bucket(len(lens)), query_bucket(S), nb)
        return None if self.warmed and key not in self.compiled else key

    def prepare(self, key: GraphKey, input_ids: list[list[int]], starts: list[int],
                tables: list[list[int]], logit_rows: list[int],
                device_ids: torch.Tensor | None = None) -> GraphInputs:
        """The bucket's inputs, built on the host and moved in one non-blocking staged copy
        (no host sync); `device_ids` [B, S'] (already on the device) overwrite the first S'
        ids of the first B rows."""
        Bp, Sp, NBp = key.batch, key.query_len, key.num_blocks
        bs, scratch = self.block_size, self.kv.scratch_block
        S = max(len(x) for x in input_ids)
        ids, pos, slots, tab = [], [], [], []
        for b in range(Bp):
            if b < len(input_ids):
                row, start, table = input_ids[b], starts[b], tables[b]
                n = len(row)
                ids += row + [0] * (Sp - n)
                # Padding slots repeat the last real position (valid RoPE index, never a
                # fully masked row) and write to the scratch block.
                p = [start + s for s in range(n)]
                if p[-1] >= self.max_positions:  # compiled kernels do not bounds-check RoPE
                    raise IndexError(f"row {b}: position {p[-1]} is past the model's "
                                     f"{self.max_positions} positions")
                pos += p + [p[-1]] * (Sp - n)
                for q in p:
                    if q // bs >= len(table):
                        raise IndexError(f"row {b}: position {q} needs block {q // bs} but "
                                         f"its table has {len(table)} blocks")
                    slots.append(table[q // bs] * bs + q % bs)
                slots += [self.scratch_slot] * (Sp - n)
                tab += table + [scratch] * (NBp - len(table))
            else:  # padding row: attends only to the scratch block's position 0
                ids += [0] * Sp
                pos += [0] * Sp
                slots += [self.scratch_slot] * Sp
                tab += [scratch] * NBp
        rows = [(r // S) * Sp + r % S for r in logit_rows]
        rows += [0] * (Bp * Sp - len(rows))
        d_ids, d_pos, d_slots, d_tab, d_rows = stage_lists([ids, pos, slots, tab, rows],
                                                           self.device)
        d_ids = d_ids.view(Bp, Sp)
        if device_ids is not None:
            d_ids[: device_ids.shape[0], : device_ids.shape[1]] = device_ids
        return GraphInputs(key, d_ids, d_pos.view(Bp, Sp), d_slots, d_tab.view(Bp, NBp),
                           d_rows)

    def run(self, inp: GraphInputs,
            prev: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """main / mtp: (hidden [Bp*Sp, hidden] in padded layout, logits [Bp*Sp, V]);
        round: (accepted [Bp], bonus [Bp], drafts [Bp, k]) with `prev` the rows' room."""
        k = inp.key
        fn = self._fns.get(k.package)
        if fn is not None:
            return tuple(fn(*self._args(inp, prev)))
        if k.dynamic:
            return self._run_dynamic(inp, prev)
        if k not in self.compiled:  # this call compiles (or loads) the bucket's graph
            self.compiled.add(k)
            if self.aot is not None:
                try:
                    fn = self.aot.get(*self._module(k), self._args(inp, prev))
                except Exception as e:  # keep serving: torch.compile builds this bucket
                    log.warning("ahead-of-time compile of %s failed (%s); using "
                                "torch.compile", k, e)
                else:
                    self._fns[k] = fn
                    return tuple(fn(*self._args(inp, prev)))
            with _cpu_compile_settings(self.freeze, self.cpp_wrapper):
                return self._call(inp, prev)
        return self._call(inp, prev)

    def _run_dynamic(self, inp: GraphInputs,
                     prev: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """Build (or load) the dynamic package of `inp`'s (kind, module), exported at the
        fixed example shape, then run `inp`. If the export or compile fails, every later
        forward uses static buckets (`key_for`) and this one runs eagerly."""
        pkg = inp.key.package
        self.compiled.add(pkg)
        ex_inp, ex_prev = self.example_inputs(pkg)
        try:
            fn = self.aot.get(*self._module(pkg), self._args(ex_inp, ex_prev),
                              dynamic_shapes=self._dynamic_shapes(pkg))
        except Exception as e:
            self.compiled.discard(pkg)
            if pkg.kind == "round":  # rounds go step by step; forwards keep their packages
                log.warning("dynamic-shape package %s failed (%s); rounds run step by step",
                            pkg.name, e)
                self.greedy_rounds = False
            else:
                log.warning("dynamic-shape package %s failed (%s); using static buckets",
                            pkg.name, e)
                self.dynamic = False
            return self._eager(inp, prev)
        self._fns[pkg] = fn
        return tuple(fn(*self._args(inp, prev)))

    def _eager(self, inp: GraphInputs,
               prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A forward (or a round) of `inp`'s shape without any graph."""
        k = inp.key
        if k.kind == "round":
            return greedy_round_graph(self.model, self.block_size, self.scratch_slot, inp.ids,
                                      inp.positions, inp.slots, inp.tables, prev,
                                      self.kv.buffers)
        if k.kind == "main":
            return _main_graph(self.model, self.block_size, inp.ids, inp.positions, inp.slots,
                               inp.tables, inp.logit_rows, self.kv.buffers, inline=False)
        return _mtp_graph(self.model, self.block_size, k.module, inp.ids, self._mtp_prev(k, prev),
                          inp.positions, inp.slots, inp.tables, inp.logit_rows,
                          self.kv.buffers, inline=False)

    def _dynamic_shapes(self, pkg: GraphKey) -> tuple:
        """torch.export's dynamic dims of a package's arguments (`_args` order)."""
        from torch.export import Dim

        B = Dim("B", min=1, max=4096)
        S = Dim("S", min=1, max=self.max_query_len)
        nb = Dim("NB", min=1, max=self.max_blocks)
        rows = Dim("R", min=1, max=4096 * self.max_query_len)
        bs = {0: B, 1: S}
        tail = ({0: B, 1: nb}, {0: rows}, [None] * len(self.kv.buffers))
        if pkg.kind == "round":  # ids, positions, slots [B, k + 1] (k static), room [B]
            b = {0: B}
            return (b, b, b, {0: B, 1: nb}, {0: B}, tail[-1])
        if pkg.kind == "main":  # ids, positions, slots
            return (bs, bs, bs) + tail
        return (bs, bs, bs, bs) + tail  # ids, prev hidden [B, S, hidden], positions, slots

    def _mtp_prev(self, k: GraphKey, prev: torch.Tensor) -> torch.Tensor:
        # One input dtype per graph: the previous hidden comes from the main model (model
        # dtype) or from a draft step (the MTP's dtype, maybe bf16); a second dtype would make
        # dynamo recompile the bucket on the serving path.
        return prev.to(self.model.mtp[k.module].eh_proj.weight.dtype)

    def _module(self, k: GraphKey) -> tuple[str, torch.nn.Module]:
        name = k.name
        if k.kind == "round":
            return name, _RoundForward(self.model, self.block_size, self.scratch_slot)
        if k.kind == "main":
            return name, _MainForward(self.model, self.block_size)
        return name, _MTPForward(self.model, self.block_size, k.module)

    def _args(self, inp: GraphInputs, prev: torch.Tensor | None) -> tuple:
        k = inp.key
        slots = inp.slots.view(inp.ids.shape)  # [B, S]: export can name both dims
        if k.kind == "round":
            return (inp.ids, inp.positions, slots, inp.tables, prev, self.kv.buffers)
        if k.kind == "main":
            return (inp.ids, inp.positions, slots, inp.tables, inp.logit_rows,
                    self.kv.buffers)
        return (inp.ids, self._mtp_prev(k, prev), inp.positions, slots, inp.tables,
                inp.logit_rows, self.kv.buffers)

    def compile_stats(self) -> dict[str, float]:
        """Graphs built here vs loaded from the on-disk cache, and the seconds each took."""
        a = self.aot
        return {"compiled": (a.compiled if a else 0) + len(self.compiled) - len(self._fns),
                "loaded": a.loaded if a else 0,
                "compile_s": round(a.compile_s, 2) if a else 0.0,
                "load_s": round(a.load_s, 2) if a else 0.0}

    def cached(self, keys: list[GraphKey]) -> bool:
        """Whether every one of `keys` is built here or would load from the disk cache."""
        for k in keys:
            if k in self._fns or (self.aot is None and k in self.compiled):
                continue
            if self.aot is None or not self.package_path(k).is_file():
                return False
        return True

    def package_path(self, k: GraphKey) -> Path:
        """Where the on-disk cache keeps (or would keep) `k`'s package (ahead-of-time only;
        builds the bucket's example inputs once to name it)."""
        name, _ = self._module(k)
        return self.aot.path_for(name, self._args(*self.example_inputs(k)))

    def round_key(self, k: int, batch: int, tables: list[list[int]]) -> GraphKey | None:
        """The bucket of a greedy round of k drafts, or None when it must run step by step.
        Only k = 1 is fused: measured here, one k=1 round graph beat the step-by-step round
        by 18%, but the k = 2 / 3 round graphs ran slower than their separate forwards
        (5.0 vs ~4.0 ms at k = 3), so those stay step by step."""
        if k != 1:
            return None
        if self.dynamic:  # one package, run at the exact batch and table width
            widest = max(len(t) for t in tables)
            if widest > self.max_blocks:
                return None
            key = GraphKey("round", 0, batch, k + 1, widest, True)
            return None if self.warmed and key.package not in self.compiled else key
        nb = bucket(max(len(t) for t in tables), self.min_blocks)
        if nb > self.max_blocks:
            return None
        key = GraphKey("round", 0, bucket(batch), k + 1, nb)
        return None if self.warmed and key not in self.compiled else key

    def _call(self, inp: GraphInputs,
              prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        k = inp.key
        if k.kind == "round":
            assert prev is not None
            return self._round(self.model, self.block_size, self.scratch_slot, inp.ids,
                               inp.positions, inp.slots, inp.tables, prev, self.kv.buffers)
        if k.kind == "main":
            return self._main(self.model, self.block_size, inp.ids, inp.positions, inp.slots,
                              inp.tables, inp.logit_rows, self.kv.buffers)
        assert prev is not None
        prev = self._mtp_prev(k, prev)
        return self._mtp(self.model, self.block_size, k.module, inp.ids, prev, inp.positions,
                         inp.slots, inp.tables, inp.logit_rows, self.kv.buffers)

    def warmup(self, batch_sizes: list[int], query_lens: list[int], max_context: int,
               mtp_modules: int, log: Callable[[str], None] | None = None,
               deadline: float | None = None, cached_only: bool = False,
               restart_budget_s: float | None = None,
               run_bucket: Callable[[GraphKey], None] | None = None) -> int:
        """Compile the buckets these batch sizes / query lengths / contexts can hit, likeliest
        first (small batches, short contexts), until `deadline` (time.monotonic(); checked
        before each compile, so the last one may run past it); writes only the scratch block.
        Afterwards a bucket not compiled runs eagerly. Returns the number compiled now.
        `cached_only`: load the buckets the on-disk cache holds, compile none.
        `restart_budget_s`: when the cache held some of them (a restart, or a replica added
        next to others), compile new ones for at most this long after loading (0: none), so
        such a start takes seconds; the first, cold start compiles within `deadline`.
        `run_bucket(key)`: builds and runs one bucket (default: here; a TP driver runs it on
        every rank in step), after which `key` must be in `self.compiled`."""
        import time

        keys = self.warmup_keys(batch_sizes, query_lens, max_context, mtp_modules)
        self.plan(keys)
        # What the on-disk cache holds loads first (well under a second each), so a budget
        # spent compiling one cold bucket never leaves a cached one to run eagerly.
        cached = [k for k in keys if k not in self.compiled and self.cached([k])]
        cold = [] if cached_only else [k for k in keys if k not in self.compiled
                                       and k not in cached]
        done = 0
        restart_deadline = None
        for i, key in enumerate(cached + cold):
            if key.dynamic and not self.dynamic:  # a dynamic export failed: static buckets
                self.planned = [k for k in self.planned if not k.dynamic]
                return done + self.warmup(batch_sizes, query_lens, max_context, mtp_modules,
                                          log, deadline, cached_only, restart_budget_s,
                                          run_bucket)
            if i == len(cached) and cached and restart_budget_s is not None:
                restart_deadline = time.monotonic() + restart_budget_s
                deadline = (restart_deadline if deadline is None
                            else min(deadline, restart_deadline))
            if i >= len(cached) and deadline is not None and time.monotonic() > deadline:
                if log:
                    log(f"warm-up budget spent: {len(keys) - len(self.compiled & set(keys))} "
                        "bucket(s) left to run eagerly")
                break
            (run_bucket or self.warm_bucket)(key)
            done += 1
            if log:
                how = "loaded" if i < len(cached) else "compiled"
                log(f"{how} {key} ({len(self.compiled & set(keys))}/{len(keys)})")
        self.warmed = True
        return done

    def example_inputs(self, key: GraphKey) -> tuple[GraphInputs, torch.Tensor | None]:
        """Inputs of `key`'s shapes that write only the scratch block (what warm-up runs; a
        dynamic package's: its fixed example shape)."""
        if key.dynamic and key.batch == 0:
            B, S, NB = _DYNAMIC_EXAMPLE
            # a round package is k = 1's: rows of 2
            key = GraphKey(key.kind, key.module, B, 2 if key.kind == "round" else S, NB, True)
        table = [self.kv.scratch_block] * key.num_blocks
        B, S = key.batch, key.query_len
        if key.kind == "round":
            inp = self.prepare(key, [[0] * S] * B, [0] * B, [table] * B, [])
            return inp, torch.zeros(B, dtype=torch.long, device=self.device)
        inp = self.prepare(key, [[0] * S] * B, [0] * B, [table] * B, list(range(B * S)))
        if key.kind == "main":
            return inp, None
        dtype = next(self.model.parameters()).dtype
        return inp, torch.zeros(B, S, self.model.config.hidden_size, dtype=dtype,
                                device=self.device)

    def warmup_keys(self, batch_sizes: list[int], query_lens: list[int], max_context: int,
                    mtp_modules: int) -> list[GraphKey]:
        """Every bucket warm-up may compile, in the order it compiles them: contexts up to
        the smallest block-table bucket first for every batch (most requests fit there), then
        longer ones; within a (table, batch) bucket the forwards every round runs first (the
        widest verify row, the MTP extend and draft steps), the single-token main forward
        (k = 0, or no room to draft) last.

        This order is the order traffic reaches the shapes, and the background compiler
        (workers/model/background_compile.py) builds in it too (its child calls `warmup` with
        the same shapes): a fresh server's first requests are one or a few streams of short
        contexts, so batch 1 at the smallest table comes first and each batch bucket before
        the next larger one; within a bucket the query lengths every speculative round runs
        (the k + 1 verify row, the MTP extend and its 1-token draft steps) come before the
        1-token main forward, which smaller-first would put first although a speculating
        replica rarely runs it (and a k = 0 replica, whose only query length it is, gets it
        first anyway). A round is fast only once all of its graphs are built, so finishing
        one whole batch bucket before starting the next matters more than any order inside
        it."""
        bs = self.block_size
        nbs, nb = [], self.min_blocks
        while nb <= min(bucket(-(-max_context // bs), self.min_blocks), self.max_blocks):
            nbs.append(nb)
            nb *= 2
        queries = sorted({query_bucket(s) for s in query_lens if s <= self.max_query_len})
        kinds = [("main", 0)] + [("mtp", m) for m in range(mtp_modules)]
        fused = self.greedy_rounds and mtp_modules == 1 and any(s >= 2 for s in query_lens)
        batches = sorted({bucket(b) for b in batch_sizes})
        if self.dynamic:  # one package per kind covers every shape (k = 1 rounds: one too)
            return [GraphKey.dynamic_package(kind, module) for kind, module in kinds] + (
                [GraphKey.dynamic_package("round", 0)] if fused else [])
        rare = len(queries) > 1  # speculating: a 1-token main forward is the exception
        keys = []
        for nb in nbs:
            for B in batches:
                if fused:
                    keys.append(GraphKey("round", 0, B, 2, nb))
                keys += [GraphKey(kind, module, B, S, nb) for kind, module in kinds
                         for S in sorted(queries, reverse=True)
                         if not (rare and kind == "main" and S == 1)]
            if rare:
                keys += [GraphKey("main", 0, B, 1, nb) for B in batches]
        return keys

    def plan(self, keys: list[GraphKey]) -> None:
        """Count `keys` (a warm-up's buckets, in its order) in the compile progress."""
        import time

        if self.started_at is None:
            self.started_at = time.time()
        have = set(self.planned)
        self.planned += [k for k in keys if k not in have]

    def warm_bucket(self, key: GraphKey | None) -> None:
        """One step of a warm-up another rank paces: build and run `key`, or (None) finish:
        from now on a bucket not built runs eagerly."""
        import time

        if key is None:
            self.warmed = True
            return
        t0, built = time.time(), self.aot.compiled if self.aot is not None else None
        self.run(*self.example_inputs(key))
        t1 = time.time()
        if key not in self.ready_at:
            if built is None or self.aot.compiled > built:  # compiled here, not loaded
                self.compile_seconds.append(t1 - t0)
            self.ready_at[key] = t1
