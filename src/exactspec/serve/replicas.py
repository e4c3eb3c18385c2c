"""`exactspec serve --replicas N`: N copies of the server behind one endpoint, with Ray Serve.

Each replica is a Ray actor running the whole FastAPI app of `exactspec.serve.app`: its own
models, its own engine thread and its own continuous batch. Ray Serve's HTTP proxy listens on
the one address and routes each request to a replica (the one with fewer requests in flight
of two picked at random), so the endpoint takes N batches' worth of traffic. Replicas share
nothing, so each request is decoded exactly as by a single server, and a request's seed
reproduces its output on whichever replica serves it.

Every response names its replica in the `x-exactspec-replica` header (Ray Serve's replica id).
The replicas split the CPUs Ray was given: each reserves CPUS / N of them and runs torch with
that many threads (at least one).

Ray is an optional extra (``pip install 'exactspec[ray]'``); importing this module does not
import it.
"""
from __future__ import annotations

import os
import socket

from exactspec.serve.app import ServeConfig, create_app

REPLICA_HEADER = "x-exactspec-replica"
APP_NAME = "exactspec"


def check_ray() -> None:
    """Raise ModuleNotFoundError, naming the extra, when Ray Serve is not installed."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(f"--replicas needs Ray Serve ({err.name} is missing): "
                                  "pip install 'exactspec[ray]'", name=err.name) from None


class _NameReplica:
    """ASGI middleware adding the replica's name to every HTTP response's headers."""

    def __init__(self, app, name: str):
        self.app, self.header = app, (REPLICA_HEADER.encode(), name.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        return await self.app(scope, receive, send_named)


class ReplicaServer:
    """One replica: the server app for `config`, built in the replica's own process."""

    def __init__(self, config: ServeConfig, threads: int):
        import torch

        torch.set_num_threads(threads)
        self.config = config

    def __serve_build_asgi_app__(self):
        from ray import serve

        app = create_app(self.config, load_in_background=False)  # ready means loaded
        app.add_middleware(_NameReplica, name=serve.get_replica_context().replica_id.unique_id)
        return app


def free_port(host: str) -> int:
    """A port free on `host` now (Ray's proxy cannot be given port 0)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def start(config: ServeConfig, replicas: int, *, host: str = "127.0.0.1", port: int = 8000,
          num_cpus: int | None = None) -> str:
    """Start a local Ray instance (no dashboard) with `num_cpus` CPUs (default: all), Ray Serve's
    proxy on host:port (0: a free port), and `replicas` copies of the server; return the
    endpoint's URL once every replica has loaded its models (a replica counts as started for
    Ray Serve only then, so no request meets one still loading)."""
    check_ray()
    import ray
    from ray import serve

    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
    cpus = num_cpus or os.cpu_count() or 1
    port = port or free_port(host)
    ray.init(num_cpus=cpus, include_dashboard=False, ignore_reinit_error=True,
             configure_logging=False, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    deployment = serve.deployment(
        serve.ingress()(ReplicaServer), name="server", num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus / replicas},
        max_ongoing_requests=config.max_batch + config.max_queue)
    serve.run(deployment.bind(config, max(1, cpus // replicas)), name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}"


def stop() -> None:
    """Stop the replicas, Ray Serve and the local Ray instance."""
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
