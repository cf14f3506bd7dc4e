"""CUDA-graph capture of the compiled decode buckets (CUDA only; CPU paths never build one).

Each bucket of `DecodeGraphs` already has fixed shapes and writes only through the KV cache
buffers, which never move. So a bucket is captured once at warm-up into a `torch.cuda.CUDAGraph`
over *static input buffers* (the bucket's padded ids, positions, slots, block tables, logit
rows and previous hidden states); serving copies a batch's inputs into them and replays. A
replay is one launch of every kernel of the forward: no dynamo guard evaluation, no wrapper
code, no per-kernel launch from Python (the ~40 us per call that a compiled graph still pays
on the host, and the launch gaps that dominate a small decode step on a GPU).

Why hand-made graphs rather than inductor's cudagraph mode (`mode="reduce-overhead"`, CUDA
graph trees), which fits fixed-shape buckets too:
- every bucket mutates its inputs in place (the KV cache buffers, passed as arguments);
  graph trees skip cudagraphs for mutated inputs that are not static parameters;
- graph trees own their outputs and invalidate them when another graph of the tree replays,
  while the runner keeps one forward's hidden states for the next (main -> MTP, draft step
  -> draft step) across replays of other buckets;
- here capture happens exactly for the buckets warm-up compiled, in the order vLLM uses
  (largest batch first, one shared memory pool), and nothing is captured inside a request.

Contract: a replay returns the bucket's static outputs; they stay valid until *the same
bucket* replays again (each graph keeps its outputs alive; the pool shares only memory the
graphs free). `ModelRunner` consumes a forward's logits before its next forward and copies
hidden states into the next bucket's static buffer before replaying it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpserve.workers.model.decode_graph import DecodeGraphs, GraphInputs, GraphKey


@dataclass
class StaticInputs:
    """A bucket's input buffers: allocated once (capture reads their addresses), then
    overwritten in place before every replay."""

    key: GraphKey
    ids: torch.Tensor  # [Bp, Sp]
    positions: torch.Tensor  # [Bp, Sp]
    slots: torch.Tensor  # [Bp * Sp]
    tables: torch.Tensor  # [Bp, NBp]
    logit_rows: torch.Tensor  # [Bp * Sp]
    prev: torch.Tensor | None  # mtp: [Bp, Sp, hidden]; round: room [Bp]; main: None

    @classmethod
    def like(cls, inp: GraphInputs, prev: torch.Tensor | None) -> StaticInputs:
        return cls(inp.key, inp.ids.clone(), inp.positions.clone(), inp.slots.clone(),
                   inp.tables.clone(), inp.logit_rows.clone(),
                   None if prev is None else prev.clone())

    def copy_from(self, inp: GraphInputs, prev: torch.Tensor | None) -> None:
        """Write a batch's bucket-padded inputs into the buffers (same shapes: same bucket)."""
        assert inp.key == self.key, f"inputs of {inp.key} for the graph of {self.key}"
        for dst, src in ((self.ids, inp.ids), (self.positions, inp.positions),
                         (self.slots, inp.slots), (self.tables, inp.tables),
                         (self.logit_rows, inp.logit_rows)):
            dst.copy_(src, non_blocking=True)
        if self.prev is not None:
            assert prev is not None and prev.shape == self.prev.shape, "previous hidden shape"
            self.prev.copy_(prev, non_blocking=True)  # casts to the captured dtype

    def as_inputs(self) -> GraphInputs:
        return GraphInputs(self.key, self.ids, self.positions, self.slots, self.tables,
                           self.logit_rows)


def example_inputs(graphs: DecodeGraphs, key: GraphKey) -> tuple[GraphInputs,
                                                                  torch.Tensor | None]:
    """Inputs of `key`'s shapes that write only the scratch block (what warm-up runs)."""
    return graphs.example_inputs(key)


def capture_order(keys: set[GraphKey]) -> list[GraphKey]:
    """Largest batch (then longest query, widest table) first: the later, smaller graphs
    then fit in memory the earlier ones freed into the shared pool."""
    return sorted(keys, key=lambda k: (-k.batch, -k.query_len, -k.num_blocks, k.kind,
                                       k.module))


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    static: StaticInputs
    outputs: tuple[torch.Tensor, ...]


class CUDAGraphs:
    """Captured replays of the compiled buckets of one `DecodeGraphs` (see module docstring).

    Mutates: the KV cache's scratch block during capture (as warm-up does)."""

    def __init__(self, graphs: DecodeGraphs) -> None:
        if graphs.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, not {graphs.device}")
        self.graphs = graphs
        self._captured: dict[GraphKey, _Captured] = {}
        self._pool = None  # one memory pool for every graph, made at the first capture

    def __contains__(self, key: object) -> bool:
        return key in self._captured

    @property
    def captured(self) -> set[GraphKey]:
        return set(self._captured)

    def pending(self) -> list[GraphKey]:
        """Buckets warm-up compiled that are not captured yet, in capture order."""
        return capture_order(self.graphs.compiled - set(self._captured))

    def capture_pending(self) -> int:
        """Capture every compiled bucket not captured yet; returns how many were captured."""
        keys = self.pending()
        for key in keys:
            self.capture(key)
        return len(keys)

    def capture(self, key: GraphKey) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        static = StaticInputs.like(*example_inputs(self.graphs, key))
        # One run on a side stream first: lazy initialisation (cuBLAS workspaces, first
        # kernel loads) must not happen inside the capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.graphs.run(static.as_inputs(), static.prev)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = tuple(self.graphs.run(static.as_inputs(), static.prev))
        self._captured[key] = _Captured(graph, static, outputs)

    def replay(self, inp: GraphInputs, prev: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, ...]:
        """The bucket's outputs for these inputs (static tensors: see the contract above)."""
        c = self._captured[inp.key]
        c.static.copy_from(inp, prev)
        c.graph.replay()
        return c.outputs
