"""Counter-based randomness: every uniform a request uses is a pure function of
(request seed, absolute token position, draw slot).

Nothing is consumed from a stream, so a request's numbers do not depend on what it is batched
with, on how many numbers a verify round of another shape would draw, on TP, or on which
replica (prefill, decode, or a replica it migrated to) makes the draw. Each (position, slot)
pair is used at most once per request: a position is decided finally once (`SLOT_FINAL`), and a
round that starts at n drafts and tests position n + i only at depth i, with n strictly
increasing between rounds. So every draw is fresh, which rejection sampling needs to stay exact.

The hash is splitmix64 applied as a chain over the key words, in int64 torch ops (wrapping
multiplication; logical shifts emulated with a mask), vectorised over rows.
"""

from __future__ import annotations

import torch

# Draw slots. Depth i (1-based) of a draft adds i, so slots never collide for k <= 64.
SLOT_FINAL = 0  # first token, plain (k = 0) sample, recovered or bonus token
SLOT_DRAFT = 64  # + depth: sampling the draft for this position from q
SLOT_ACCEPT = 128  # + depth: the acceptance test of that draft
MAX_DEPTH = 63


def _signed(x: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def fold_seed(seed: int) -> int:
    """Any Python int (API seeds are unbounded, may be negative) as an int64 key."""
    return _signed(seed % (1 << 64))


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser over int64 tensors (bit-exact with the uint64 reference)."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def keyed_uniforms(
    seeds: torch.Tensor,  # [...] int64
    positions: torch.Tensor,  # [...] int64, broadcastable with seeds
    slots: torch.Tensor | int,  # [...] or one slot for all
) -> torch.Tensor:
    """Uniforms in (0, 1), float64, one per broadcast element of (seed, position, slot)."""
    h = _mix(seeds.to(torch.int64))
    h = _mix(h ^ positions.to(torch.int64))
    # An int slot stays a Python scalar: a 0-d tensor made on the device would be a copy.
    h = _mix(h ^ (slots.to(torch.int64) if isinstance(slots, torch.Tensor) else slots))
    # Top 53 bits -> (0, 1): never exactly 0 or 1, so u * x < y tests stay strict.
    return (_shr(h, 11).to(torch.float64) + 0.5) * (1.0 / (1 << 53))


def uniforms_for(
    seeds: list[int], positions: list[int], slot: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[N] uniforms for row i at (seeds[i], positions[i], slot)."""
    from mtpserve.workers.model.attention_metadata import stage_lists

    s, p = stage_lists([seeds, positions], device)
    return keyed_uniforms(s, p, slot)
