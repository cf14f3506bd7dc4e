"""Pack a request's KV blocks (and its MTP seed tensors) into contiguous payloads and back.

KV layout contract of the engine: one rank's cache is a list of per-layer tensors, main-model
layers first then MTP layers, each `[2, num_blocks, block_size, num_kv_heads_local, head_dim]`
(index 0 = K, 1 = V). A request owns `block_ids` in every layer (one block table for all).
"""

from __future__ import annotations

import torch

_ALIGN = 64  # byte alignment of the extras blob inside a pull payload

# What `pack_payload` returns: (payload [nbytes] uint8, kv view of its head, extras meta).
Packed = tuple[torch.Tensor, torch.Tensor, list[list]]


def gather_blocks(
    kv_layers: list[torch.Tensor],  # each [2, num_blocks, block_size, H_local, D]
    block_ids: list[int],
    heads: slice = slice(None),
    out: torch.Tensor | None = None,  # [L, 2, n_blocks, block_size, h, D] on the cache device
) -> torch.Tensor:  # [L, 2, n_blocks, block_size, h, D], contiguous, new memory (or `out`)
    """Copy the request's blocks, restricted to `heads` (local head indices), out of the cache.

    The result is a fresh tensor (or `out`), so the cache blocks may be freed once this returns.
    """
    assert kv_layers, "no KV layers"
    first = kv_layers[0]
    idx = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    shape = gathered_shape(kv_layers, len(block_ids), heads)
    if out is None:
        out = torch.empty(shape, dtype=first.dtype, device=first.device)
    assert tuple(out.shape) == shape and out.dtype == first.dtype, "`out` does not fit"
    for layer, dst in zip(kv_layers, out, strict=True):
        assert layer.shape[0] == 2 and layer.shape[2:] == first.shape[2:], (
            f"layer shape {tuple(layer.shape)} differs from {tuple(first.shape)}"
        )
        assert layer.dtype == first.dtype, f"mixed KV dtypes {layer.dtype} / {first.dtype}"
        # K and V apart: each half of a cache layer is contiguous over its blocks (the layer
        # is a view that leaves out the scratch block), so the select copies whole blocks;
        # on the layer view it takes a per-element path, ~20x slower on CPU. Heads are
        # narrowed first so only the requested slice is read.
        for half, part in zip(layer, dst, strict=True):
            torch.index_select(half[:, :, heads], 0, idx, out=part)
    return out


def gathered_shape(
    kv_layers: list[torch.Tensor], num_blocks: int, heads: slice = slice(None)
) -> tuple[int, ...]:  # [L, 2, n_blocks, block_size, h, D]
    _, _, block_size, num_heads, head_dim = kv_layers[0].shape
    return (len(kv_layers), 2, num_blocks, block_size, len(range(num_heads)[heads]), head_dim)


