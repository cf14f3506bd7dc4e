"""The cluster's configuration: the `args:` of `mtpserve.cluster.app:build_app` in a Serve
config file.

Pydantic at the YAML/HTTP boundary (unknown keys are errors, every field is described); the
engine receives frozen dataclasses built from these values.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from mtpserve.workers.paths import default_model_path


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AutoscalingSettings(_Strict):
    """Bounds and SLOs of the model-based autoscaling policy of one deployment
    (mtpserve.cluster.autoscaling_policy): decode sizes from predicted TPOT, prefill from TTFT."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas kept running.")
    max_replicas: int = Field(1, ge=1, description="Most replicas the policy may ask for.")
    # No acceptance threshold: acceptance enters the decode model as tokens per round, and
    # each replica already drops to k = 0 where drafting does not pay (workers/adaptive_k.py).
    target_tpot_ms: float = Field(
        50.0, gt=0, description="Decode SLO (used by the decode policy only): the policy moves "
        "to the fewest replicas whose predicted time per output token, from the replicas' "
        "performance models and live acceptance, is under 80% of it (and KV usage under 85%); "
        "it scales down only to a count predicted under 65%."
    )
    target_ttft_ms: float = Field(
        1000.0, gt=0, description="Prefill SLO (used by the prefill policy only): the policy "
        "moves to the fewest replicas whose predicted time to first token (queueing + "
        "compute + backlog) is under 80% of it; it scales down only to a count under 65%."
    )
    upscale_delay_s: float = Field(2.0, ge=0, description="Seconds the policy must keep asking "
                                   "for more replicas before Serve adds them (Serve's own "
                                   "upscale delay, wall-clock); then the whole step is applied "
                                   "at once. 0 scales up on the first decision.")
    downscale_delay_s: float = Field(60.0, ge=0, description="Seconds the smaller count must "
                                     "keep being predicted to meet the stricter down-headroom "
                                     "before replicas are removed (the policy's hold; idle "
                                     "deployments go to min_replicas after it too).")
    window_s: float = Field(30.0, gt=0, description="Replicas report signals (TPOT, "
                            "acceptance, batch, prefill times) over this sliding window; an "
                            "idle replica's window empties.")
    metrics_interval_s: float = Field(1.0, gt=0, description="How often replicas report their "
                                      "signals to the Serve controller; reports older than "
                                      "max(5 s, 4 intervals) are stale and the policy holds.")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})"
            )
        return self


class RoleSettings(_Strict):
    """What the prefill and decode deployments share: replicas of one TP group each, the
    resources every rank's bundle reserves, and autoscaling bounds."""

    replicas: int = Field(1, ge=1, description="Initial number of replicas.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel ranks (worker processes) per "
                         "replica.")
    num_kv_blocks: int | None = Field(
        None, ge=8, description="KV blocks per rank. null: 1024 on CPU; on CUDA sized by "
        "engine.kv_cache_memory_fraction.")
    cpus_per_rank: float = Field(1.0, ge=0, description="CPUs reserved per rank (bundle).")
    gpus_per_rank: float = Field(0.0, ge=0, description="GPUs reserved per rank (bundle).")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each rank's bundle asks for, "
        "e.g. {\"mtpserve-decode\": 1} to pin this role to nodes started with that resource "
        "(role pinning: a prefill bundle cannot take a decode node's GPU).")
    autoscaling: AutoscalingSettings | None = Field(
        None, description="Autoscaling bounds; None keeps `replicas` fixed."
    )
    engine_core: Literal["thread", "process"] = Field(
        "process", description="Where a replica's engine core (rank 0 of its TP group, the "
        "engine loop, KV pullers / senders, compiled graphs) runs: process = in a child "
        "process the replica starts and stops (token chunks come back batched per engine "
        "wake-up, see engine_core_channel; a dead core fails the health check at once and "
        "its streams migrate); thread = on a thread of the Serve replica's process, sharing "
        "its GIL with the streaming (starts a few seconds sooner).")
    engine_core_channel: Literal["shm", "socket"] = Field(
        "shm", description="How a process engine core and its replica exchange messages: "
        "shm = a ring per direction in shared memory; a doorbell byte on the socket pair "
        "wakes the receiver only when it sleeps (Linux; elsewhere the socket is used); "
        "socket = a Unix socket pair, one send and one receive system call per message.")


