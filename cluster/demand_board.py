"""Prefill -> decode demand: the arrival growth the prefill policy of an application sees,
posted where the decode policy of the same application reads it (cluster/autoscaling_policy.py).

While prefill is short of replicas, `arrival_growth` measures how fast its arrivals outgrow what
it serves (served rate + fastest queue growth, over the served rate) and holds it a while; the
prefill policy posts it on a `DemandBoard` and the decode policy scales for its load times that
growth, so decode replicas start while prefill is still catching up with a burst instead of one
start delay later.
"""

from __future__ import annotations


class DemandBoard:
    """The arrival growth the prefill policy of an application sees, for its decode policy.

    Serve calls every deployment's policy in the one controller process, so a module-level
    board (`BOARD`) connects the two policies of an application without Ray; the simulator
    gives each run its own board. A post is (time, growth); a reader ignores posts older than
    its `max_age_s` or from the future (another run's clock)."""

    def __init__(self) -> None:
        self._posts: dict[str, tuple[float, float]] = {}

    def post(self, app: str, now: float, growth: float) -> None:
        self._posts[app] = (now, growth)

    def growth(self, app: str, now: float, max_age_s: float) -> float:
        t, g = self._posts.get(app, (None, 1.0))
        if t is None or not 0 <= now - t <= max_age_s:
            return 1.0
        return g


BOARD = DemandBoard()
GROWTH_SPAN_S = 10.0  # queue growth is measured over spans of 2 s up to this
GROWTH_HOLD_S = 20.0  # a growth stays posted this long (> Serve's upscale delay)
MAX_GROWTH = 4.0
# Growths under this are not posted. The board costs ~9% GPU-seconds at a steady load in the
# simulator (a busy prefill queue's wobble), but ignoring growths under 1.5x cost the burst
# 2 points of attainment.
MIN_GROWTH = 1.0


def arrival_growth(state: dict, now: float, served_per_s: float, queue: float,
                   saturated: bool) -> float:
    """Arrival rate / served rate at prefill: (served + fastest queue growth over a span of
    2 s to GROWTH_SPAN_S) / served, counted only while prefill is `saturated` (it needs more
    replicas itself: a steady queue's wobble is not growth), and held at its largest for
    GROWTH_HOLD_S. Mutates `state` (`q_hist`, `g_hist`: short [t, value] lists)."""
    q_hist = [x for x in state.get("q_hist", []) if now - x[0] <= GROWTH_SPAN_S]
    if not q_hist or now - q_hist[-1][0] >= 1.0:  # thin to one sample a second
        q_hist.append([now, queue])
    g = 1.0
    if saturated and served_per_s > 0:
        rate = max([(queue - q) / (now - t) for t, q in q_hist if now - t >= 2.0], default=0.0)
        g = min(max(1.0 + rate / served_per_s, 1.0), MAX_GROWTH)
    g_hist = [x for x in state.get("g_hist", []) if now - x[0] <= GROWTH_HOLD_S]
    if g < MIN_GROWTH:
        g = 1.0
    if g > 1.0:
        g_hist.append([now, g])
    state["q_hist"], state["g_hist"] = q_hist, g_hist
    return max([g] + [x[1] for x in g_hist])