def payload_layout(kv_shape: list[int], kv_dtype: torch.dtype, meta: list[list]) -> tuple[int, int]:
    """(kv_nbytes, extras_offset) of a pull payload: the KV bytes first, then the extras blob
    at an aligned offset, so one send moves both and views of either part stay aligned."""
    kv_nbytes = _numel(kv_shape) * kv_dtype.itemsize
    if not meta:
        return kv_nbytes, kv_nbytes
    return kv_nbytes, -(-kv_nbytes // _ALIGN) * _ALIGN


def pack_payload(
    kv_layers: list[torch.Tensor],
    block_ids: list[int],
    heads: slice,
    extras: dict[str, torch.Tensor] | None,
    device: torch.device | str = "cpu",
    buffer: torch.Tensor | None = None,  # [>= nbytes] uint8 on the cache device, reused
) -> Packed:
    """Gather the KV blocks and pack the extras (None: none sent) into one byte buffer laid
    out as `payload_layout` says, with a single allocation (none when `buffer` fits and the
    payload stays on the cache device); `kv` is a view of its head."""
    first = kv_layers[0]
    shape = gathered_shape(kv_layers, len(block_ids), heads)
    meta, parts = _extras_parts(extras or {})
    kv_nbytes, offset = payload_layout(list(shape), first.dtype, meta)
    total = offset + sum(p.numel() for p in parts)
    if buffer is not None and buffer.numel() >= total and buffer.device == first.device:
        payload = buffer[:total]
    else:
        payload = torch.empty(total, dtype=torch.uint8, device=first.device)
    kv = payload[:kv_nbytes].view(first.dtype).view(shape)
    gather_blocks(kv_layers, block_ids, heads, out=kv)
    if offset > kv_nbytes:
        payload[kv_nbytes:offset].zero_()  # alignment padding: never ship stale memory
    for part in parts:
        payload[offset : offset + part.numel()].copy_(part)
        offset += part.numel()
    payload = payload.to(device)
    return payload, payload[:kv_nbytes].view(first.dtype).view(shape), meta


def unpack_payload(
    payload: torch.Tensor, kv_shape: list[int], kv_dtype: torch.dtype, meta: list[list]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Inverse of `pack_payload`: (kv, extras), both views into `payload`."""
    kv_nbytes, offset = payload_layout(kv_shape, kv_dtype, meta)
    kv = payload[:kv_nbytes].view(kv_dtype).view(kv_shape)
    return kv, unpack_extras(meta, payload[offset:])


def scatter_blocks(
    kv_layers: list[torch.Tensor],  # each [2, num_blocks, block_size, H_local, D]; mutated
    block_ids: list[int],
    payload: torch.Tensor,  # [L, 2, n_blocks, block_size, h, D]
    heads: slice = slice(None),
) -> None:
    """Write `payload` into this rank's own `block_ids` (and local `heads`) of every layer."""
    if payload.shape[0] != len(kv_layers):
        raise ValueError(f"payload has {payload.shape[0]} layers, cache has {len(kv_layers)}")
    if payload.shape[2] != len(block_ids):
        raise ValueError(f"payload has {payload.shape[2]} blocks, got {len(block_ids)} block ids")
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_layers[0].device)
    for layer, src in zip(kv_layers, payload, strict=True):
        view = layer[:, :, :, heads]  # a view: index_copy_ writes through to the cache
        if view.shape[2:] != src.shape[2:] or view.dtype != src.dtype:
            raise ValueError(
                f"payload blocks {tuple(src.shape)} {src.dtype} do not fit cache "
                f"{tuple(view.shape)} {view.dtype}"
            )
        view.index_copy_(1, idx, src.to(layer.device, non_blocking=True))


def as_bytes(t: torch.Tensor) -> torch.Tensor:  # [nbytes] uint8, shares memory with t
    """Raw bytes of a contiguous tensor: any dtype (bf16 included) travels on gloo as uint8."""
    assert t.is_contiguous(), "only contiguous tensors can be sent as raw bytes"
    return t.reshape(-1).view(torch.uint8)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def pack_extras(
    extras: dict[str, torch.Tensor], device: torch.device | str = "cpu"
) -> tuple[list[list], torch.Tensor]:  # (meta, blob [nbytes] uint8)
    """Concatenate the raw bytes of small tensors (MTP seed state) into one blob.

    `meta` lists `[name, shape, dtype]` in blob order; it travels as JSON.
    """
    meta, parts = _extras_parts(extras)
    parts = [p.to(device) for p in parts]
    blob = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    return meta, blob


def _extras_parts(
    extras: dict[str, torch.Tensor],
) -> tuple[list[list], list[torch.Tensor]]:  # (meta, raw bytes of each tensor)
    """The meta and raw bytes of `extras`, in order: the one place the extras layout is made,
    so `pack_payload`'s tail and `pack_extras`'s blob always agree with `unpack_extras`."""
    meta: list[list] = []
    parts: list[torch.Tensor] = []
    for name, t in extras.items():
        t = t.detach().contiguous()
        meta.append([name, list(t.shape), dtype_name(t.dtype)])
        parts.append(as_bytes(t))
    return meta, parts


def extras_nbytes(meta: list[list]) -> int:
    return sum(_numel(shape) * parse_dtype(dtype).itemsize for _, shape, dtype in meta)


def unpack_extras(meta: list[list], blob: torch.Tensor) -> dict[str, torch.Tensor]:
    """Inverse of `pack_extras`; the tensors are views into `blob`."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape, dtype_str in meta:
        dtype = parse_dtype(dtype_str)
        nbytes = _numel(shape) * dtype.itemsize
        out[name] = blob[offset : offset + nbytes].view(dtype).reshape(shape)
        offset += nbytes
    assert offset == blob.numel(), f"extras blob has {blob.numel()} bytes, meta says {offset}"
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
