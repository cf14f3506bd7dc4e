"""configs/*.yaml: valid Serve deploy configs whose args are valid ClusterConfigs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml
from serve_config_checks import check_serve_config, unknown_override_keys

from mtpserve.cluster.config import ClusterConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CONFIG_FILES = sorted(CONFIGS.glob("*.yaml"))


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / name).read_text())


def args_of(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg["applications"][0]["args"]


def test_the_three_configs_exist() -> None:
    names = {p.name for p in CONFIG_FILES}
    assert {"local-cpu.yaml", "gpu-node.yaml", "production.yaml"} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_config_validates(path: Path) -> None:
    check_serve_config(yaml.safe_load(path.read_text()))


def test_local_cpu_is_the_default_model_on_cpu() -> None:
    cfg = load("local-cpu.yaml")
    args = args_of(cfg)
    # The embedded model: no path to go stale when the checkout moves.
    assert args.get("model", "models/tiny-code-mtp") == "models/tiny-code-mtp"
    cc = check_serve_config(cfg)
    assert (cc.device, cc.kv_transfer.backend) == ("cpu", "gloo")
    assert (cc.prefill.tp_size, cc.decode.tp_size) == (1, 1)  # fastest on 2 cores (README)
    assert cc.engine.compile == "auto"  # compiled decode graphs, warmed up at start
    assert (cc.prefill.replicas, cc.decode.replicas) == (1, 1)
    # The whole app fits Ray's default resources on a 2-core machine.
    ranks = (cc.prefill.tp_size * cc.prefill.cpus_per_rank
             + cc.decode.tp_size * cc.decode.cpus_per_rank)
    assert ranks + cc.ingress.cpus <= 2
    tp2 = check_serve_config(load("local-cpu-tp2.yaml"))
    assert tp2.decode.tp_size == 2
    assert 2 * tp2.decode.cpus_per_rank + tp2.prefill.cpus_per_rank + tp2.ingress.cpus <= 2
    assert cc.prefill.gpus_per_rank == cc.decode.gpus_per_rank == 0
    assert (cc.http.host, cc.http.port) == ("127.0.0.1", 8000)
    assert cfg["http_options"] == {"host": "127.0.0.1", "port": 8000}


def test_gpu_node_uses_cuda_and_nccl() -> None:
    cc = check_serve_config(load("gpu-node.yaml"))
    assert (cc.device, cc.kv_transfer.backend) == ("cuda", "nccl")
    assert cc.prefill.gpus_per_rank == cc.decode.gpus_per_rank == 1


def test_production_autoscales_with_auth() -> None:
    cc = check_serve_config(load("production.yaml"))
    for role in (cc.prefill, cc.decode):
        assert role.autoscaling is not None
        assert role.autoscaling.min_replicas <= role.replicas <= role.autoscaling.max_replicas
        assert role.autoscaling.max_replicas > 1
    assert cc.auth.api_key_env and cc.auth.api_key is None  # never a plaintext key in a file


def test_gpu_node_and_production_share_engine_settings() -> None:
    """gpu-node.yaml is production.yaml minus autoscaling, auth, ingress and replica counts."""

    def engine(args: dict[str, Any]) -> dict[str, Any]:
        args = copy.deepcopy(args)
        args.pop("auth", None)
        args.pop("ingress", None)
        for role in ("prefill", "decode"):
            args[role].pop("autoscaling", None)
            args[role].pop("replicas", None)
        return args

    assert engine(args_of(load("gpu-node.yaml"))) == engine(args_of(load("production.yaml")))


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a["speculation"].update(num_speculative_token=2), "extra"),
        (lambda a: a["decode"].update(tp_size="two"), "tp_size"),
        (lambda a: a["kv_transfer"].update(backend="mpi"), "backend"),
        (lambda a: a.update(device="cpu"), "nccl"),  # nccl without cuda
    ],
    ids=["typo", "type", "enum", "cross-field"],
)
def test_bad_args_are_rejected(mutate: Any, match: str) -> None:
    cfg = load("gpu-node.yaml")
    mutate(args_of(cfg))
    with pytest.raises(pydantic.ValidationError, match=match):
        ClusterConfig.model_validate(args_of(cfg))


def test_override_key_typos_are_caught() -> None:
    # Ray itself accepts `num_replica` silently; our check must not.
    app = {"deployments": [{"name": "DecodeServer", "num_replica": 2}]}
    assert unknown_override_keys(app) == ["DecodeServer.num_replica"]
    app = {"deployments": [{"name": "DecodeServer", "autoscaling_config": {"max_replica": 2}}]}
    assert unknown_override_keys(app) == ["DecodeServer.autoscaling_config.max_replica"]
    good = {"deployments": [{"name": "OpenAIIngress", "max_ongoing_requests": 64}]}
    assert unknown_override_keys(good) == []


def test_serve_admission_matches_the_engine() -> None:
    """Decode takes max_num_seqs plus a small queue; beyond, Serve queues at most
    limits.max_queued_requests per caller (then 429); drains use graceful_shutdown_timeout_s."""
    from mtpserve.cluster.app import deployment_options

    cfg = ClusterConfig(**args_of(load("local-cpu.yaml")))
    for role in ("prefill", "decode"):
        opts = deployment_options(cfg, role)
        assert opts["max_queued_requests"] == cfg.limits.max_queued_requests
        assert opts["graceful_shutdown_timeout_s"] == cfg.graceful_shutdown_timeout_s
    decode = deployment_options(cfg, "decode")["max_ongoing_requests"]
    assert cfg.decode.max_num_seqs < decode <= 2 * cfg.decode.max_num_seqs


def test_ingress_scales_out_and_roles_pin_to_their_resources() -> None:
    """`ingress.*` sizes the OpenAI ingress (fixed or request-based autoscaling, CPU reserved);
    `{prefill,decode}.resources` go into every TP rank's bundle (role pinning)."""
    from pydantic import ValidationError

    from mtpserve.cluster.app import deployment_options, ingress_options

    base = args_of(load("local-cpu.yaml"))
    fixed = ingress_options(ClusterConfig(**base | {"ingress": {"replicas": 3, "cpus": 1}}))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"]["num_cpus"] == 1
    auto = ingress_options(ClusterConfig(**base | {"ingress": {
        "replicas": 5, "autoscaling": {"min_replicas": 2, "max_replicas": 4}}}))
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"]["initial_replicas"] == 4  # clamped into the bounds
    with pytest.raises(ValidationError):
        ClusterConfig(**base | {"ingress": {"autoscaling": {"min_replicas": 3,
                                                            "max_replicas": 2}}})
    pinned = ClusterConfig(**base | {"decode": base["decode"] | {"resources": {"gpu-pool-a": 1}}})
    bundles = deployment_options(pinned, "decode")["placement_group_bundles"]
    assert len(bundles) == pinned.decode.tp_size
    assert all(b["gpu-pool-a"] == 1 and b["CPU"] == pinned.decode.cpus_per_rank for b in bundles)
    assert all("gpu-pool-a" not in b
               for b in deployment_options(pinned, "prefill")["placement_group_bundles"])


