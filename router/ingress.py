"""The HTTP ingress deployment: the OpenAI API (router.api) over the disaggregated
orchestrator. Tokenization happens here, once per request."""

from __future__ import annotations

import os
from pathlib import Path

from ray import serve

from cluster.config import ClusterConfig
from router.orchestrator import DisaggOrchestrator


@serve.deployment(name="OpenAIIngress")
@serve.ingress()
class OpenAIIngress:
    def __init__(self, prefill, decode, cfg: ClusterConfig) -> None:
        from workers.model.config import ModelConfig
        from workers.tokenizer import load_tokenizer

        self.cfg = cfg
        self.orchestrator = DisaggOrchestrator(prefill, decode, cfg.request_timeout_s)
        self.tokenizer = load_tokenizer(cfg.model)
        mcfg = ModelConfig.from_pretrained(cfg.model)
        self.max_model_len = min(cfg.max_model_len or mcfg.max_position_embeddings,
                                 mcfg.max_position_embeddings)
        # The key may come from a Kubernetes Secret, only present in the pods' environment.
        self.api_key = cfg.auth.api_key or (
            os.environ.get(cfg.auth.api_key_env) if cfg.auth.api_key_env else None)
        self.model_name = cfg.served_model_name or Path(cfg.model).name

    def __serve_build_asgi_app__(self):
        from router.api import IngressState, create_app

        return create_app(IngressState(
            orchestrator=self.orchestrator, tokenizer=self.tokenizer,
            model_name=self.model_name, max_model_len=self.max_model_len,
            api_key=self.api_key,
        ))
