"""mtpserve: LLM serving with MTP speculative decoding and disaggregated prefill/decode on Ray
Serve. The repository's top-level folders are this package's subpackages (`mtpserve.workers`,
`mtpserve.router`, `mtpserve.cluster`, `mtpserve.benchmarks`); the embedded default model and
the Serve configs ship inside it (`models/`, `configs/`). See docs/architecture.md."""

__version__ = "0.1.0"
