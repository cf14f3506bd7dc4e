"""Pack a request's KV blocks (and its MTP seed tensors) into contiguous payloads and back.

KV layout contract of the engine: one rank's cache is a list of per-layer tensors, main-model
layers first then MTP layers, each `[2, num_blocks, block_size, num_kv_heads_local, head_dim]`
(index 0 = K, 1 = V). A request owns `block_ids` in every layer (one block table for all).
"""

from __future__ import annotations

import torch


def gather_blocks(
    kv_layers: list[torch.Tensor],  # each [2, num_blocks, block_size, H_local, D]
    block_ids: list[int],
    heads: slice = slice(None),
) -> torch.Tensor:  # [L, 2, n_blocks, block_size, h, D], contiguous, new memory
    """Copy the request's blocks, restricted to `heads` (local head indices), out of the cache.

    The result is a fresh tensor, so the cache blocks may be freed once this returns.
    """
    assert kv_layers, "no KV layers"
    first = kv_layers[0]
    idx = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    _, _, block_size, _, head_dim = first.shape
    num_heads = len(range(first.shape[3])[heads])
    out = torch.empty(
        (len(kv_layers), 2, len(block_ids), block_size, num_heads, head_dim),
        dtype=first.dtype,
        device=first.device,
    )
    for layer, dst in zip(kv_layers, out, strict=True):
        assert layer.shape[0] == 2 and layer.shape[2:] == first.shape[2:], (
            f"layer shape {tuple(layer.shape)} differs from {tuple(first.shape)}"
        )
        assert layer.dtype == first.dtype, f"mixed KV dtypes {layer.dtype} / {first.dtype}"
        # Narrow the heads first so only the requested slice is read.
        torch.index_select(layer[:, :, :, heads], 1, idx, out=dst)
    return out


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
    meta: list[list] = []
    parts: list[torch.Tensor] = []
    for name, t in extras.items():
        t = t.detach().contiguous()
        meta.append([name, list(t.shape), dtype_name(t.dtype)])
        parts.append(as_bytes(t).to(device))
    blob = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    return meta, blob


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