class PrefillSettings(RoleSettings):
    """Prefill deployment: chunked prefill through the main model and the MTP module(s)."""

    num_kv_blocks: int | None = Field(
        None, ge=8, description="KV blocks per prefill rank (held until decode acknowledges). "
        "null: 512 on CPU; on CUDA sized by engine.kv_cache_memory_fraction."
    )
    max_num_batched_tokens: int = Field(
        512, ge=16, description="Token budget of one chunked-prefill step."
    )


class DecodeSettings(RoleSettings):
    """Decode deployment: one replica is one TP group running speculative rounds."""

    max_num_seqs: int = Field(32, ge=1, description="Most requests batched in one decode round.")
    stream_interval_ms: float = Field(
        50.0, ge=0, description="Stream pacing: a stream's first tokens and its end go out "
        "at once, other tokens at most once per this many ms, each message carrying every "
        "round since the last (each hop to the client costs CPU per message, not per token; "
        "Ray Serve LLM's stream_batching_interval_ms is 50 too; 50 against 20 measured "
        "+7% output tok/s at 1 stream and +11% at 4 under guidellm-like load). 0: one "
        "message per round.")
    max_local_prefill_length: int = Field(
        0, ge=0, description="Conditional disaggregation: a prompt of at most this many "
        "tokens is prefilled on the decode replica itself when the ingress replica has no "
        "other request in flight (decode is idle then: the prompt skips the prefill "
        "replica's two hops and the KV transfer: on the 2-core box, one stream of 108-183 "
        "token prompts and 64 tokens took 149 ms per request against 193 ms). Busier, "
        "longer prompts and `disaggregate: true` requests go through a prefill replica. "
        "0: always disaggregate.")
    idle_prefill_threads: int = Field(
        0, ge=0, description="Intra-op threads of a decode step that only prefills (a "
        "local prefill, or a recompute, with no decode rounds running): the idle replica "
        "borrows cores for the compute-bound prefill; decode rounds keep "
        "max(1, cpus_per_rank) threads (their per-op cost grows with threads). tp_size 1 "
        "only. 0: max(1, cpus_per_rank).")

    @model_validator(mode="after")
    def _idle_threads(self) -> DecodeSettings:
        if self.idle_prefill_threads and self.tp_size > 1:
            raise ValueError("idle_prefill_threads needs tp_size 1 (the other ranks' "
                             "threads would not follow)")
        return self


class IngressAutoscaling(_Strict):
    """Serve's request-based autoscaling of the ingress (it is stateless: any replica serves
    any request)."""

    min_replicas: int = Field(1, ge=1, description="Fewest ingress replicas.")
    max_replicas: int = Field(4, ge=1, description="Most ingress replicas.")
    target_ongoing_requests: float = Field(
        64.0, gt=0, description="Streams per ingress replica the autoscaler aims for.")

    @model_validator(mode="after")
    def _bounds(self) -> IngressAutoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        return self


class IngressSettings(_Strict):
    """The OpenAI ingress deployment (tokenize, validate, orchestrate, stream). Serve's proxy
    spreads requests over its replicas; `limits.max_concurrent_requests` applies per replica."""

    replicas: int = Field(1, ge=1, description="Ingress replicas (initial, with autoscaling).")
    cpus: float = Field(0.25, ge=0, description="CPUs reserved per ingress replica.")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each ingress replica asks for, "
        "e.g. {\"mtpserve-ingress\": 1} to keep it on the nodes that run Serve's proxy.")
    autoscaling: IngressAutoscaling | None = Field(
        None, description="Request-based autoscaling; None keeps `replicas` fixed.")


class PrefixCachingSettings(_Strict):
    """Automatic prefix caching in every engine, and routing that uses it. `prefix_caching:
    false` in YAML is short for `{enabled: false}`."""

    enabled: bool = Field(
        True, description="Reuse the KV (main + MTP) of full blocks of earlier prompts and "
        "outputs; a decode replica pulls only the blocks it does not hold.")
    routing: Literal["cache_aware", "least_loaded"] = Field(
        "cache_aware", description="cache_aware: send a request to the prefill (and decode) "
        "replica holding the longest cached prefix of its prompt unless that replica is much "
        "busier (max_load_gap); least_loaded: by load only.")
    max_load_gap: float = Field(
        4.0, ge=0, description="A replica more than this many requests busier than the "
        "least-loaded one is not chosen for its cache (decode load in requests = expected "
        "tokens / tokens per request).")
    min_hit_fraction: float = Field(
        0.5, ge=0, le=1, description="Route by cache only when the cached prefix covers at "
        "least this share of the prompt's full blocks (a short common head, such as a licence "
        "header, does not outweigh load).")
    published_blocks: int = Field(
        8192, ge=0, description="Most cached block hashes a replica publishes for routing "
        "(8 bytes each, refreshed with the routing stats every second).")


