"""Shared by the tests that start a real local Ray cluster and Serve: a free loopback port, the
cluster itself (started and always stopped), and calls to one given replica."""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import uuid
from collections.abc import Iterator

from mtpserve.cluster.cli_serve import RAY_ENV

APP = "mtpserve"


def free_port() -> int:
    """A free loopback port (other modules' clusters may have used the usual ones)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_serve(num_cpus: int = 4) -> Iterator[str]:
    """A local Ray cluster with Serve's proxy on a free loopback port; yields the base URL.
    Logical CPUs: engine ranks ask for 0.5 CPU each and share the real cores."""
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


# Set while the shared cluster starts, so its raylet and every replica inherit it: test_reliability
# injects faults into its replicas; the other modules' apps never call the injection methods.
# The shared cluster's replicas run as `mtpserve up` and the chart run them: our code and
# Serve's router on the replica's main event loop (cluster/cli_serve.py RAY_ENV), so the
# fault tests (killed replicas, migration) cover that mode.
SHARED_ENV = {"MTPSERVE_ENABLE_FAULT_INJECTION": "1",
              **{k: RAY_ENV[k] for k in ("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD",
                                         "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP")}}


class SharedServe:
    """One local Ray cluster with Serve for the whole session (conftest's `shared_serve`),
    started by its first user: a cluster start costs 15-25 s on 2 shared cores, and the
    modules of the same shape (4 logical CPUs, one driver) each deploy their own app on it.
    A module that needs another shape (test_multinode) shuts Ray down; the next user here
    starts the cluster again."""

    def __init__(self) -> None:
        self._cm: contextlib.AbstractContextManager[str] | None = None
        self._url = ""
        self._gcs = ""

    def _ours(self) -> bool:
        import ray

        return (self._cm is not None and ray.is_initialized()
                and ray.get_runtime_context().gcs_address == self._gcs)

    def url(self) -> str:
        """The base URL of Serve's proxy, no application deployed (a module's leftovers are
        deleted, so each module starts from the same empty cluster)."""
        import ray
        from ray import serve

        if self._ours():
            for name in list(serve.status().applications):
                serve.delete(name)
            return self._url
        self._cm = None
        if ray.is_initialized():  # someone else's cluster, or Ray auto-started in-process
            ray.shutdown()
        saved = {k: os.environ.get(k) for k in SHARED_ENV}
        os.environ.update(SHARED_ENV)
        try:
            cm = local_serve()
            self._url = cm.__enter__()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self._cm, self._gcs = cm, ray.get_runtime_context().gcs_address
        return self._url

    def stop(self) -> None:
        if self._ours():
            self._cm.__exit__(None, None, None)
        self._cm = None


def replica_actors(deployment: str, app: str = APP) -> dict[str, object]:
    """Replica id -> actor handle of one deployment's live replicas."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return {a["name"][len(prefix):]: ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


def call_replica(actor, method: str, *args, app: str = APP, **kwargs):
    """Call a user method on one given replica (a handle would pick the replica itself). Uses
    Serve's replica entry point with its request metadata: a private API, tests only."""
    import ray
    from ray.serve._private.common import RequestMetadata

    rid = uuid.uuid4().hex
    meta = RequestMetadata(request_id=rid, internal_request_id=rid, call_method=method,
                           app_name=app)
    return ray.get(actor.handle_request.remote(pickle.dumps(meta), *args, **kwargs),
                   timeout=60)
