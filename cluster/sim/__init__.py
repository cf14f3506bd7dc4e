"""A calibrated discrete-event simulator of the disaggregated cluster that runs the real
autoscaling policies (issue 19). Ray-free: nothing here imports Ray at module level, and only
`policies._ray_default_policy` / `policies._ray_context` import it, to call Serve's own default
policy with a real context (tests/test_sim.py enforces both).

| module | concept |
|---|---|
| `events` | the event queue (deterministic tie-breaking) |
| `hardware`, `model_arch` | accelerators (sim_data/hardware.json); HF config.json shapes |
| `replica_models` | replica cost: fitted profile of our engine, or the roofline |
| `profile` | `mtpserve sim profile`: fit a profile JSON on our engine |
| `workloads` | scenarios: arrivals, acceptance mix, length distributions |
| `requests`, `lifecycle` | one request's record; a replica's states |
| `prefill_replica`, `decode_replica` | the engines' scheduling at the model's cost |
| `metrics_store`, `serve_port` | Serve's controller view and its policy wrapper, ported |
| `policies`, `slo_planner` | mtpserve / Serve default / Dynamo-style planner |
| `config`, `cluster` | what a run is; the simulation itself |
| `cpu` | co-located replicas sharing a CPU host's cores (off at GPU scale) |
| `results`, `plot`, `cli` | JSON, PNG and `mtpserve sim ...` |
"""