class EngineSettings(_Strict):
    """How the engines run their forwards."""

    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="Compiled fixed-shape decode graphs in decode replicas: auto = on "
        "where measured faster (CPU with decode tp_size 1), on = wherever supported (TP = 1), "
        "off = eager. The MTPSERVE_COMPILE environment variable overrides it.")
    warmup_budget_s: float = Field(
        90.0, ge=0, description="Seconds a decode replica may spend compiling graphs at "
        "start, before it reports ready (likeliest buckets first; the rest run eagerly).")
    warmup_restart_budget_s: float = Field(
        0.0, ge=0, description="A decode replica that finds some of its graphs in the compile "
        "cache (a restart, or one added next to others) loads them and compiles new buckets "
        "for at most this many seconds (0: none), so it is ready in seconds; the first, cold "
        "start compiles within warmup_budget_s.")
    background_compile: bool = Field(
        True, description="A decode replica (CPU, TP = 1) compiles the buckets its warm-up "
        "left (past warmup_budget_s, or not in the cache on a restart) in a low-priority child "
        "process after it reports ready, and runs each one compiled as soon as it is built "
        "instead of eagerly for good; once per machine, kept in the compile cache.")
    compile_cache_dir: str | None = Field(
        None, description="Folder of compiled decode graphs kept between starts (CPU: "
        "AOTInductor packages keyed by weights, model code, torch, CPU and bucket): a "
        "restarted or added replica loads them instead of compiling. None: "
        "MTPSERVE_COMPILE_CACHE or ~/.cache/mtpserve/compile on each node; '' turns the "
        "cache off.")
    attention_backend: Literal["auto", "gather", "flex"] = Field(
        "auto", description="Paged attention: gather (copy each row's context, then SDPA), "
        "flex (FlexAttention over the block table, reads the cache in place) or auto (flex "
        "on CUDA, which never takes the padded gather; gather on CPU, measured faster there).")
    kv_cache_memory_fraction: float = Field(
        0.9, gt=0, le=1, description="CUDA, for a role whose num_kv_blocks is null: the share "
        "of its GPU reservation a rank may use in all (like vLLM's gpu_memory_utilization; "
        "times gpus_per_rank when that is below 1); its KV pool gets what is left after the "
        "weights, a profiled prefill's peak activations and a reserve for CUDA graphs, and "
        "never more than the GPU has free.")
    memory_check: bool = Field(
        True, description="device cuda: before any replica starts, `mtpserve up` and the Serve "
        "app builder compute each role's memory plan from the model's config.json (the "
        "plan of `mtpserve check --tp-size --gpu-memory-gib`) and refuse a layout whose "
        "weights, activations, graph reserve and states leave no room for one request of "
        "max_model_len, with the numbers and what would fit. false skips it (CPU: never run).")
    gpu_memory_gib: float | None = Field(
        None, gt=0, description="Memory of one GPU for the memory check, GiB; null: the first "
        "CUDA device the builder's process sees (none there: the check is skipped).")
    grammar_compile_workers: int = Field(
        2, ge=0, description="Structured outputs: grammars a replica has not compiled before "
        "compile off its engine thread, at most this many at once (later ones queue); the "
        "request waits for its grammar, every other stream goes on. 0: compile on the engine "
        "thread at admission (every stream of the replica waits).")
    grammar_compile_timeout_s: float = Field(
        30.0, gt=0, description="A request whose grammar is not compiled within this many "
        "seconds of reaching a replica fails alone (finish_reason error); the compile "
        "thread's result is dropped.")


class SpeculationSettings(_Strict):
    """MTP speculative decoding."""

    num_speculative_tokens: int = Field(
        2, ge=0, le=8, description="Drafts per round (k); 0 is plain decoding."
    )
    adaptive: bool = Field(
        True, description="Adapt k per replica to the measured acceptance rate (never above k)."
    )
    draft_vocab_size: int | None = Field(
        None, ge=1, description="Draft over the N most frequent tokens only (the model "
        "folder's draft_vocab.json, from `mtpserve draft-vocab`): cheaper draft steps, same "
        "outputs; null drafts over the whole vocabulary."
    )
    draft_dtype: Literal["auto", "model", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of the MTP module(s) and their LM head: auto = bfloat16 "
        "where the model runs in float32 on a CPU with native bf16 (AVX512-BF16 / AMX; a cheaper "
        "draft step, the same acceptance on the default model), except a bf16 checkpoint whose "
        "float32 linears the bf16-weight kernel streams (they stay float32), else the model's; "
        "model = the model's dtype. Outputs never change (the main model verifies every draft)."
    )


