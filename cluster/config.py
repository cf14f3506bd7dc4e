"""The cluster's configuration: the `args:` of `cluster.app:build_app` in a Serve config file.

Pydantic at the YAML/HTTP boundary (unknown keys are errors, every field is described); the
engine receives frozen dataclasses built from these values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers.paths import default_model_path


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AutoscalingSettings(_Strict):
    """Bounds and SLOs for the custom autoscaling policy of one deployment."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas kept running.")
    max_replicas: int = Field(1, ge=1, description="Most replicas the policy may ask for.")
    target_tpot_ms: float = Field(
        50.0, gt=0, description="Decode SLO: scale up when mean time per output token exceeds it."
    )
    target_ttft_ms: float = Field(
        1000.0, gt=0, description="Prefill SLO: scale up when mean time to first token exceeds it."
    )
    min_acceptance_rate: float = Field(
        0.3,
        ge=0,
        le=1,
        description="Below this draft acceptance rate speculation buys little, so decode capacity "
        "is added sooner.",
    )
    upscale_delay_s: float = Field(5.0, ge=0, description="Seconds a scale-up signal must hold.")
    downscale_delay_s: float = Field(60.0, ge=0, description="Seconds slack must hold before "
                                     "removing a replica.")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})"
            )
        return self


class PrefillSettings(_Strict):
    """Prefill deployment: chunked prefill through the main model and the MTP module(s)."""

    replicas: int = Field(1, ge=1, description="Initial number of prefill replicas.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel ranks per prefill replica.")
    max_num_batched_tokens: int = Field(
        512, ge=16, description="Token budget of one chunked-prefill step."
    )
    num_kv_blocks: int = Field(
        512, ge=8, description="KV blocks per prefill rank (held until decode acknowledges)."
    )
    cpus_per_rank: float = Field(1.0, ge=0, description="CPUs reserved per rank (bundle).")
    gpus_per_rank: float = Field(0.0, ge=0, description="GPUs reserved per rank (bundle).")
    autoscaling: AutoscalingSettings | None = Field(
        None, description="Autoscaling bounds; None keeps `replicas` fixed."
    )


class DecodeSettings(_Strict):
    """Decode deployment: one replica is one TP group running speculative rounds."""

    replicas: int = Field(1, ge=1, description="Initial number of decode replicas.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel ranks (worker processes) per "
                         "decode replica.")
    max_num_seqs: int = Field(32, ge=1, description="Most requests batched in one decode round.")
    num_kv_blocks: int = Field(1024, ge=8, description="KV blocks per decode rank.")
    cpus_per_rank: float = Field(1.0, ge=0, description="CPUs reserved per rank (bundle).")
    gpus_per_rank: float = Field(0.0, ge=0, description="GPUs reserved per rank (bundle).")
    autoscaling: AutoscalingSettings | None = Field(
        None, description="Autoscaling bounds; None keeps `replicas` fixed."
    )


class SpeculationSettings(_Strict):
    """MTP speculative decoding."""

    num_speculative_tokens: int = Field(
        2, ge=0, le=8, description="Drafts per round (k); 0 is plain decoding."
    )
    adaptive: bool = Field(
        True, description="Adapt k per replica to the measured acceptance rate (never above k)."
    )


class KVTransferSettings(_Strict):
    """How KV caches move from prefill ranks to decode ranks."""

    backend: Literal["gloo", "nccl"] = Field(
        "gloo", description="torch.distributed backend of the pairwise channels."
    )
    timeout_s: float = Field(30.0, gt=0, description="Timeout of one transfer; on expiry the "
                             "request fails and the channel is rebuilt.")
    hold_ttl_s: float = Field(
        60.0, gt=0, description="Prefill frees a request's KV blocks after this long without an "
        "acknowledgement from decode."
    )


class HTTPSettings(_Strict):
    host: str = Field("127.0.0.1", description="Address the HTTP proxy binds.")
    port: int = Field(8000, ge=1, le=65535, description="Port of the OpenAI-compatible API.")


class AuthSettings(_Strict):
    api_key: str | None = Field(
        None, description="Require `Authorization: Bearer <api_key>`; None disables auth."
    )
    api_key_env: str | None = Field(
        None, description="Read the API key from this environment variable instead (e.g. a "
        "Kubernetes Secret)."
    )


class ClusterConfig(_Strict):
    """Everything `build_app` needs; YAML `args:` of the Serve application."""

    model: str = Field(
        default_factory=lambda: str(default_model_path()),
        description="Local folder of a Hugging Face checkpoint with MTP weights.",
    )
    served_model_name: str | None = Field(
        None, description="Model id in the API; defaults to the folder name."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Compute and KV dtype."
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the engines run.")
    max_model_len: int | None = Field(
        None, ge=16, description="Context window; defaults to the model's max_position_embeddings."
    )
    block_size: int = Field(16, ge=1, description="Tokens per KV block.")
    prefill: PrefillSettings = Field(default_factory=PrefillSettings)
    decode: DecodeSettings = Field(default_factory=DecodeSettings)
    speculation: SpeculationSettings = Field(default_factory=SpeculationSettings)
    kv_transfer: KVTransferSettings = Field(default_factory=KVTransferSettings)
    http: HTTPSettings = Field(default_factory=HTTPSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    request_timeout_s: float = Field(600.0, gt=0, description="Longest a request may run.")

    @model_validator(mode="after")
    def _cross_field(self) -> ClusterConfig:
        if self.kv_transfer.backend == "nccl" and self.device != "cuda":
            raise ValueError("kv_transfer.backend 'nccl' needs device 'cuda'")
        if self.device == "cuda" and (
            self.prefill.gpus_per_rank <= 0 or self.decode.gpus_per_rank <= 0
        ):
            raise ValueError("device 'cuda' needs gpus_per_rank > 0 for prefill and decode")
        cfg_file = Path(self.model) / "config.json"
        if cfg_file.is_file():
            hf = json.loads(cfg_file.read_text())
            heads = hf.get("num_attention_heads")
            kv_heads = hf.get("num_key_value_heads", heads)
            for role, tp in (("prefill", self.prefill.tp_size), ("decode", self.decode.tp_size)):
                if kv_heads and kv_heads % tp:
                    raise ValueError(
                        f"{role}.tp_size={tp} must divide the model's {kv_heads} KV heads"
                    )
                if heads and heads % tp:
                    raise ValueError(
                        f"{role}.tp_size={tp} must divide the model's {heads} attention heads"
                    )
            n_mtp = hf.get("num_nextn_predict_layers", 0) or 0
            if n_mtp == 0 and self.speculation.num_speculative_tokens > 0:
                raise ValueError(
                    "speculation.num_speculative_tokens > 0 but the model has no MTP module "
                    "(num_nextn_predict_layers = 0)"
                )
        return self
