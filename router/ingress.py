"""The HTTP ingress deployment: the OpenAI API (router.api) over the disaggregated
orchestrator. Tokenization happens here, once per request.

Fails closed: a configured `auth.*_env` variable that is missing or empty raises here, so the
replica (and the deployment) does not start without the auth the operator asked for.
`drain()` (called by `mtpserve up` on SIGTERM) stops taking requests; `num_inflight()` says
when the running ones are done. Serve's own scale-down drain is `graceful_shutdown_timeout_s`.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from ray import serve

from mtpserve.cluster.config import ClusterConfig
from mtpserve.router.limits import Limits
from mtpserve.router.orchestrator import DisaggOrchestrator, OrchestratorConfig
from mtpserve.router.tools import served_format


@serve.deployment(name="OpenAIIngress")
@serve.ingress()
class OpenAIIngress:
    def __init__(self, prefill, decode, cfg: ClusterConfig) -> None:
        from mtpserve.workers.model.config import ModelConfig
        from mtpserve.workers.tokenizer import load_tokenizer

        self.cfg = cfg
        # Before anything slow: a missing key must fail the deployment, not open the API.
        self.api_key, self.admin_api_key = cfg.auth.resolve(os.environ)
        # Calls to prefill and decode (and each streamed decode chunk) go over Serve's
        # inter-deployment gRPC rather than as Ray actor tasks. Measured together with the
        # proxy hop on gRPC (`mtpserve up`'s RAY_ENV): one served stream 242 -> 272 tok/s
        # (guidellm c1, warm cache, seven runs each, taking turns); the proxy hop alone gained
        # nothing measurable.
        self.orchestrator = DisaggOrchestrator(prefill.options(_by_reference=False),
                                               decode.options(_by_reference=False),
                                               OrchestratorConfig.of(cfg))
        self.tokenizer = load_tokenizer(cfg.model)
        mcfg = ModelConfig.from_pretrained(cfg.model)
        self.max_model_len = min(cfg.max_model_len or mcfg.max_position_embeddings,
                                 mcfg.max_position_embeddings)
        self.vocab_size = mcfg.vocab_size
        self.model_type = mcfg.model_type
        self.tool_call_parser = served_format(cfg.tool_call_parser, self.tokenizer,
                                              mcfg.model_type)
        self.model_name = cfg.served_model_name or Path(cfg.model).name
        self._app = None
        self._stop_push = _push_counters(self.orchestrator)

    def __serve_build_asgi_app__(self):
        from mtpserve.router.api import IngressState, create_app
        from mtpserve.router.structured import preload_healing
        from mtpserve.workers.structured.healing import model_default

        lim = self.cfg.limits
        self._app = create_app(IngressState(
            orchestrator=self.orchestrator, tokenizer=self.tokenizer,
            model_name=self.model_name, max_model_len=self.max_model_len,
            api_key=self.api_key, admin_api_key=self.admin_api_key,
            vocab_size=self.vocab_size,
            limits=Limits(max_tokens=lim.max_tokens, max_n=lim.max_n,
                          max_prompt_tokens=lim.max_prompt_tokens,
                          max_request_bytes=lim.max_request_bytes,
                          max_concurrent_requests=lim.max_concurrent_requests,
                          retry_after_s=lim.retry_after_s),
            enable_kv_probe=self.cfg.admin.enable_kv_probe,
            kv_probe_max_bytes=self.cfg.admin.kv_probe_max_bytes,
            token_healing=model_default(self.cfg.model),
            tool_call_parser=self.tool_call_parser,
            reasoning_parser=self.cfg.reasoning_parser, model_type=self.model_type,
        ))
        preload_healing(self._app.state.ingress)
        return self._app

    def drain(self) -> int:
        """Refuse new requests from now on (503, /health 503); returns those still running."""
        if self._app is None:
            return 0
        self._app.state.gate.draining = True
        return self._app.state.gate.num_inflight

    def num_inflight(self) -> int:
        return 0 if self._app is None else self._app.state.gate.num_inflight


def _push_counters(orchestrator: DisaggOrchestrator, interval_s: float = 1.0
                   ) -> threading.Event:
    """Push this ingress replica's orchestrator counters to the metrics hub every second, as
    a snapshot of role "ingress": the ingress keeps no state that needs it to be the only one,
    /metrics and the stats endpoint sum the counters over ingress replicas."""
    import ray

    from mtpserve.workers.replica.metrics import hub, replica_key

    stop = threading.Event()
    key = orchestrator.replica_key = replica_key("ingress")

    def loop() -> None:
        while not stop.wait(interval_s):
            try:
                hub().push.remote({"replica": key, "role": "ingress", "time": time.time(),
                                   "counters": orchestrator.counters(), "per_pos": [],
                                   "hists": {}, "gauges": {}})
            except Exception:  # monitoring must never take the ingress down
                if not ray.is_initialized():
                    return

    threading.Thread(target=loop, name="ingress-metrics-push", daemon=True).start()
    return stop