class KVTransferSettings(_Strict):
    """How KV caches move from prefill ranks to decode ranks."""

    backend: Literal["gloo", "nccl"] = Field(
        "gloo", description="torch.distributed backend of the pairwise channels."
    )
    timeout_s: float = Field(30.0, gt=0, description="Timeout of one transfer; on expiry the "
                             "request fails and the channel is rebuilt.")
    hold_ttl_s: float = Field(
        120.0, gt=0, description="Prefill frees a request's KV blocks after this long without "
        "an acknowledgement from decode. Above the first-chunk wait (migration.stall_timeout_s "
        "+ timeout_s) so a busy decode deployment can still take the KV instead of recomputing."
    )
    store_port_range: tuple[int, int] | None = Field(
        None, description="Inclusive [first, last] TCP ports a prefill rank's KV rendezvous "
        "store may listen on (the first free one); None: any free port. The gloo/NCCL data "
        "connections themselves use ephemeral ports.")
    max_pairs_per_rank: int = Field(
        64, ge=1, description="Live KV pairs (store connection, gloo/NCCL group, buffers) a "
        "decode rank keeps to prefill ranks; past it the least recently used idle one is "
        "closed (the sender closes its side too).")
    send_buffer_budget_mib: int = Field(
        1024, ge=0, description="Pack buffers a prefill rank's KV pairs keep for their next "
        "pull, summed over pairs (MiB); past it a pair frees its buffer after each pull.")
    max_concurrent_pulls: int = Field(
        4, ge=1, le=64, description="KV pulls a decode rank runs at once (each on its own "
        "thread and buffer); pulls from one prefill rank still go one at a time.")
    failure_policy: Literal["recompute", "fail"] = Field(
        "recompute", description="When a KV pull fails or times out: 'recompute' the request "
        "on a decode replica from its prompt (and tokens already sent), or 'fail' it with a "
        "clear error (vLLM's kv_load_failure_policy)."
    )
    host: str | None = Field(
        None, description="Address KV senders listen on and advertise; None: this node's IP "
        "(ray.util.get_node_ip_address()). Set 127.0.0.1 to keep KV on loopback (one machine)."
    )
    interface: str | None = Field(
        None, description="Network interface the KV pairs use (gloo binds it; NCCL gets it as "
        "NCCL_SOCKET_IFNAME); None: the interface that carries `host` ('lo' for a loopback "
        "host)."
    )
    # The deployment's KV secret (workers.kv_transfer.auth.Secret), set by the app builder
    # (cluster.app.with_kv_secret), never by YAML: private, so it is in no dump, repr,
    # schema or stats, yet it travels with the config (pickled) to every replica.
    _secret: Any = PrivateAttr(default=None)

    @property
    def secret(self) -> Any:
        return self._secret

    @model_validator(mode="after")
    def _port_range(self) -> KVTransferSettings:
        r = self.store_port_range
        if r is not None and not 1 <= r[0] <= r[1] <= 65535:
            raise ValueError(f"store_port_range {list(r)} must be [first, last] in 1..65535")
        return self


class HTTPSettings(_Strict):
    host: str = Field("127.0.0.1", description="Address the HTTP proxy binds.")
    port: int = Field(8000, ge=1, le=65535, description="Port of the OpenAI-compatible API.")


