"""The replica layer: Ray Serve shells (prefill and decode deployments), the tensor-parallel
group that runs one engine over several processes, its control plane, the replica's metrics and
autoscaling signals, and the replica side of the KV data path (arrivals, holds, addresses).

The only part of `workers/` that imports Ray; the engine never imports this package."""
