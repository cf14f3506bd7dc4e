"""KV transfer from prefill ranks to decode ranks over pairwise torch.distributed channels.

Protocol (pull, driven by the decode side):
1. Each prefill rank runs a KVSender that hosts a TCPStore; its address travels in
   KVTransferParams. Finished prefills are `hold()`-ed there until released.
2. A decode rank's KVReceiver announces itself in that store's mailbox; both sides then build
   a two-rank process group (gloo or NCCL) under PrefixStore("pair/<receiver>/g<generation>").
3. `pull(request, heads)`: pull message → reply with shapes (or an error: unknown request) →
   packed KV blocks for those heads + MTP extras as raw bytes → ack. Control messages go
   through the store, bulk bytes through the group, one ordered stream per pair.
4. The sender releases a hold (`on_release`) when all its heads are acked (a replicated
   cache's by every decode rank that pulls it from this rank), on TTL expiry, on a `drop`
   or on failure. Any timeout breaks the channel; the next pull rebuilds it under a new
   generation.
5. `probe(address, num_bytes)`: probe message → ok reply → `num_bytes` raw bytes, on the same
   pair and timed like a pull (request → last byte), so benchmarks can compare achieved KV
   bandwidth (receiver stats: bytes_received / pull_seconds) with the channel's raw rate.
"""

from mtpserve.workers.kv_transfer.channel import KVTransferError, PairChannel
from mtpserve.workers.kv_transfer.packing import gather_blocks, scatter_blocks
from mtpserve.workers.kv_transfer.receiver import KVReceiver
from mtpserve.workers.kv_transfer.resharding import HeadPull, head_range, pull_plan, pull_resharded
from mtpserve.workers.kv_transfer.sender import KVSender

__all__ = [
    "HeadPull",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "PairChannel",
    "gather_blocks",
    "head_range",
    "pull_plan",
    "pull_resharded",
    "scatter_blocks",
]