class AuthSettings(_Strict):
    """API keys. Fails closed: a configured `*_env` variable that is missing or empty where the
    ingress starts stops it from starting (it never means 'no auth')."""

    api_key: str | None = Field(
        None, min_length=1,
        description="Require `Authorization: Bearer <api_key>`; None disables auth.",
    )
    api_key_env: str | None = Field(
        None, min_length=1, description="Read the API key from this environment variable "
        "instead (e.g. a Kubernetes Secret); missing or empty refuses to start."
    )
    admin_api_key: str | None = Field(
        None, min_length=1, description="Key of the admin routes (kv_probe, unredacted stats); "
        "it is also accepted wherever the API key is."
    )
    admin_api_key_env: str | None = Field(
        None, min_length=1, description="Read the admin key from this environment variable; "
        "missing or empty refuses to start."
    )

    @model_validator(mode="after")
    def _one_source(self) -> AuthSettings:
        if self.api_key and self.api_key_env:
            raise ValueError("set auth.api_key or auth.api_key_env, not both")
        if self.admin_api_key and self.admin_api_key_env:
            raise ValueError("set auth.admin_api_key or auth.admin_api_key_env, not both")
        return self

    def resolve(self, environ: Mapping[str, str]) -> tuple[str | None, str | None]:
        """(api key, admin key) where the ingress runs. A configured variable that is missing
        or empty raises: starting without the auth the operator asked for would be silent."""
        keys = []
        for value, env, what in ((self.api_key, self.api_key_env, "auth.api_key_env"),
                                 (self.admin_api_key, self.admin_api_key_env,
                                  "auth.admin_api_key_env")):
            if env is not None:
                value = environ.get(env, "").strip()
                if not value:
                    raise RuntimeError(f"{what} names ${env}, which is missing or empty here; "
                                       "refusing to start without the configured API key")
            keys.append(value)
        return keys[0], keys[1]


class AdminSettings(_Strict):
    """Operator-only routes; off unless asked for, and always behind the admin key."""

    enable_kv_probe: bool = Field(
        False, description="Serve POST /v1/mtpserve/kv_probe (a raw KV-channel transfer); needs "
        "an admin key."
    )
    kv_probe_max_bytes: int = Field(
        16 << 20, ge=1, le=256 << 20, description="Largest transfer one kv_probe may ask for."
    )


class LimitsSettings(_Strict):
    """Server-side caps and backpressure, answered with OpenAI-style 400 / 413 / 429 errors."""

    max_tokens: int = Field(
        8192, ge=1, description="Largest `max_tokens` a request may ask for (400 beyond)."
    )
    max_n: int = Field(16, ge=1, description="Largest `n` (choices per prompt).")
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Longest prompt in tokens (400 beyond); None: the context "
        "window is the only limit."
    )
    max_request_bytes: int = Field(
        4 << 20, ge=1024, description="Largest request body (413 beyond), checked while the "
        "body streams in."
    )
    max_concurrent_requests: int = Field(
        512, ge=1, description="Requests one ingress replica works on at once; more are "
        "answered 429 with Retry-After."
    )
    max_queued_requests: int = Field(
        64, ge=1, description="Requests waiting for a busy prefill or decode deployment (Serve's "
        "max_queued_requests); more are answered 429 with Retry-After."
    )
    retry_after_s: int = Field(1, ge=1, description="Retry-After of a 429.")