def test_prefix_caching_accepts_a_bool_and_reaches_the_engines() -> None:
    from mtpserve.cluster.app import deployment_options

    assert ClusterConfig(prefix_caching=False).prefix_caching.enabled is False
    cfg = ClusterConfig(prefix_caching={"routing": "least_loaded", "max_load_gap": 2})
    assert cfg.prefix_caching.enabled is True
    router = deployment_options(cfg, "prefill")["request_router_config"]
    assert router.request_router_kwargs == {"routing": "least_loaded", "max_load_gap": 2.0,
                                            "min_hit_fraction": 0.5}
    with pytest.raises(ValueError):
        ClusterConfig(prefix_caching={"routing": "random"})


def test_tp_above_the_kv_heads_is_accepted_as_a_multiple_of_them(tiny_qwen3) -> None:
    """TP 4 and 8 over 2 KV heads replicate them (one KV head per rank); TP 3 divides
    neither way and is refused by name."""
    models = Path(__file__).parent / "data" / "configs"
    for model, tp in ((tiny_qwen3, 4), (models / "qwen3-next-80b-a3b", 4),
                      (models / "qwen3-next-80b-a3b", 8), (models / "qwen3-235b-a22b", 8)):
        cfg = ClusterConfig(model=str(model), prefill={"tp_size": 1}, decode={"tp_size": tp},
                            speculation={"num_speculative_tokens": 0})  # 235B has no MTP
        assert cfg.decode.tp_size == tp
    with pytest.raises(ValueError, match=r"decode.tp_size=3 must divide the model's 2 KV "
                                         r"heads or be a multiple of them"):
        ClusterConfig(model=str(tiny_qwen3), decode={"tp_size": 3})
