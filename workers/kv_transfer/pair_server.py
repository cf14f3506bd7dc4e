"""PairServer: the sender's side of one (prefill rank, decode rank) pair.

Each pair gets its own thread that answers that decode rank's pulls and bandwidth probes in
order, because a pair carries one ordered stream (NCCL matches sends to receives by order
alone). The holds themselves stay with the KVSender that owns the pair: this module runs the
wire protocol, the sender decides what is held and when it is released.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mtpserve.workers.device import runtime
from mtpserve.workers.kv_transfer.channel import MAX_PROBE_BYTES, KVTransferError, PairChannel
from mtpserve.workers.kv_transfer.packing import Packed, dtype_name, extras_nbytes, pack_payload

if TYPE_CHECKING:
    from mtpserve.workers.kv_transfer.sender import Held, KVSender

logger = logging.getLogger(__name__)

# Idle threads re-check their stop flag this often. Stop messages wake them at once; this only
# bounds odd cases, and each timed-out store wait logs a c10d warning, so keep it long.
IDLE_WAIT_S = 60.0


class PairServer:
    """Answers one decode rank's pulls and probes, in order, on its own thread.

    `channel` must be built on the pair's own store client: a waiting client blocks its
    connection for everyone else. `interrupt` stops the thread wherever it waits.
    """

    def __init__(self, sender: KVSender, receiver_id: str, channel: PairChannel) -> None:
        self.receiver_id = receiver_id
        self.channel = channel
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self._serve,
            name=f"{sender.name}-kv-pair-{receiver_id}",
            daemon=True,
        )
        self._sender = sender
        # Grow-only pack buffer: a pair serves one pull at a time and each send has completed
        # before the next pack, so reusing it never overwrites bytes still in flight.
        self._buffer: torch.Tensor | None = None
        # CUDA: this pair's own stream; packing and the NCCL send run on it (issued on this
        # thread), after the hold's ready event, so they neither wait for nor delay the
        # engine's stream.
        device = sender._device
        self._stream = runtime().new_stream(device) if device.type == "cuda" else None

    def start(self) -> None:
        self.thread.start()

    def interrupt(self, store: dist.Store) -> None:
        """Wake the pair thread wherever it waits on its inbox (`store`: the sender's store)."""
        self.stop.set()
        try:
            self.channel.wake(store)
        except (RuntimeError, dist.DistError):
            pass

    def _serve(self) -> None:
        """Answer the decode rank's messages until stopped or the channel breaks."""
        sender, channel = self._sender, self.channel
        try:
            with _on_stream(self._stream):  # the challenge's ops too stay off the engine's
                channel.connect(sender.transfer_timeout_s)
            last_used = time.monotonic()
            while not self.stop.is_set():
                msg = channel.poll(min(IDLE_WAIT_S, sender.pair_idle_s), "a pull")
                if msg is None:
                    if time.monotonic() - last_used >= sender.pair_idle_s:
                        # Decode ranks that died never say goodbye. A live one reads this as
                        # the reply to its next pull, reconnects and pulls again.
                        channel.put({"status": "error", "retry": True, "error": "idle pair"})
                        return
                    continue
                last_used = time.monotonic()
                op = msg.get("op")
                if op == "pull":
                    self._serve_pull(msg)
                elif op == "probe":
                    self._serve_probe(msg)
                elif op in ("stop", "close"):
                    return
                else:
                    raise KVTransferError(f"unexpected message from {self.receiver_id}: {msg}")
        except KVTransferError as e:
            if not self.stop.is_set():
                logger.warning("%s: %s", sender.name, e)
                sender._count({"channel_failures": 1})
                try:  # let the decode side fail its next pull at once instead of timing out
                    channel.put({"status": "error", "broken": True, "error": str(e)})
                except KVTransferError:
                    pass
        except Exception:  # a serving thread must never die silently
            logger.exception("%s: KV pair thread for %s crashed", sender.name, self.receiver_id)
        finally:
            channel.close()
            sender._pair_ended(self)

    def _serve_pull(self, msg: dict[str, Any]) -> None:
        """pull -> header (or an error) -> KV + extras bytes -> ack; releases via the sender."""
        with _on_stream(self._stream):
            self._serve_pull_on_stream(msg)

    def _serve_pull_on_stream(self, msg: dict[str, Any]) -> None:
        sender, channel = self._sender, self.channel
        request_id = msg["request_id"]
        head_start, head_end = int(msg["head_start"]), int(msg["head_end"])
        # Leading blocks the decode replica already caches (prefix caching): not sent.
        skip = int(msg.get("skip_blocks", 0))
        # Decode ranks pulling these heads from this rank (> 1: a replicated cache).
        copies = max(1, int(msg.get("copies", 1)))
        held, error = sender._begin_pull(request_id, head_start, head_end, copies)
        if held is not None and not 0 <= skip < len(held.block_ids):
            sender._finish_pull(request_id, held, range(0), False, 0)
            held, error = None, f"cannot skip {skip} of {len(held.block_ids)} blocks"
        if held is None:
            channel.put({"status": "error", "request_id": request_id, "error": error})
            return
        acked = False
        nbytes = 0
        try:
            try:
                if self._stream is not None and held.ready is not None:
                    runtime().wait_event(self._stream, held.ready)  # the KV's writes are done
                with_extras = bool(msg.get("extras", True))
                payload, kv, meta = self._pack(held, head_start, head_end, with_extras, skip)
            except Exception as e:  # e.g. a malformed hold: fail the request, not the channel
                logger.exception("%s: packing request %r failed", sender.name, request_id)
                error = f"{sender.name} could not pack request {request_id!r}: {e}"
                channel.put({"status": "error", "request_id": request_id, "error": error})
                return
            channel.put(
                {
                    "status": "ok",
                    "request_id": request_id,
                    "num_tokens": held.num_tokens,
                    "kv_shape": list(kv.shape),
                    "kv_dtype": dtype_name(kv.dtype),
                    "extras": meta,
                }
            )
            delay = sender._fault_delay()
            if delay and self.stop.wait(delay):  # a stuck peer; a replaced pair stops
                raise KVTransferError(f"pair to {self.receiver_id} stopped during a test stall")
            if payload.numel():
                channel.send(payload, sender.transfer_timeout_s, f"KV of request {request_id!r}")
            nbytes = kv.numel() * kv.element_size() + extras_nbytes(meta)  # padding not counted
            reply = channel.take(sender.transfer_timeout_s, f"ack of request {request_id!r}")
            acked = reply.get("op") == "ack" and reply.get("request_id") == request_id
            if not acked:
                raise KVTransferError(f"expected ack of {request_id!r}, got {reply}")
        finally:
            sender._finish_pull(request_id, held, range(head_start, head_end), acked, nbytes)

    def _pack(self, held: Held, head_start: int, head_end: int, with_extras: bool,
              skip_blocks: int = 0) -> Packed:
        """Global heads [head_start, head_end) of `held`'s blocks from `skip_blocks` on (+ its
        extras if `with_extras`) as one payload: [L, 2, n, bs, h, D] KV + extras blob, so one
        send moves both."""
        heads = slice(head_start - held.head_start, head_end - held.head_start)
        extras = held.extras if with_extras else None
        whole = (head_start == held.head_start and extras is not None and skip_blocks == 0
                 and head_end == held.head_start + held.num_heads)
        packed = self._sender._prepacked(held) if whole else None
        if packed is not None:
            return packed
        payload, kv, meta = pack_payload(
            held.kv_layers, held.block_ids[skip_blocks:], heads, extras, self._sender._device,
            self._buffer
        )
        if payload.device == held.kv_layers[0].device:
            # Still on the cache device, so it is (or outgrew) our buffer: reuse it next time,
            # if the sender's budget for kept send buffers allows (else it is freed after use).
            storage = payload.untyped_storage()
            keep = self._sender._may_keep_buffer(self, storage.nbytes())
            self._buffer = (torch.empty(0, dtype=torch.uint8, device=payload.device)
                            .set_(storage) if keep else None)
        return payload, kv, meta

    @property
    def buffer_bytes(self) -> int:
        return self._buffer.untyped_storage().nbytes() if self._buffer is not None else 0

    def _serve_probe(self, msg: dict[str, Any]) -> None:
        """Send `num_bytes` raw bytes down the pair, exactly as KV bytes travel (no packing)."""
        with _on_stream(self._stream):
            self._serve_probe_on_stream(msg)

    def _serve_probe_on_stream(self, msg: dict[str, Any]) -> None:
        sender, channel = self._sender, self.channel
        probe_id, num_bytes = msg.get("probe_id"), msg.get("num_bytes")
        try:
            if not isinstance(num_bytes, int) or not 0 < num_bytes <= MAX_PROBE_BYTES:
                raise ValueError(f"probe size must be in (0, {MAX_PROBE_BYTES}], got {num_bytes}")
            buf = sender._probe_buffer(num_bytes)
        except (ValueError, RuntimeError) as e:  # e.g. out of memory: refuse, keep the channel
            channel.put({"status": "error", "probe_id": probe_id, "error": f"{sender.name}: {e}"})
            return
        channel.put({"status": "ok", "probe_id": probe_id, "num_bytes": num_bytes})
        channel.send(buf, sender.transfer_timeout_s, f"probe {probe_id}")
        sender._count({"probes": 1, "probe_bytes_sent": num_bytes})


def _on_stream(stream: Any):
    """The CUDA stream `stream` current in the block, or nothing off CUDA (None)."""
    return runtime().on_stream(stream)
