"""Counter-based randomness: every uniform a request uses is a pure function of
(request seed, absolute token position, draw slot).

Nothing is consumed from a stream, so a request's numbers do not depend on what it is batched
with, on how many numbers a verify round of another shape would draw, on TP, or on which
replica (prefill, decode, or a replica it migrated to) makes the draw. Each (position, slot)
pair is used at most once per request: a position is decided finally once (`SLOT_FINAL`), and a
round that starts at n drafts and tests position n + i only at depth i, with n strictly
increasing between rounds. So every draw is fresh, which rejection sampling needs to stay exact.

The hash is splitmix64 applied as a chain over the key words. Every key word is known on the
host before a step runs (seeds, positions, slots; a verify round's final position depends on
its accepted count, so all k + 1 candidates are drawn), so the engine draws its uniforms on
the host (`uniform_table`: Python ints for a few draws, numpy uint64 past that) and stages
them with one copy. The torch version (`keyed_uniforms`, the same bits, kept as the
reference) runs ~45 tiny device ops per call, each a kernel launch on a GPU and ~2 us of
dispatch on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
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


_GOLDEN_U = np.uint64(0x9E3779B97F4A7C15)
_M1_U = np.uint64(0xBF58476D1CE4E5B9)
_M2_U = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = (np.uint64(s) for s in (30, 27, 31, 11))
_MASK = (1 << 64) - 1
# Below this many draws Python ints beat numpy (~1.3 us a draw against ~25 us a call).
_PY_MAX_DRAWS = 16


def _mix_host(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 arrays (numpy wraps uint64 arithmetic)."""
    z = z + _GOLDEN_U
    z = (z ^ (z >> _S30)) * _M1_U
    z = (z ^ (z >> _S27)) * _M2_U
    return z ^ (z >> _S31)


def _mix_int(z: int) -> int:
    """splitmix64's finaliser on a Python int (uint64)."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _host_uniforms(seeds: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray,
                  slots: Sequence[int] | np.ndarray | int) -> np.ndarray:
    """`keyed_uniforms` on the host, bit for bit: float64 uniforms, one per broadcast element
    of (seed, position, slot). Seeds are int64 keys (`fold_seed`), positions and slots >= 0."""
    h = _mix_host(np.asarray(seeds, dtype=np.int64).view(np.uint64).reshape(np.shape(seeds)))
    h = _mix_host(h ^ np.asarray(positions, dtype=np.uint64))
    h = _mix_host(h ^ np.asarray(slots, dtype=np.uint64))
    return ((h >> _S11).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def uniform_table(seeds: Sequence[int], positions: Sequence[int], width: int, slot: int,
                  slot_step: int = 0) -> torch.Tensor:
    """[N, width] float64 on the host: row i, column d is the uniform at (seeds[i],
    positions[i] + d, slot + slot_step * d), the same bits as `keyed_uniforms`."""
    if len(seeds) * width <= _PY_MAX_DRAWS:
        out = []
        for seed, pos in zip(seeds, positions, strict=True):
            h0 = _mix_int(seed & _MASK)
            for d in range(width):
                h = _mix_int(_mix_int(h0 ^ (pos + d)) ^ (slot + slot_step * d))
                out.append(((h >> 11) + 0.5) * (1.0 / (1 << 53)))
        return torch.tensor(out, dtype=torch.float64).view(len(seeds), width)
    depth = np.arange(width, dtype=np.int64)[None, :]
    return torch.from_numpy(_host_uniforms(
        np.asarray(seeds, dtype=np.int64)[:, None],
        np.asarray(positions, dtype=np.int64)[:, None] + depth, slot + slot_step * depth))


def uniforms_for(
    seeds: list[int], positions: list[int], slot: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[N] uniforms for row i at (seeds[i], positions[i], slot), on `device` (one staged
    copy)."""
    from mtpserve.workers.model.attention_metadata import stage

    return stage([uniform_table(seeds, positions, 1, slot).view(-1)], device)[0]
