"""Runs forwards of the main model and the MTP modules over the paged KV cache.

The engine (TP rank 0) describes each forward as a `ForwardBatch` of plain lists; every TP
rank executes the same batch, so in a TP group rank 0 only broadcasts the batch. Hidden states
that the next forward consumes (main hidden -> MTP, MTP hidden -> next draft step) stay on each
rank and are selected by row indices, never shipped.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from mtpserve.workers import graph_memory
from mtpserve.workers.device import runtime
from mtpserve.workers.engine_config import (
    DEFAULT_NUM_KV_BLOCKS,
    KVMemoryBudget,
    compile_enabled,
    kv_blocks_for_memory,
    resolve_attention_backend,
)
from mtpserve.workers.host_sync import to_host
from mtpserve.workers.kv_cache import KVCache
from mtpserve.workers.model import bf16_weights, compile_progress, cpu_paged_attention
from mtpserve.workers.model.attention_metadata import AttentionMetadata, stage, stage_lists
from mtpserve.workers.model.background_compile import BackgroundCompile
from mtpserve.workers.model.compile_cache import default_cache_dir
from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.cuda_graphs import CUDAGraphs
from mtpserve.workers.model.decode_graph import DecodeGraphs, GraphInputs, GraphKey
from mtpserve.workers.model.loader import load_model
from mtpserve.workers.model.parallel import get_tp
from mtpserve.workers.spec_decode.draft_vocab import draft_token_ids

logger = logging.getLogger(__name__)


@dataclass
class ForwardBatch:
    """One padded forward. Row b holds `input_ids[b]` at positions start_positions[b]...

    `hidden_rows[b][s]` (MTP only) indexes the flattened [B_prev * S_prev] hidden states of
    the previous forward of kind `hidden_from`. `logit_rows` lists the flat (b * S + s) rows
    whose logits are returned.
    """

    kind: str  # "main" | "mtp"
    input_ids: list[list[int]]
    start_positions: list[int]
    block_tables: list[list[int]]
    logit_rows: list[int]
    module: int = 0
    hidden_from: str | None = None  # "main" | "mtp"
    hidden_rows: list[list[int]] = field(default_factory=list)
    # Hybrid models, main forwards: each row's state slot (workers/state_pool.py); None: the
    # scratch slot (one row only).
    state_slots: list[int] | None = None
    # [B', S'] ids already on the model's device (a draft step's argmax, a round's verify
    # rows): they overwrite the first S' columns of the first B' rows of `input_ids`, which
    # then only need the right row lengths. Lets drafts feed the next forward without a
    # device -> host round trip.
    device_ids: torch.Tensor | None = None


def pad_rows(rows: list[list[int]], width: int, value: int = 0) -> list[list[int]]:
    """Right-pad ragged rows so the batch becomes one tensor in one allocation."""
    return [r + [value] * (width - len(r)) for r in rows]


def column_major_linears(model: torch.nn.Module) -> None:
    """Store every linear weight [out, in] column-major (same values and shape).

    `F.linear` computes x @ W.T; with W.T contiguous, the CPU GEMV streams the weight in
    order, which is ~20% faster for the memory-bound single-token decode. Embeddings keep
    row-major storage (their lookups read rows)."""
    from mtpserve.workers.model.parallel import (
        ColumnParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    for mod in model.modules():
        if isinstance(mod, ColumnParallelLinear | RowParallelLinear | ReplicatedLinear):
            mod.weight.data = mod.weight.data.t().contiguous().t()


# Kept for the CUDA graphs captured after the KV pool exists (their pool holds each bucket's
# intermediates) on a first start; later starts reserve what was measured
# (workers/graph_memory.py).
DEFAULT_GRAPH_RESERVE = graph_memory.DEFAULT_GRAPH_RESERVE


class DeviceMemory(Protocol):
    """What KV sizing reads from a device's allocator (`ModelRunner.size_kv_pool`)."""

    def info(self) -> tuple[int, int]: ...  # (free, total) bytes of the device
    def allocated(self) -> int: ...  # bytes in live tensors
    def reset_peak(self) -> None: ...
    def peak(self) -> int: ...  # most bytes in live tensors since reset_peak
    def empty_cache(self) -> None: ...  # synchronise, return cached blocks


