"""helm/mtpserve's PrometheusRule alerts on metrics the app really exports: every vllm:*/
mtpserve:* name and every histogram bound (`le`) in the rules is checked against what
router/metrics_api.py prints, Ray Serve's against the names Ray 2.60 registers, and the SLO
thresholds against the values they come from. Offline: no Prometheus evaluates the rules.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from helm_render import CHART, MULTI, NAMESPACE, RELEASE, load_values, render, render_case

from mtpserve.router.metrics_api import render as render_metrics
from mtpserve.workers.replica.metrics import ITL_BUCKETS, TTFT_BUCKETS, Histogram

FULL = f"{RELEASE}-mtpserve"
SELECTOR = f'namespace="{NAMESPACE}",ray_cluster=~"{FULL}-[a-z0-9]{{5}}"'


def _exported() -> tuple[set[str], dict[str, set[str]]]:
    """Sample names /metrics prints for a busy cluster, and the `le` labels per histogram."""
    hists = {}
    for name, bounds in (("time_to_first_token_seconds", TTFT_BUCKETS),
                         ("inter_token_latency_seconds", ITL_BUCKETS),
                         ("request_time_per_output_token_seconds", ITL_BUCKETS)):
        h = Histogram(bounds)
        h.observe(0.03)
        hists[name] = h.snapshot()
    snap = {"replica": "r1", "role": "decode", "time": time.time(),
            "counters": {"spec_decode_num_drafts": 1, "spec_decode_num_draft_tokens": 2,
                         "spec_decode_num_accepted_tokens": 1, "generation_tokens": 3,
                         "num_preemptions": 0, "kv_transfer_bytes": 1,
                         "kv_transfer_seconds": 0.1},
            "per_pos": [1, 0], "hists": hists,
            "gauges": {"num_requests_running": 1, "num_requests_waiting": 0,
                       "kv_cache_usage_perc": 0.5, "num_speculative_tokens": 2,
                       "measured_tpot_seconds": 0.02, "predicted_tpot_seconds": 0.02}}
    text = render_metrics({"snapshots": [snap],
                           "policy": {"DecodeServer": {"desired_replicas": 2,
                                                       "predicted_tpot_s": 0.02,
                                                       "target_tpot_s": 0.04}}}, "m")
    names, les = set(), {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name = re.match(r"[^{ ]+", line).group(0)
        names.add(name)
        m = re.search(r'le="([^"]+)"', line)
        if m:
            les.setdefault(name, set()).add(m.group(1))
    return names, les


def _rules(docs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    (pr,) = docs["prometheusrule.yaml"]
    return {r["alert"]: r for g in pr["spec"]["groups"] for r in g["rules"]}


def test_alerts_are_off_by_default() -> None:
    assert render_case(None)["prometheusrule.yaml"] == []


def test_alert_rules_cover_the_operations_risks() -> None:
    rules = _rules(render_case(MULTI))
    assert set(rules) == {
        "MtpserveTTFTBudgetBurnFast", "MtpserveTTFTBudgetBurnSlow",
        "MtpserveTPOTBudgetBurnFast", "MtpserveTPOTBudgetBurnSlow",
        "MtpserveKVCacheNearlyFull", "MtpserveReplicasBelowDesired",
        "MtpserveDraftAcceptanceCollapsed", "MtpserveDraftingStopped"}
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_rules_use_metrics_the_app_exports() -> None:
    names, les = _exported()
    ray_serve = {"ray_serve_deployment_replica_healthy"}  # Ray's Serve metric (ray_ prefix)
    for name, rule in _rules(render_case(MULTI)).items():
        expr = rule["expr"]
        used = set(re.findall(r"\b((?:vllm|mtpserve):[a-z_]+|ray_serve_[a-z_]+)\b", expr))
        assert used, name
        assert used <= names | ray_serve, (name, used - names - ray_serve)
        # Every selector is this release's clusters, as the PodMonitor labels them.
        assert expr.count("{") == expr.count(SELECTOR) + expr.count("{5}"), name
        assert expr.count("(") == expr.count(")"), name
        for metric, le in re.findall(r'([a-z:_]+_bucket)\{[^}]*le="([^"]+)"', expr):
            assert le in les[metric], (name, metric, le)


def test_ray_serve_metric_name_exists_in_ray() -> None:
    import ray.serve

    src = "".join(p.read_text() for p in Path(ray.serve.__file__).parent.rglob("*.py"))
    assert '"serve_deployment_replica_healthy"' in src


def test_chart_bucket_bounds_equal_the_apps() -> None:
    """_helpers.tpl lists the histogram bounds as /metrics prints them (repr of a float)."""
    tpl = (CHART / "templates" / "_helpers.tpl").read_text()
    for define, bounds in (("ttftBuckets", TTFT_BUCKETS), ("itlBuckets", ITL_BUCKETS)):
        body = tpl[tpl.index(f'define "mtpserve.{define}"'):]
        listed = re.findall(r'"([0-9.]+)"', body[:body.index("{{- end }}")])
        assert listed == [repr(float(b)) for b in bounds], define


def _burn(rule: dict[str, Any]) -> tuple[str, list[str], list[str]]:
    expr = rule["expr"]
    les = re.findall(r'le="([^"]+)"', expr)
    thresholds = re.findall(r"\) > ([0-9.]+)", expr)
    windows = re.findall(r"\[([0-9]+[mh])\]", expr)
    return les[0], thresholds, windows


@pytest.mark.parametrize("values, ttft_le, tpot_le", [
    (None, None, None),  # MULTI: targets 300 ms, 25 ms
    ({"monitoring": {"prometheusRule": {"ttftSeconds": 2, "tpotSeconds": 0.04}}}, "2.5", "0.05"),
])
def test_slo_thresholds_follow_the_targets(values: dict[str, Any] | None, ttft_le: str | None,
                                           tpot_le: str | None) -> None:
    """The bucket at or above each target; 14.4× (1h, 5m) and 6× (6h, 30m) the budget."""
    base = load_values(MULTI)
    if values:
        base["monitoring"]["prometheusRule"].update(values["monitoring"]["prometheusRule"])
    rules = _rules(render(base))
    args = base["serve"]["args"]
    ttft_le = ttft_le or "0.5"  # 300 ms -> the 0.5 s bucket (0.25 < 0.3)
    tpot_le = tpot_le or repr(args["decode"]["autoscaling"]["target_tpot_ms"] / 1000)
    for slo, le in (("TTFT", ttft_le), ("TPOT", tpot_le)):
        fast_le, fast, fast_w = _burn(rules[f"Mtpserve{slo}BudgetBurnFast"])
        slow_le, slow, slow_w = _burn(rules[f"Mtpserve{slo}BudgetBurnSlow"])
        assert fast_le == slow_le == le, slo
        assert fast == ["0.144", "0.144"] and fast_w == ["1h", "1h", "5m", "5m"], slo
        assert slow == ["0.06", "0.06"] and slow_w == ["6h", "6h", "30m", "30m"], slo
        assert rules[f"Mtpserve{slo}BudgetBurnFast"]["labels"]["severity"] == "critical"


def test_replicas_alert_counts_a_deployment_with_no_healthy_replica() -> None:
    expr = _rules(render_case(MULTI))["MtpserveReplicasBelowDesired"]["expr"]
    assert "by (ray_cluster, deployment)" in expr
    assert re.search(r"\bor\s+0 \* max by \(ray_cluster, deployment\) "
                     r"\(mtpserve:autoscaling_desired_replicas", expr)


def test_drafting_alert_only_with_speculation() -> None:
    off = load_values(MULTI)
    off["serve"]["args"]["speculation"]["num_speculative_tokens"] = 0
    assert "MtpserveDraftingStopped" not in _rules(render(off))


def test_alert_values_are_checked() -> None:
    with pytest.raises(helm.HelmValuesError, match="objective"):
        render({"monitoring": {"prometheusRule": {"objective": 1.5}}})
