"""Shared by the tests that start a real local Ray cluster and Serve: a free loopback port, the
cluster itself (started and always stopped), and calls to one given replica."""

from __future__ import annotations

import contextlib
import pickle
import socket
import uuid
from collections.abc import Iterator

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
