"""Scale-out on Ray Serve: N replicas of the app, each with its own `Runner`, behind Ray's router.

Each replica is an actor that calls `load()` (a picklable callable returning a `ServedModel`) in
its own process and serves `create_app(model, config)` through `serve.ingress` (the app is built
on the replica, after its model is loaded). Ray Serve's proxy routes every HTTP request to a
replica; a replica takes at most `max_batch + max_queue` requests at once (`max_ongoing_requests`:
its slots and its own waiting queue); when every replica is that full, Ray's router holds up to
`max_queue` more and answers 429 beyond (Ray's backpressure), so nothing queues without bound.

Importing this module imports Ray; only `blockpilot serve --ray` and its test do.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Callable

from ray import serve
from ray.serve.config import BackpressureConfig

from blockpilot.serving.app import ServedModel, ServerConfig, create_app

APP_NAME = "blockpilot"


@serve.ingress()
class BlockPilotReplica:
    """One replica: loads its model in `__init__`; Ray then serves the app this builds."""

    def __init__(self, load: Callable[[], ServedModel], config: ServerConfig):
        self._app = create_app(load(), config)

    def __serve_build_asgi_app__(self):
        return self._app


@dataclasses.dataclass(frozen=True)
class RayOptions:
    """Args:
        replicas: how many copies of the model serve requests.
        replica_cpus / replica_gpus: what Ray reserves for each replica (a GPU fleet: 1 GPU each).
        address: a running Ray cluster ("auto", "ray://host:10001"); None starts a local one.
        num_cpus: CPUs a local cluster may use (None: all).
    """

    replicas: int = 1
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    address: str | None = None
    num_cpus: int | None = None


def build_application(load: Callable[[], ServedModel], config: ServerConfig, options: RayOptions):
    """The Ray Serve application (`serve.run` it): `options.replicas` replicas of the app."""
    deployment = serve.deployment(
        BlockPilotReplica, name="BlockPilot", num_replicas=options.replicas,
        ray_actor_options={"num_cpus": options.replica_cpus, "num_gpus": options.replica_gpus},
        max_ongoing_requests=config.max_batch + config.max_queue,
        max_queued_requests=config.max_queue,
        backpressure_config=BackpressureConfig(status_code=429),
        graceful_shutdown_timeout_s=config.drain_timeout_s,
    )
    return deployment.bind(load, config)


def start(load: Callable[[], ServedModel], config: ServerConfig, options: RayOptions, *, host: str,
          port: int) -> None:
    """Connect to (or start) Ray, start Serve's HTTP proxy on `host:port` and deploy the replicas;
    returns once every replica has loaded its model."""
    connect(options)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_application(load, config, options), name=APP_NAME, route_prefix="/")


def connect(options: RayOptions) -> None:
    """Connect to the cluster at `options.address`, or start a local one (no-op when connected)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage reports from a local cluster
    if not ray.is_initialized():
        ray.init(address=options.address, num_cpus=options.num_cpus if options.address is None else None,
                 include_dashboard=False, log_to_driver=False)


def stop() -> None:
    """Shut Serve down (each replica drains its requests, up to `graceful_shutdown_timeout_s`)
    and disconnect from Ray (a local cluster stops)."""
    import ray

    serve.shutdown()
    ray.shutdown()


def serve_until_signal(load: Callable[[], ServedModel], config: ServerConfig, options: RayOptions, *,
                       host: str, port: int) -> None:
    """`start`, then block until SIGTERM or SIGINT, then `stop`.

    The handlers go in after `ray.init`, which installs Ray's own SIGTERM handler (it aborts the
    process); a signal during the deployment stops the server once the deployment is done.
    """
    stopping = threading.Event()
    previous = {}
    try:
        connect(options)
        previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        start(load, config, options, host=host, port=port)
        while not stopping.wait(1.0):  # a timed wait lets the main thread run the signal handlers
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop()
