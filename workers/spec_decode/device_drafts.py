"""Drafts that stay on the device between speculative rounds.

The draft chain (`MTPProposer`) ends with its drafts in one device matrix [n, k_max] (row i:
request i of the chain, 0 past its own count). The next round needs them on the device only:
they are the verify forward's input ids (`ForwardBatch.device_ids`) and the rejection
sampler's drafts. So the host learns their values with that round's accepted ids, in the
round's one copy (`RoundOutcomes.verify`), instead of in a copy of their own after the chain.

A request holds a `DraftRow` (which matrix, which row, how many drafts) in
`Request.device_drafts`. Reading `Request.draft_token_ids` copies the whole matrix to the host
once for every request of the chain (`DeviceDrafts.resolve`): that is for readers off the hot
path (a prefill replica shipping drafts, grammar matchers, a TP group whose ranks take host
batches, the fused greedy round after a step-by-step one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mtpserve.workers.host_sync import to_host
from mtpserve.workers.model.attention_metadata import stage_lists


@dataclass(eq=False)
class DeviceDrafts:
    """The drafts of one chain: `matrix` [n, k_max] long on the device."""

    matrix: torch.Tensor
    rows: list[DraftRow] = field(default_factory=list)

    def resolve(self) -> None:
        """Every request still holding a row of this chain gets its drafts on the host."""
        (values,) = to_host([self.matrix], "drafts")
        rows, self.rows = self.rows, []
        for row in rows:
            if row.request.device_drafts is row:  # not replaced, preempted or truncated
                row.request.draft_token_ids = values[row.index][: row.count]


@dataclass(eq=False)
class DraftRow:
    """Request `request`'s drafts: the first `count` of row `index` of `drafts.matrix`."""

    drafts: DeviceDrafts
    request: Any  # workers.request.Request
    index: int
    count: int

    def resolve(self) -> None:
        self.drafts.resolve()

    def truncated(self, count: int) -> DraftRow:
        """The same row with at most `count` drafts (the request's room shrank)."""
        row = DraftRow(self.drafts, self.request, self.index, min(count, self.count))
        self.drafts.rows.append(row)
        return row


def attach(reqs: list[Any], matrix: torch.Tensor, counts: list[int]) -> None:
    """Request i's drafts are the first counts[i] entries of matrix row i (on the device)."""
    chain = DeviceDrafts(matrix)
    for i, (r, n) in enumerate(zip(reqs, counts, strict=True)):
        row = DraftRow(chain, r, i, n)
        chain.rows.append(row)
        r.draft_token_ids = []  # the host copy is gone; the setter clears device_drafts
        r.device_drafts = row


def truncate(r: Any, n: int) -> None:
    """Keep at most `n` drafts of request `r` (and their q), wherever they are."""
    if r.num_drafts <= n:
        return
    if r.device_drafts is not None:
        r.device_drafts = r.device_drafts.truncated(n)
    else:
        r.draft_token_ids = r.draft_token_ids[:n]
    if r.draft_probs is not None:
        r.draft_probs = r.draft_probs[:n]


def verify_inputs(reqs: list[Any], K: int, device: torch.device) -> torch.Tensor:
    """[R, 1 + K] long on `device`: row b = request b's last token, then its drafts, 0 past
    its count (padding: any valid id; the sampler masks past each row's count). Host rows
    travel in one staged copy; device rows are copied in on the device (no host sync)."""
    R = len(reqs)
    host: list[int] = []
    groups: dict[int, tuple[DeviceDrafts, list[int], list[int]]] = {}
    for b, r in enumerate(reqs):
        d = r.device_drafts
        drafts = [] if d is not None else r.draft_token_ids
        host += [r.output_token_ids[-1], *drafts] + [0] * (K - len(drafts))
        if d is not None:
            g = groups.setdefault(id(d.drafts), (d.drafts, [], []))
            g[1].append(b)
            g[2].append(d.index)
    index_lists = [x for g in groups.values() for x in (g[1], g[2])]
    staged = stage_lists([host, *index_lists], device)
    out = staged[0].view(R, 1 + K)
    for j, (chain, dst, src) in enumerate(groups.values()):
        kk = min(K, chain.matrix.shape[1])
        if kk == 0:
            continue
        if dst == src == list(range(R)) and chain.matrix.shape[0] == R:
            out[:, 1: 1 + kk] = chain.matrix[:, :kk]  # the steady state: the whole chain
        else:
            d_dst, d_src = staged[1 + 2 * j], staged[2 + 2 * j]
            out[d_dst, 1: 1 + kk] = chain.matrix[d_src, :kk]
    return out
