"""Cache-aware routing on a real local Ray cluster over real HTTP: two prefill replicas whose
KV caches hold about one shared prefix each, two prefixes interleaved. Routed by cache, warm
requests hit their whole prefix on prefill and pull only their new blocks into decode; routed
by load alone (slow tier), the prefixes evict each other."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.ray

serve = pytest.importorskip("ray.serve")


def _run(model, routing: str, url: str) -> dict:
    from mtpserve.benchmarks.prefix_bench import (
        SharedPrefixArgs,
        cluster_overrides,
        run_shared_prefix,
    )
    from mtpserve.cluster.app import build_app
    from mtpserve.cluster.config import ClusterConfig

    args = SharedPrefixArgs(url=url, num_requests=8, num_prefixes=2, shared_prefix_tokens=97,
                            suffix_tokens=8, max_tokens=4, tokenizer=str(model))
    over = cluster_overrides(args, spare_blocks=2)
    cfg = ClusterConfig(model=str(model), **over, prefix_caching={"routing": routing},
                        kv_transfer={"timeout_s": 30, "hold_ttl_s": 30})
    serve.run(build_app(cfg), name="mtpserve", route_prefix="/")
    try:
        return asyncio.run(run_shared_prefix(args))
    finally:
        serve.delete("mtpserve")


@pytest.fixture(scope="module")
def cluster_url(shared_serve) -> str:
    return shared_serve.url()


@pytest.fixture(scope="module")
def aware(default_model, cluster_url) -> dict:
    return _run(default_model, "cache_aware", cluster_url)


def test_cache_aware_routing_hits_each_prefix_where_it_is_cached(aware) -> None:
    # 6 warm requests x 96 tokens (6 blocks of 16) each.
    assert aware["ideal_hit_tokens"] == 6 * 96
    assert aware["hit_fraction_of_ideal"] >= 0.8, aware
    assert aware["cached_tokens_reported"] == aware["prefill_hit_tokens"]
    # Decode holds both prefixes: a warm request pulls only its last blocks.
    assert aware["kv_bytes_per_warm"] <= aware["kv_bytes_per_cold"] / 3, aware
    assert aware["kv_bytes_saved"] > 0


@pytest.mark.slow  # a second app on the cluster; the default tier checks the hits themselves
def test_least_loaded_routing_thrashes_where_cache_aware_hits(default_model, cluster_url,
                                                              aware) -> None:
    loaded = _run(default_model, "least_loaded", cluster_url)
    assert loaded["hit_fraction_of_ideal"] < aware["hit_fraction_of_ideal"], (loaded, aware)