class MigrationSettings(_Strict):
    """Request migration: a decode stream that fails resumes on another decode replica."""

    max_migrations: int = Field(
        2, ge=0, description="Resumes per request after a decode failure; then an error."
    )
    stall_timeout_s: float = Field(
        60.0, gt=0, description="Longest wait for the next chunk from a replica (beyond the KV "
        "transfer timeout for the first one) before it is treated as failed (frozen peer)."
    )
    retry_backoff_s: float = Field(
        0.2, gt=0, description="First back-off between retries while Serve still routes to a "
        "dead replica or every replica is busy; doubles up to 2 s."
    )
    retry_window_s: float = Field(
        30.0, gt=0, description="How long one resume may keep retrying unavailable replicas."
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
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute and KV dtype; auto = bfloat16 on CUDA, float32 on CPU."
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the engines run.")
    max_model_len: int | None = Field(
        None, ge=16, description="Context window; defaults to the model's max_position_embeddings."
    )
    block_size: int = Field(16, ge=1, description="Tokens per KV block.")
    reasoning_parser: Literal["auto", "none", "deepseek_r1", "deepseek_v3", "qwen3",
                              "glm45"] = Field(
        "auto", description="How chat output is split into `reasoning_content` and `content` "
        "(vLLM's parser names). auto: from the checkpoint's model_type and whether its chat "
        "template writes <think>; none: no split."
    )
    tool_call_parser: Literal["auto", "hermes", "qwen3_coder", "glm45", "deepseek_v3"] = Field(
        "auto", description="The tool-call format chat output is parsed in and forced calls are "
        "written in (vLLM's parser names). auto: from the chat template's tool-call markers, "
        "else the checkpoint's model_type; hermes where nothing else matches."
    )
    prefill: PrefillSettings = Field(default_factory=PrefillSettings)
    decode: DecodeSettings = Field(default_factory=DecodeSettings)
    ingress: IngressSettings = Field(default_factory=IngressSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    prefix_caching: PrefixCachingSettings = Field(default_factory=PrefixCachingSettings)
    speculation: SpeculationSettings = Field(default_factory=SpeculationSettings)
    kv_transfer: KVTransferSettings = Field(default_factory=KVTransferSettings)
    http: HTTPSettings = Field(default_factory=HTTPSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    admin: AdminSettings = Field(default_factory=AdminSettings)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    migration: MigrationSettings = Field(default_factory=MigrationSettings)
    request_timeout_s: float = Field(
        600.0, gt=0, description="Longest a request may run, end to end (prefill, transfer, "
        "decode, migrations); then it ends with a timeout error."
    )
    graceful_shutdown_timeout_s: float = Field(
        30.0, ge=0, description="On scale-down or SIGTERM: stop taking requests and let running "
        "ones finish for at most this long."
    )

    @model_validator(mode="before")
    @classmethod
    def _prefix_caching_bool(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("prefix_caching"), bool):
            data = {**data, "prefix_caching": {"enabled": data["prefix_caching"]}}
        return data

    @model_validator(mode="after")
    def _cross_field(self) -> ClusterConfig:
        if self.device != "cuda":  # KV pools are sized from GPU memory only on CUDA
            for name, default in (("prefill", 512), ("decode", 1024)):
                side = getattr(self, name)
                if side.num_kv_blocks is None:
                    object.__setattr__(self, name,
                                       side.model_copy(update={"num_kv_blocks": default}))
        if self.admin.enable_kv_probe and not (
            self.auth.admin_api_key or self.auth.admin_api_key_env
        ):
            raise ValueError("admin.enable_kv_probe needs auth.admin_api_key(_env)")
        if self.kv_transfer.backend == "nccl" and self.device != "cuda":
            raise ValueError("kv_transfer.backend 'nccl' needs device 'cuda'")
        if self.device == "cuda" and (
            self.prefill.gpus_per_rank <= 0 or self.decode.gpus_per_rank <= 0
        ):
            raise ValueError("device 'cuda' needs gpus_per_rank > 0 for prefill and decode")
        cfg_file = Path(self.model) / "config.json"
        if cfg_file.is_file():
            hf = json.loads(cfg_file.read_text())
            from mtpserve.workers.model.config import ModelConfig

            # Refuses an unsupported family, rope type or math-changing key by name, here,
            # before any replica starts (a replica would only fail while loading).
            mcfg = ModelConfig.from_dict(hf)
            if mcfg.linear is not None:
                # Gated DeltaNet shards by key heads (value heads and states follow them);
                # its state travels with the KV, re-sharded (workers/kv_transfer/states.py).
                lin = mcfg.linear
                for role, tp in (("prefill", self.prefill.tp_size),
                                 ("decode", self.decode.tp_size)):
                    if lin.num_key_heads % tp or lin.num_value_heads % tp:
                        raise ValueError(
                            f"{role}.tp_size={tp} must divide the hybrid model's "
                            f"{lin.num_key_heads} linear key heads and "
                            f"{lin.num_value_heads} linear value heads")
            heads = hf.get("num_attention_heads")
            kv_heads = hf.get("num_key_value_heads", heads)
            for role, tp in (("prefill", self.prefill.tp_size), ("decode", self.decode.tp_size)):
                # TP above the KV heads replicates them (one KV head per rank, as vLLM does).
                if kv_heads and kv_heads % tp and tp % kv_heads:
                    raise ValueError(
                        f"{role}.tp_size={tp} must divide the model's {kv_heads} KV heads or "
                        f"be a multiple of them (each rank then holds one replicated KV head)"
                    )
                if heads and heads % tp:
                    raise ValueError(
                        f"{role}.tp_size={tp} must divide the model's {heads} attention heads"
                    )
            dv = self.speculation.draft_vocab_size
            if dv is not None:
                from mtpserve.workers.spec_decode.draft_vocab import draft_token_ids

                draft_token_ids(self.model, dv, hf.get("vocab_size", dv))  # raises with the fix
            # MTP modules under every published convention (num_nextn_predict_layers,
            # mtp_num_hidden_layers: Qwen3-Next's `mtp.*`), as the loader counts them.
            if mcfg.num_mtp_modules == 0 and self.speculation.num_speculative_tokens > 0:
                raise ValueError(
                    "speculation.num_speculative_tokens > 0 but the model has no MTP module "
                    "(num_nextn_predict_layers / mtp_num_hidden_layers = 0)"
                )
        return self