class CUDAMemory:
    """`DeviceMemory` of one CUDA device (torch's caching allocator)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def info(self) -> tuple[int, int]:
        return runtime().mem_get_info(self.device)

    def allocated(self) -> int:
        return runtime().memory_allocated(self.device)

    def reset_peak(self) -> None:
        runtime().reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        runtime().synchronize(self.device)
        return runtime().max_memory_allocated(self.device)

    def empty_cache(self) -> None:
        runtime().synchronize(self.device)
        runtime().empty_cache()


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block of this rank over every attention layer (main and MTP): K and
    V (or MLA's latent) of `block_size` tokens, the layout `KVCache` allocates."""
    kv_heads, head_dim = cfg.kv_cache_layout(get_tp().size)
    elem = torch.empty((), dtype=dtype).element_size()
    kv_layers = cfg.num_attention_layers - len(cfg.linear_layers)  # linear: a state, no KV
    return 2 * block_size * kv_heads * head_dim * elem * kv_layers


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


@runtime_checkable
class Runner(Protocol):
    """What the engine drives: `ModelRunner` in one process, `TPDriver`
    (workers/replica/tp_group.py)
    for a TP group, which mirrors each call to every rank. Both implement all of it, so a
    capability (graphs, warm-up, fused rounds) cannot vanish when serving
    (tests/test_compile_default.py enumerates this protocol on both)."""

    config: ModelConfig
    kv_cache: KVCache

    def execute(self, batch: ForwardBatch) -> torch.Tensor: ...

    def warmup_graphs(self, batch_sizes: list[int], query_lens: list[int], max_context: int,
                      mtp_modules: int | None = None, budget_s: float | None = None,
                      log: Callable[[str], None] | None = None,
                      cached_only: bool = False,
                      restart_budget_s: float | None = None,
                      run_bucket: Callable[[GraphKey], None] | None = None) -> int: ...

    @property
    def fuses_greedy_rounds(self) -> bool: ...

    def greedy_round(self, input_ids: list[list[int]], starts: list[int],
                     tables: list[list[int]], room: list[int]
                     ) -> tuple[list[int], list[int], list[list[int]]] | None: ...

    def keep_states(self, rows: list[int], positions: list[int]) -> None: ...

    def compile_in_background(self, batch_sizes: list[int], query_lens: list[int],
                              max_context: int, mtp_modules: int | None = None) -> int: ...

    def adopt_compiled(self) -> int: ...

    def compile_progress(self) -> dict | None: ...


