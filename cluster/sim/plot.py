"""PNG of one simulation: load, acceptance, replicas and TPOT / TTFT against the SLOs over time
(matplotlib, imported only here: `pip install mtpserve[bench]`)."""

from __future__ import annotations


def plot(res: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError as e:  # optional dependency
        raise SystemExit("--png needs matplotlib (pip install 'mtpserve[bench]')") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, tl = res["config"], res["timeline"]
    t = [r["t"] / 60 for r in tl]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    ax = axes[0]
    ax.plot(t, [r["arrivals_rps"] for r in tl], label="arrivals (req/s)")
    ax.set_ylabel("req/s")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[1]
    ax.plot(t, [r.get("alpha0_workload") for r in tl], label="alpha_0 of arrivals (workload)")
    ax.plot(t, [r.get("alpha0_measured") for r in tl], label="alpha_0 in decode windows",
            linestyle="--")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right", fontsize=8)
    ax = axes[2]
    rows = res["replica_timeline"]["rows"]
    rt = [r[0] / 60 for r in rows]
    ax.step(rt, [sum(r[4:7]) for r in rows], where="post", label="decode (alive)")
    ax.step(rt, [r[5] for r in rows], where="post", label="decode (running)", linestyle=":")
    ax.step(rt, [sum(r[1:4]) for r in rows], where="post", label="prefill (alive)")
    ax.step(rt, [r[8] for r in rows], where="post", label="decode target", linestyle="--",
            alpha=0.6)
    ax.set_ylabel("replicas")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[3]
    ax.plot(t, [r.get("tpot_ms_p50") for r in tl], label="TPOT p50")
    ax.plot(t, [r.get("tpot_ms_p99") for r in tl], label="TPOT p99", alpha=0.6)
    ax.axhline(cfg["tpot_slo_ms"], color="red", linestyle=":", label="TPOT SLO")
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax2 = ax.twinx()
    ax2.plot(t, [r.get("ttft_ms_p99") for r in tl], color="grey", alpha=0.4,
             label="TTFT p99 (right)")
    ax2.axhline(cfg["ttft_slo_ms"], color="grey", linestyle=":", alpha=0.6)
    ax2.set_ylabel("TTFT ms")
    ax2.set_yscale("log")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    ax.set_xlabel("minutes")
    s = res["summary"]
    fig.suptitle(f"{cfg['scenario']} / {cfg['policy']} on {cfg['model']} "
                 f"({cfg['hardware'] or 'profile'}): SLO attainment {s['slo_attainment']:.3f}, "
                 f"{s['gpu_hours']:.2f} GPU-h", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
