"""`mtpserve sim autoscale | table | profile`: the cluster simulator from the command line.

Building the parser imports nothing heavy; each command imports the simulator when it runs.
"""

from __future__ import annotations

import argparse
import json
import sys

SCENARIOS = ("acceptance-shift", "burst", "diurnal")
POLICIES = ("mtpserve", "serve-default", "slo-planner")


def _pair(s: str) -> tuple[float, float]:
    d, p = (float(x) for x in s.split(","))
    return d, p


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", default="h200", help="h100 | h200 (roofline)")
    p.add_argument("--model-config", default="mimo-7b-like",
                   help="a Hugging Face config.json (file or folder) or a shipped name: "
                        "mimo-7b-like, qwen3-32b-like, deepseek-v3-like")
    p.add_argument("--profile", help="a fitted profile JSON of our engine instead of the "
                   "roofline (`mtpserve sim profile`)")
    p.add_argument("--tp", type=int, help="TP size per replica (default: the model config's)")
    p.add_argument("--mtp-depth", type=int, help="k_max, drafts per round")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--duration-s", type=float, help="shorten the scenario (default 1 h)")
    p.add_argument("--ttft-slo-ms", type=float, default=500.0)
    p.add_argument("--tpot-slo-ms", type=float, default=8.0)
    p.add_argument("--cold-start", action="store_true",
                   help="decode replicas compile their graphs at start (within the warm-up "
                   "budget) instead of loading them from the on-disk compile cache")
    p.add_argument("--load-gbs", type=float,
                   help="weight-loading bandwidth per GPU, GB/s (default: hardware.json)")
    p.add_argument("--serve-target-ongoing", type=_pair, metavar="DECODE,PREFILL",
                   help="serve-default's target_ongoing_requests (default: profiled)")


def add_commands(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser("sim", help="simulate the disaggregated cluster under a workload "
                         "with the real autoscaling policies")
    sim_sub = sim.add_subparsers(dest="sim_command", required=True)
    p = sim_sub.add_parser("autoscale", help="one scenario with one policy: summary, replica "
                           "timeline, JSON (+ PNG)")
    p.add_argument("--scenario", required=True, choices=SCENARIOS)
    p.add_argument("--policy", required=True, choices=POLICIES)
    _common(p)
    p.add_argument("--json", dest="json_out", required=True)
    p.add_argument("--png", dest="png_out")
    p.set_defaults(func=_autoscale)

    p = sim_sub.add_parser("table", help="every scenario x policy: the comparison table")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--policies", default=",".join(POLICIES))
    _common(p)
    p.add_argument("--json", dest="json_out", required=True)
    p.set_defaults(func=_table)

    p = sim_sub.add_parser("profile", help="fit a replica profile JSON from our engine "
                           "(decode round-time model + prefill step time)")
    p.add_argument("--model", help="checkpoint folder (default: the embedded model)")
    p.add_argument("--k-max", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--rounds-per-cell", type=int, default=4,
                   help="timed decode rounds per (batch, k) cell (more: less noise)")
    p.add_argument("--prefill-reps", type=int, default=3, help="lone prompts per length")
    p.add_argument("--json", dest="json_out", required=True)
    p.set_defaults(func=_profile)


def sim_config(args: argparse.Namespace, scenario: str, policy: str):
    from mtpserve.cluster.sim.config import SimConfig

    return SimConfig(
        scenario=scenario, policy=policy, hardware=args.hardware,
        model_config=args.model_config, profile=args.profile, tp=args.tp,
        mtp_depth=args.mtp_depth, max_num_seqs=args.max_num_seqs, seed=args.seed,
        rate_scale=args.rate_scale, duration_s=args.duration_s, ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms, serve_target_ongoing=args.serve_target_ongoing,
        cold_start=args.cold_start, load_gbs=args.load_gbs)


def format_summary(res: dict) -> str:
    s, c = res["summary"], res["config"]
    lines = [
        f"{c['scenario']} / {c['policy']}: {c['model']} on {c['hardware'] or 'profile'} "
        f"(TP {c['tp']}, k_max {c['k_max']}, max_num_seqs {c['max_num_seqs']}), seed "
        f"{c['seed']}, rate x{c['rate_scale']}, SLOs TTFT {c['ttft_slo_ms']} ms / TPOT "
        f"{c['tpot_slo_ms']} ms",
        f"  requests {s['requests']}  finished {s['finished']}  rejected {s['rejected']}  "
        f"unfinished {s['unfinished']}",
        f"  slo_attainment {s['slo_attainment']:.4f} (TTFT {s['ttft_attainment']:.4f}, TPOT "
        f"{s['tpot_attainment']:.4f})  goodput_rps {s['goodput_rps']:.3f}",
        f"  gpu_seconds {s['gpu_seconds']:.0f} ({s['gpu_hours']:.2f} GPU-h)  replica starts "
        f"{s['replica_starts']}  migrations {s['migrations']}  preemptions {s['preemptions']}",
        f"  TTFT ms p50 {s['ttft_ms_p50']} p99 {s['ttft_ms_p99']}   TPOT ms p50 "
        f"{s['tpot_ms_p50']} p99 {s['tpot_ms_p99']}",
    ]
    return "\n".join(lines)


def format_replica_timeline(res: dict) -> str:
    out = ["  replica timeline: t_s  prefill(start/run/drain)  decode(start/run/drain)  "
           "targets(p,d)"]
    for r in res["replica_timeline"]["rows"]:
        out.append(f"    {r[0]:8.1f}  {r[1]:.0f}/{r[2]:.0f}/{r[3]:.0f}  {r[4]:.0f}/{r[5]:.0f}/"
                   f"{r[6]:.0f}  {r[7]:.0f},{r[8]:.0f}")
    return "\n".join(out)


def _write(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")


def _autoscale(args: argparse.Namespace) -> int:
    from mtpserve.cluster.sim.cluster import run

    res = run(sim_config(args, args.scenario, args.policy))
    print(format_summary(res))
    print(format_replica_timeline(res))
    _write(args.json_out, res)
    if args.png_out:
        from mtpserve.cluster.sim.plot import plot

        plot(res, args.png_out)
    return 0


TABLE_KEYS = ("slo_attainment", "goodput_rps", "gpu_seconds", "ttft_ms_p50", "ttft_ms_p99",
              "tpot_ms_p50", "tpot_ms_p99")


def _table(args: argparse.Namespace) -> int:
    from mtpserve.cluster.sim.cluster import run

    rows = []
    print("| scenario | policy | " + " | ".join(TABLE_KEYS) + " |")
    print("|---|---|" + "---|" * len(TABLE_KEYS))
    for scenario in args.scenarios.split(","):
        for policy in args.policies.split(","):
            res = run(sim_config(args, scenario, policy))
            row = {"scenario": scenario, "policy": policy} | {
                k: res["summary"][k] for k in TABLE_KEYS} | {"summary": res["summary"]}
            rows.append(row)
            print(f"| {scenario} | {policy} | "
                  + " | ".join(str(row[k]) for k in TABLE_KEYS) + " |", flush=True)
    _write(args.json_out, {"rows": rows})
    return 0


def _profile(args: argparse.Namespace) -> int:
    from mtpserve.cluster.sim.profile import profile_engine

    data = profile_engine(args.model, args.k_max, args.max_num_seqs,
                          rounds_per_cell=args.rounds_per_cell, prefill_reps=args.prefill_reps)
    _write(args.json_out, data)
    print(json.dumps(data, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtpserve")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
