"""The control plane of a TP group: commands from rank 0 to every rank over a gloo (CPU) group.

A TP replica has two process groups (docs/architecture.md decision 10, vLLM's `cpu_group` /
`device_group`): this *control* group carries commands, flags and decisions as CPU tensors; the
*data* group (NCCL on GPUs, gloo on CPU) carries only the model's activations on the engine's
device. Every forward's `ForwardBatch` travels as one int64 tensor (`encode_batch`): a fixed
header broadcast that holds small batches inline, plus one payload broadcast for large ones.
Pickling is kept for rare per-request commands (KV hold, pull, release).
"""

from __future__ import annotations

import dataclasses
import pickle
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist

from mtpserve.workers.model_runner import ForwardBatch

# Opcodes (header[0]).
OP_FORWARD, OP_OBJECT, OP_PING, OP_POLL, OP_SHUTDOWN = 1, 2, 3, 4, 5
HEADER_SLOTS = 512  # int64s per header broadcast: 4 KiB, room for a typical decode batch
_INLINE = HEADER_SLOTS - 2
_KINDS = {"main": 0, "mtp": 1}
_HIDDEN = {None: 0, "main": 1, "mtp": 2}


# Every field of ForwardBatch must travel: a field added there and not here would let ranks
# run different forwards, so the encoder refuses to run until it is taught the new field.
_ENCODED_FIELDS = ("kind", "input_ids", "start_positions", "block_tables", "logit_rows",
                   "module", "hidden_from", "hidden_rows", "state_slots", "device_ids")
# Fields a TP group never sees set: the driver asks for host ids (`accepts_device_ids` is
# False), so these stay on one process.
_LOCAL_ONLY = ("device_ids",)


def encode_batch(b: ForwardBatch) -> list[int]:
    """A ForwardBatch as a flat int list: fields, per-row lengths, then the row contents."""
    assert tuple(f.name for f in dataclasses.fields(b)) == _ENCODED_FIELDS, (
        "ForwardBatch changed: teach workers/replica/control_plane.py its new fields")
    assert all(getattr(b, name) is None for name in _LOCAL_ONLY), (
        "a TP forward with single-process fields set")
    B = len(b.input_ids)
    has_hidden = 1 if b.hidden_rows else 0
    has_slots = 1 if b.state_slots is not None else 0  # hybrid models: a state slot per row
    out = [_KINDS[b.kind], b.module, _HIDDEN[b.hidden_from], B, len(b.logit_rows), has_hidden,
           has_slots]
    for i in range(B):
        out += [len(b.input_ids[i]), len(b.block_tables[i]),
                len(b.hidden_rows[i]) if has_hidden else 0]
    out += b.start_positions
    out += b.logit_rows
    out += chain.from_iterable(b.input_ids)
    out += chain.from_iterable(b.block_tables)
    if has_hidden:
        out += chain.from_iterable(b.hidden_rows)
    if has_slots:
        out += b.state_slots
    return out


def decode_batch(x: list[int]) -> ForwardBatch:
    kind, module, hidden, B, n_logits, has_hidden, has_slots = x[:7]
    lens = x[7 : 7 + 3 * B]
    pos = 7 + 3 * B

    def take(n: int) -> list[int]:
        nonlocal pos
        pos += n
        return x[pos - n : pos]

    starts = take(B)
    logit_rows = take(n_logits)
    input_ids = [take(lens[3 * i]) for i in range(B)]
    block_tables = [take(lens[3 * i + 1]) for i in range(B)]
    hidden_rows = [take(lens[3 * i + 2]) for i in range(B)] if has_hidden else []
    state_slots = take(B) if has_slots else None
    assert pos == len(x), "malformed ForwardBatch encoding"
    return ForwardBatch(
        kind=[k for k, v in _KINDS.items() if v == kind][0], input_ids=input_ids,
        start_positions=starts, block_tables=block_tables, logit_rows=logit_rows,
        module=module, hidden_from=[k for k, v in _HIDDEN.items() if v == hidden][0],
        hidden_rows=hidden_rows, state_slots=state_slots,
    )


class ControlPlane:
    """Rank 0 sends commands, ranks >= 1 receive them; all over the gloo control group.

    Only CPU tensors ever touch `group`; the header buffer is reused for every command.
    Collective: every rank must call `send_*` (rank 0) / `recv` (others) in the same order.
    """

    def __init__(self, group: Any, rank: int) -> None:
        self.group = group
        self.rank = rank
        self._header = torch.zeros(HEADER_SLOTS, dtype=torch.long)  # [HEADER_SLOTS] CPU

    # rank 0 ----------------------------------------------------------------------------------
    def send_forward(self, batch: ForwardBatch) -> None:
        self._send(OP_FORWARD, encode_batch(batch))

    def send_object(self, obj: Any) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)  # [n]
        self._header[0], self._header[1] = OP_OBJECT, data.numel()
        dist.broadcast(self._header, src=0, group=self.group)
        dist.broadcast(data, src=0, group=self.group)

    def send_op(self, op: int, arg: int = 0) -> None:
        self._send(op, [arg])

    def _send(self, op: int, payload: list[int]) -> None:
        h = self._header
        h[0], h[1] = op, len(payload)
        if len(payload) <= _INLINE:
            h[2 : 2 + len(payload)] = torch.tensor(payload, dtype=torch.long)
            dist.broadcast(h, src=0, group=self.group)
            return
        dist.broadcast(h, src=0, group=self.group)
        dist.broadcast(torch.tensor(payload, dtype=torch.long), src=0, group=self.group)

    # ranks >= 1 ------------------------------------------------------------------------------
    def recv(self) -> tuple[int, Any]:
        """(opcode, argument): a ForwardBatch, an unpickled object or an int."""
        h = self._header
        dist.broadcast(h, src=0, group=self.group)
        op, n = int(h[0]), int(h[1])
        if op == OP_OBJECT:
            data = torch.empty(n, dtype=torch.uint8)
            dist.broadcast(data, src=0, group=self.group)
            return op, pickle.loads(data.numpy().tobytes())
        if n <= _INLINE:
            payload = h[2 : 2 + n].tolist()
        else:
            buf = torch.empty(n, dtype=torch.long)
            dist.broadcast(buf, src=0, group=self.group)
            payload = buf.tolist()
        if op == OP_FORWARD:
            return op, decode_batch(payload)
        return op, payload[0] if payload else 0

    # every rank ------------------------------------------------------------------------------
    def all_reduce_max(self, flags: list[int]) -> list[int]:
        """Element-wise max of every rank's int flags (same length on every rank)."""
        t = torch.tensor(flags, dtype=torch.long)
        if t.numel():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()
