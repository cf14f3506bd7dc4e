"""A simulated replica's lifecycle, as Serve drives it: STARTING (asked for; loading weights and
warming up for the replica model's `start_s`, not routed to, not reporting), RUNNING (routed
to, reporting metrics, counted in `current_num_replicas`), DRAINING (scaled down: takes no new
requests and finishes its own for at most `graceful_shutdown_timeout_s`), STOPPED. A replica
costs GPU time from STARTING until STOPPED."""

from __future__ import annotations

STARTING, RUNNING, DRAINING, STOPPED = "starting", "running", "draining", "stopped"
