"""Runs forwards of the main model and the MTP modules over the paged KV cache.

The engine (TP rank 0) describes each forward as a `ForwardBatch` of plain lists; every TP
rank executes the same batch, so in a TP group rank 0 only broadcasts the batch. Hidden states
that the next forward consumes (main hidden -> MTP, MTP hidden -> next draft step) stay on each
rank and are selected by row indices, never shipped.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from mtpserve.workers.engine_config import compile_enabled, resolve_attention_backend
from mtpserve.workers.kv_cache import KVCache
from mtpserve.workers.model.attention_metadata import AttentionMetadata
from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.cuda_graphs import CUDAGraphs
from mtpserve.workers.model.decode_graph import DecodeGraphs, GraphInputs, GraphKey
from mtpserve.workers.model.loader import load_model
from mtpserve.workers.model.parallel import get_tp
from mtpserve.workers.spec_decode.draft_vocab import draft_token_ids


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


class ModelRunner:
    """The `Runner` of one process: the model (or its TP shard), its paged KV cache and, when
    compiled, the decode graphs."""

    def __init__(
        self,
        model_path: str | Path,
        num_blocks: int,
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
        attention_backend: str = "auto",
        cuda_graphs: bool | None = None,
        num_state_slots: int = 64,
    ) -> None:
        self.device = torch.device(device)
        self.model = load_model(model_path, dtype=dtype, device=self.device)
        # Eager forwards and compiled graphs both read it (workers/model/attention_metadata).
        self.attention_backend = resolve_attention_backend(attention_backend, self.device.type)
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
        self.block_size = block_size
        self.kv_cache = KVCache(self.config, num_blocks, block_size, dtype, self.device)
        # Hidden states of the last forward of each kind: (flat [rows, hidden], S, Sp), rows
        # laid out b * Sp + s (Sp = the graph bucket's query length, S the batch's).
        self._hidden: dict[str, tuple[torch.Tensor, int, int]] = {}
        # Hybrid models: one recurrent-state slot per running request (the engine hands them
        # out); forwards run eagerly (the compiled graphs know no states).
        self.state_cache = None
        if self.config.is_hybrid:
            from mtpserve.workers.state_pool import StateCache

            self.state_cache = StateCache(self.config, num_state_slots, dtype, self.device)
            decode_graphs = greedy_rounds = cuda_graphs = False
        self._linear_states: dict = {}  # the last main forward's LinearState per layer
        if decode_graphs is None:  # the engine's default (compile: auto), env overrides
            decode_graphs = compile_enabled("auto", self.device.type, get_tp().size)
        # TP > 1 compiles only with shared-memory collectives (custom ops inside the graph).
        tp = get_tp()
        if greedy_rounds is None:
            greedy_rounds = os.environ.get("MTPSERVE_GREEDY_ROUNDS", "0") == "1"
        self.graphs = (DecodeGraphs(self.model, self.kv_cache, cpp_wrapper=cpp_wrapper,
                                    greedy_rounds=greedy_rounds, cache_dir=compile_cache_dir,
                                    ahead_of_time=compile_ahead_of_time)
                       if decode_graphs and (tp.size == 1 or tp.shm is not None) else None)
        # CUDA: every bucket warm-up compiles is also captured as a CUDA graph and replayed
        # (workers/model/cuda_graphs.py); None on CPU, where nothing changes.
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        self.cuda_graphs = (CUDAGraphs(self.graphs) if cuda_graphs and self.graphs is not None
                            and self.device.type == "cuda" else None)

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
            captured = self.cuda_graphs.capture_pending()
            if log and captured:
                log(f"captured {captured} CUDA graph(s)")
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
        room_t = torch.tensor(room + [0] * (key.batch - len(room)), dtype=torch.long,
                              device=self.device)
        accepted, bonus, drafts = self._run_graph(inp, room_t)
        n = len(input_ids)
        rows = torch.cat([accepted[:n, None], bonus[:n, None], drafts[:n]], 1).tolist()
        return ([r[0] for r in rows], [r[1] for r in rows], [r[2:] for r in rows])

    def _prev_hidden(self, batch: ForwardBatch, Sp: int, Bp: int) -> torch.Tensor:
        """[Bp, Sp, hidden] rows of the previous forward named by `hidden_rows` (0-padded)."""
        src, S_prev, Sp_prev = self._hidden[batch.hidden_from or "main"]
        rows = [[(r // S_prev) * Sp_prev + r % S_prev for r in row] for row in batch.hidden_rows]
        rows += [[]] * (Bp - len(rows))
        idx = torch.tensor(pad_rows(rows, Sp), dtype=torch.long)
        return src[idx.to(self.device)]

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
                                      batch.block_tables, batch.logit_rows)
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

    @torch.inference_mode()
    def keep_states(self, rows: list[int], positions: list[int]) -> None:
        """Hybrid models, after a verify forward: row `rows[j]` of the last main forward keeps
        the recurrent state after its `positions[j]`-th token (its last accepted one) instead
        of after its last token; nothing is recomputed (the forward kept every position's)."""
        if not rows or not self._linear_states:
            return
        r, p = torch.tensor([rows, positions], dtype=torch.long).to(self.device)
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
        attn = AttentionMetadata.build(positions, lens, batch.block_tables, self.block_size,
                                       self.device, self.attention_backend)
        ids, positions = ids.to(self.device), positions.to(self.device)
        caches = self.kv_cache.buffers
        if self.state_cache is not None and batch.kind == "main":
            caches = list(caches)
            slots = batch.state_slots or [self.state_cache.scratch_slot]
            assert len(slots) == B and len(set(slots)) == B, "one row per state slot"
            host = torch.tensor([slots, batch.start_positions, lens], dtype=torch.long)
            d_slots, d_starts, d_lens = host.to(self.device)
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
        sel = flat[torch.tensor(batch.logit_rows, dtype=torch.long, device=self.device)]
        if batch.kind == "main":
            logits = self.model.compute_logits(sel)
        else:
            logits = self.model.compute_mtp_logits(batch.module, sel)
        return logits