class ModelRunner:
    """The `Runner` of one process: the model (or its TP shard), its paged KV cache and, when
    compiled, the decode graphs."""

    accepts_device_ids = True  # ForwardBatch.device_ids (see MTPProposer.device_feed)

    def __init__(
        self,
        model_path: str | Path,
        num_blocks: int | None,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        decode_graphs: bool | None = None,
        mtp_dtype: torch.dtype | None = None,
        draft_vocab_size: int | None = None,
        cpp_wrapper: bool = True,
        greedy_rounds: bool | None = None,
        compile_cache_dir: str | Path | None = None,
        compile_ahead_of_time: bool = True,
        dynamic_graphs: bool = True,
        attention_backend: str = "auto",
        cuda_graphs: bool | None = None,
        num_state_slots: int = 64,
        kv_cache_memory_fraction: float = 0.9,
        profile_tokens: int = 512,
        graph_reserve_bytes: int | None = None,
        staging_bytes: int = 0,
        num_speculative_tokens: int | None = None,
    ) -> None:
        """`num_blocks` None: off CUDA the default pool; on CUDA sized so the whole process
        stays within `kv_cache_memory_fraction` of the device (`size_kv_pool`), with
        `profile_tokens` the largest forward (max_num_batched_tokens), `graph_reserve_bytes`
        kept for the CUDA graphs captured later and `staging_bytes` for KV-transfer staging
        on the device. Hybrid models: `num_state_slots` (the engine's max_num_seqs) state
        slots and verify buffers for that many rows of `num_speculative_tokens` (the engine's
        k; None: the most a hybrid verifies, RECURRENT_MAX - 1) drafts (workers/state_pool.py),
        both counted by the KV sizing."""
        # What a background compiler needs to build the same runner (background_compile.py).
        self._runner_args: dict = dict(
            model_path=str(model_path), block_size=block_size, dtype=_dtype_name(dtype),
            device=str(device), mtp_dtype=_dtype_name(mtp_dtype),
            draft_vocab_size=draft_vocab_size, cpp_wrapper=cpp_wrapper,
            compile_cache_dir=None if compile_cache_dir is None else str(compile_cache_dir),
            attention_backend=attention_backend, num_state_slots=num_state_slots,
            decode_graphs=True, cuda_graphs=False, dynamic_graphs=dynamic_graphs)
        self.background: BackgroundCompile | None = None
        self.device = torch.device(device)
        self.model = load_model(model_path, dtype=dtype, device=self.device)
        # Eager forwards and compiled graphs both read it (workers/model/attention_metadata).
        self.attention_backend = resolve_attention_backend(attention_backend, self.device.type)
        if self.attention_backend == "flex" and any(
                s.sliding_window or s.attention_sinks for s in self.model.config.layers):
            logger.info("sliding-window or sink layers: the gather attention backend (flex's "
                        "paged mask has no window, its softmax no sink)")
            self.attention_backend = "gather"
        self.model.attention_backend = self.attention_backend
        if self.device.type == "cpu":
            column_major_linears(self.model)
        self.config = self.model.config
        if draft_vocab_size is not None and self.config.num_mtp_modules:
            self.model.restrict_draft_vocab(draft_token_ids(
                model_path, draft_vocab_size, self.config.vocab_size,
                always=self.config.eos_token_ids))
        if mtp_dtype is not None and mtp_dtype != dtype:
            self.model.lower_mtp_precision(mtp_dtype)
        # Weights a bf16 checkpoint holds, streamed at half the bytes (bf16_weights.py).
        self.bf16_weight_linears = (bf16_weights.pack_linears(self.model)
                                    if self.device.type == "cpu" and dtype == torch.float32
                                    else 0)
        if self.device.type == "cpu":  # cached graphs that call it load only once it is there
            cpu_paged_attention.available()
        self.block_size = block_size
        # Hidden states of the last forward of each kind: (flat [rows, hidden], S, Sp), rows
        # laid out b * Sp + s (Sp = the graph bucket's query length, S the batch's).
        self._hidden: dict[str, tuple[torch.Tensor, int, int]] = {}
        # Hybrid models: one recurrent-state slot per running request (the engine hands them
        # out); forwards run eagerly (the compiled graphs know no states). Allocated before
        # the KV pool is sized, which counts it like staging memory.
        self.state_cache = None
        self._linear_states: dict = {}  # the last main forward's LinearState per layer
        if self.config.is_hybrid:
            from mtpserve.workers.model.gated_deltanet import RECURRENT_MAX
            from mtpserve.workers.state_pool import StateCache

            if num_speculative_tokens is None:
                num_speculative_tokens = RECURRENT_MAX - 1
            self.state_cache = StateCache(self.config, num_state_slots, dtype, self.device,
                                          num_speculative_tokens)
            decode_graphs = greedy_rounds = cuda_graphs = False
        if self.config.mla is not None and self.config.mla.dsa is not None:
            # DSA's top-k over the live context length is not in the graphs yet: eager.
            decode_graphs = greedy_rounds = cuda_graphs = False
            from mtpserve.workers.model.dsa import sparse_attention_backend

            logger.info("DSA sparse attention: %s (%s); decode graphs off",
                        *sparse_attention_backend(self.device.type))
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        self.kv_budget: KVMemoryBudget | None = None
        # CUDA graphs' memory: measured at each capture (warmup_graphs), recorded next to the
        # compiled graphs and reserved from it by the next start's KV sizing.
        self.graph_memory_bytes = 0
        self._graph_record = self._graph_key = None
        if cuda_graphs and self.device.type == "cuda":
            self._graph_record = graph_memory.GraphMemoryRecord(
                default_cache_dir() if compile_cache_dir is None else compile_cache_dir)
            self._graph_key = graph_memory.record_key(
                model_path, dtype, block_size, self.attention_backend, get_tp().size,
                get_tp().rank, runtime().name(self.device), torch.__version__)
        if graph_reserve_bytes is None:
            graph_reserve_bytes = (self._graph_record.reserve(self._graph_key)
                                   if self._graph_record is not None else 0)
        self.graph_reserve_bytes = graph_reserve_bytes
        if num_blocks is None:
            if self.device.type == "cuda":
                num_blocks = self.size_kv_pool(kv_cache_memory_fraction, dtype,
                                               profile_tokens, graph_reserve_bytes,
                                               staging_bytes)
            else:
                num_blocks = DEFAULT_NUM_KV_BLOCKS
        self.kv_cache = KVCache(self.config, num_blocks, block_size, dtype, self.device)
        if decode_graphs is None:  # the engine's default (compile: auto), env overrides
            decode_graphs = compile_enabled("auto", self.device.type, get_tp().size)
        # TP > 1 compiles only with shared-memory collectives (custom ops inside the graph).
        tp = get_tp()
        if greedy_rounds is None:
            greedy_rounds = os.environ.get("MTPSERVE_GREEDY_ROUNDS", "0") == "1"
        self._runner_args.update(num_blocks=self.kv_cache.num_blocks,
                                 greedy_rounds=bool(greedy_rounds))
        self.graphs = (DecodeGraphs(self.model, self.kv_cache, cpp_wrapper=cpp_wrapper,
                                    greedy_rounds=greedy_rounds, cache_dir=compile_cache_dir,
                                    ahead_of_time=compile_ahead_of_time,
                                    dynamic=dynamic_graphs)
                       if decode_graphs and (tp.size == 1 or tp.shm is not None) else None)
        # CUDA: every bucket warm-up compiles is also captured as a CUDA graph and replayed
        # (workers/model/cuda_graphs.py); None on CPU, where nothing changes.
        self.cuda_graphs = (CUDAGraphs(self.graphs) if cuda_graphs and self.graphs is not None
                            and self.device.type == "cuda" else None)

    @torch.inference_mode()
    def size_kv_pool(self, fraction: float, dtype: torch.dtype, profile_tokens: int,
                     graph_reserve_bytes: int, staging_bytes: int,
                     memory: DeviceMemory | None = None) -> int:
        """KV blocks that fit in `fraction` of the device once the loaded weights, a hybrid
        model's state pool (slots and verify buffers, allocated before: `StateCache.nbytes`),
        the peak of a profiled `profile_tokens`-token prefill (main + MTP, through a throwaway
        cache), the graph reserve and the staging buffers are accounted, within what the
        device has free (`kv_blocks_for_memory`). Records the budget in `self.kv_budget`.
        `memory`: how the device's memory is read (default: CUDA's allocator).

        The profile is one long row: it keeps no per-position states, so the verify states
        (max_num_seqs rows x k per linear layer) are reserved by formula, as the buffers the
        pool allocated (`state_pool.verify_state_bytes`), not measured."""
        mem = memory or CUDAMemory(self.device)
        mem.empty_cache()
        free, total = mem.info()  # the weights are loaded: free is what is left beside them
        weights = sum(t.numel() * t.element_size()
                      for t in (*self.model.parameters(), *self.model.buffers()))
        per_block = kv_bytes_per_block(self.config, self.block_size, dtype)
        # Profile: the largest prefill chunk through a cache just big enough for it.
        n_tok = max(1, profile_tokens)
        nb = -(-n_tok // self.block_size)
        self.kv_cache = KVCache(self.config, nb, self.block_size, dtype, self.device)
        base = mem.allocated()
        mem.reset_peak()
        ids = [[0] * n_tok]
        table = [list(range(nb))]
        self._execute_eager(ForwardBatch("main", ids, [0], table, [n_tok - 1]))
        if self.config.num_mtp_modules:
            self._execute_eager(ForwardBatch("mtp", ids, [0], table, [n_tok - 1],
                                             hidden_from="main",
                                             hidden_rows=[list(range(n_tok))]))
        activations = mem.peak() - base
        self._hidden.clear()
        del self.kv_cache
        mem.empty_cache()
        states = self.state_cache.nbytes if self.state_cache is not None else 0
        self.kv_budget = KVMemoryBudget(total=total, weights=weights, activations=activations,
                                        graphs=graph_reserve_bytes, staging=staging_bytes,
                                        free=free, states=states)
        blocks = kv_blocks_for_memory(self.kv_budget, fraction, per_block)
        tp = get_tp()
        if tp.size > 1:  # one block table serves every rank: the smallest pool of the group
            import torch.distributed as dist

            t = torch.tensor([blocks], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.group)
            blocks = int(t.item())
        return blocks

    @torch.inference_mode()
    def warmup_graphs(self, batch_sizes: list[int], query_lens: list[int], max_context: int,
                      mtp_modules: int | None = None, budget_s: float | None = None,
                      log: Callable[[str], None] | None = None,
                      cached_only: bool = False,
                      restart_budget_s: float | None = None,
                      run_bucket: Callable[[GraphKey], None] | None = None) -> int:
        """Compile the decode graphs these shapes can hit, likeliest first, within `budget_s`
        seconds (no-op without graphs); returns how many were compiled or loaded.
        `cached_only`: only load what the on-disk compile cache holds, compile nothing;
        `restart_budget_s`, `run_bucket`: see `DecodeGraphs.warmup`."""
        if self.graphs is None:
            return 0
        n = self.config.num_mtp_modules if mtp_modules is None else mtp_modules
        deadline = None if budget_s is None else time.monotonic() + budget_s
        done = self.graphs.warmup(batch_sizes, query_lens, max_context, n, log, deadline,
                                  cached_only, restart_budget_s, run_bucket)
        if self.cuda_graphs is not None:  # capturing costs milliseconds per bucket
            # Measured as reserved (not allocated) bytes: after capture the graphs' private
            # pool keeps their intermediates reserved though no tensor holds them.
            rt = runtime()
            rt.synchronize(self.device)
            before = rt.memory_reserved(self.device)
            captured = self.cuda_graphs.capture_pending()
            rt.synchronize(self.device)
            self.graph_memory_bytes += max(0, rt.memory_reserved(self.device) - before)
            if captured and self._graph_record is not None:
                self._graph_record.store(self._graph_key, self.graph_memory_bytes)
            if log and captured:
                log(f"captured {captured} CUDA graph(s): {self.graph_memory_bytes / 2**20:.0f} "
                    f"MiB of graph memory (reserved {self.graph_reserve_bytes / 2**20:.0f} MiB)")
        return done

    @property
    def fuses_greedy_rounds(self) -> bool:
        return self.graphs is not None and self.graphs.greedy_rounds

    @torch.inference_mode()
    def greedy_round(self, input_ids: list[list[int]], starts: list[int],
                     tables: list[list[int]], room: list[int]
                     ) -> tuple[list[int], list[int], list[list[int]]] | None:
        """A whole greedy round of k = len(input_ids[b]) - 1 drafts per row as one graph
        (workers.model.greedy_round): (accepted, bonus token, next drafts [k]) per row, or
        None when there is no such graph (then the engine runs the round step by step)."""
        g = self.graphs
        if g is None or not g.greedy_rounds:
            return None
        key = g.round_key(len(input_ids[0]) - 1, len(input_ids), tables)
        if key is None:
            return None
        inp = g.prepare(key, input_ids, starts, tables, [])
        (room_t,) = stage_lists([room + [0] * (key.batch - len(room))], self.device)
        accepted, bonus, drafts = self._run_graph(inp, room_t)
        n = len(input_ids)
        # The round's one host sync: its accepted ids, bonus tokens and next drafts.
        (rows,) = to_host([torch.cat([accepted[:n, None], bonus[:n, None], drafts[:n]], 1)],
                          "accepted ids")
        return ([r[0] for r in rows], [r[1] for r in rows], [r[2:] for r in rows])

    def _prev_hidden(self, batch: ForwardBatch, Sp: int, Bp: int) -> torch.Tensor:
        """[Bp, Sp, hidden] rows of the previous forward named by `hidden_rows` (0-padded)."""
        src, S_prev, Sp_prev = self._hidden[batch.hidden_from or "main"]
        rows = [[(r // S_prev) * Sp_prev + r % S_prev for r in row] for row in batch.hidden_rows]
        rows += [[]] * (Bp - len(rows))
        idx = torch.tensor(pad_rows(rows, Sp), dtype=torch.long)
        return src[stage([idx], self.device)[0]]

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one forward; returns float32 logits [len(logit_rows), V] on the model's
        device, valid until the next `execute` (a CUDA graph reuses its output buffer)."""
        key = None
        if self.graphs is not None:
            key = self.graphs.key_for(batch.kind, batch.module,
                                      [len(x) for x in batch.input_ids], batch.block_tables)
        if key is None:
            logits = self._execute_eager(batch)
        else:
            inp = self.graphs.prepare(key, batch.input_ids, batch.start_positions,
                                      batch.block_tables, batch.logit_rows, batch.device_ids)
            prev = None
            if batch.kind == "mtp":
                prev = self._prev_hidden(batch, key.query_len, key.batch)
            flat, logits = self._run_graph(inp, prev)
            S = max(len(x) for x in batch.input_ids)
            self._hidden[batch.kind] = (flat, S, key.query_len)
            logits = logits[: len(batch.logit_rows)]
        # Logits stay on the model's device: sampling, acceptance and drafting run there, and
        # only sampled ids (and requested logprob values) reach the host. On CUDA graphs they
        # are the bucket's static output: the caller consumes them before the next forward.
        return logits

    def compile_in_background(self, batch_sizes: list[int], query_lens: list[int],
                              max_context: int, mtp_modules: int | None = None) -> int:
        """Start compiling, in a child process, the buckets of these shapes that warm-up left
        to run eagerly (workers/model/background_compile.py); `adopt_compiled` picks them up.
        Returns how many it will compile (0: none left, or not here: no ahead-of-time cache,
        TP > 1, or one already running)."""
        g = self.graphs
        if g is None or g.aot is None or get_tp().size != 1 or self.background is not None:
            return 0
        n = self.config.num_mtp_modules if mtp_modules is None else mtp_modules
        pending = [k for k in g.warmup_keys(batch_sizes, query_lens, max_context, n)
                   if k not in g.compiled]
        if not pending:
            return 0
        self.background = BackgroundCompile(
            g, pending, self._runner_args,
            dict(batch_sizes=list(batch_sizes), query_lens=list(query_lens),
                 max_context=max_context, mtp_modules=n))
        return len(pending)

    @torch.inference_mode()
    def adopt_compiled(self) -> int:
        """Load what the background compiler finished (at most once a second); returns how
        many buckets it still has to compile (0: finished, or none was started)."""
        bg = self.background
        if bg is None:
            return 0
        bg.adopt()
        if bg.done:
            self.background = None
            return 0
        return len(bg.pending)

    def compile_progress(self) -> dict | None:
        """How far the decode graphs are: buckets covered, done, being compiled, ETA
        (workers/model/compile_progress.py); None without graphs or before a warm-up."""
        if self.graphs is None or not self.graphs.planned:
            return None
        return compile_progress.progress(self.graphs, self.background)

    @torch.inference_mode()
    def keep_states(self, rows: list[int], positions: list[int]) -> None:
        """Hybrid models, after a verify forward: row `rows[j]` of the last main forward keeps
        the recurrent state after its `positions[j]`-th token (its last accepted one) instead
        of after its last token; nothing is recomputed (the forward kept the states after
        each position but the last in the state pool's verify buffers)."""
        if not rows or not self._linear_states:
            return
        kept = min(st.kept for st in self._linear_states.values())
        if max(positions) >= kept:
            raise RuntimeError(
                f"keep_states at position {max(positions)}: the last main forward kept "
                f"{kept} positions (verify rows of at most k + 1 = "
                f"{self.state_cache.num_speculative_tokens + 1} tokens, max_num_seqs rows)")
        r, p = stage_lists([rows, positions], self.device)
        for st in self._linear_states.values():
            st.keep(r, p)

    def _run_graph(self, inp: GraphInputs, prev: torch.Tensor | None
                   ) -> tuple[torch.Tensor, ...]:
        """A compiled bucket: replayed as a CUDA graph when captured, else called."""
        if self.cuda_graphs is not None and inp.key in self.cuda_graphs:
            return self.cuda_graphs.replay(inp, prev)
        return self.graphs.run(inp, prev)

    def _execute_eager(self, batch: ForwardBatch) -> torch.Tensor:
        lens = [len(x) for x in batch.input_ids]
        B, S = len(lens), max(lens)
        ids = torch.tensor(pad_rows(batch.input_ids, S), dtype=torch.long)  # [B, S]
        starts = torch.tensor(batch.start_positions, dtype=torch.long).unsqueeze(1)
        positions = starts + torch.arange(S).unsqueeze(0)  # padding runs past; masked out
        positions = torch.minimum(positions, starts + torch.tensor(lens).unsqueeze(1) - 1)
        # Tables, slots, ids, positions and logit rows: one staged host -> device copy.
        attn = AttentionMetadata.build(
            positions, lens, batch.block_tables, self.block_size, self.device,
            self.attention_backend,
            ride_along=[ids, positions, torch.tensor(batch.logit_rows, dtype=torch.long)])
        ids, positions, logit_rows = attn.staged
        if batch.device_ids is not None:  # the first rows (a round's verify rows)
            d = batch.device_ids
            ids[: d.shape[0], : d.shape[1]] = d
        caches = self.kv_cache.buffers
        if self.state_cache is not None and batch.kind == "main":
            caches = list(caches)
            slots = batch.state_slots or [self.state_cache.scratch_slot]
            assert len(slots) == B and len(set(slots)) == B, "one row per state slot"
            d_slots, d_starts, d_lens = stage_lists([slots, batch.start_positions, lens],
                                                    self.device)
            self._linear_states = self.state_cache.views(d_slots, d_starts == 0, d_lens)
            for i, st in self._linear_states.items():
                caches[i] = st
        if batch.kind == "main":
            hidden = self.model(ids, positions, attn, caches)
        else:
            prev = self._prev_hidden(batch, S, B)  # [B, S, hidden]
            hidden = self.model.forward_mtp(batch.module, ids, prev, positions, attn, caches)
        flat = hidden.reshape(B * S, -1)
        self._hidden[batch.kind] = (flat, S, S)
        sel = flat[logit_rows]
        if batch.kind == "main":
            logits = self.model.compute_logits(sel)
        else:
            logits = self.model.compute_mtp_logits(batch.module, sel)
        return logits
