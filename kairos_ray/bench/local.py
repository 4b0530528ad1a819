"""A local Ray with Serve for the live scripts and the app's tests: ``local_serve()``, ``free_port()``."""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Iterator

import ray
from ray import serve

from kairos_ray.serve import REQUEST_TIMEOUT_S, use_cluster_env

# Where ``free_port`` looks: above Ray's worker ports (10002-19999 by default) and below the kernel's
# ephemeral ports (32768-60999 on Linux), from which every socket bound to port 0 gets one, Ray's own
# components' included. A port the kernel handed out as free could be taken by one of those before its
# user binds it (a Ray dashboard given such a port once failed to start); one from here cannot.
FREE_PORTS = range(20000, 32768)


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now, from ``FREE_PORTS``."""
    for port in random.sample(FREE_PORTS, 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken
                continue
            return port
    raise OSError(f"no free port among 64 tried in {FREE_PORTS.start}-{FREE_PORTS.stop - 1}")


@contextlib.contextmanager
def local_serve(
    *,
    num_cpus: int = 2,
    dashboard_port: int | None = None,
    metrics_port: int | None = None,
    log_to_driver: bool = True,
) -> Iterator[str]:
    """Serve's base URL on 127.0.0.1 of a fresh Ray of this process's own; both are shut down afterwards.

    Ray starts with ``kairos_ray.serve.CLUSTER_ENV`` and the two node groups'
    resources (``prefill_node``, ``decode_node``: 2 each); with
    ``dashboard_port`` its dashboard listens there on 127.0.0.1, with
    ``metrics_port`` its metrics page.
    """
    port = free_port()
    use_cluster_env()
    ray.init(
        address="local",  # a Ray of its own, even where `ray start` runs another on this machine
        num_cpus=num_cpus,
        resources={"prefill_node": 2, "decode_node": 2},
        include_dashboard=dashboard_port is not None,
        dashboard_host="127.0.0.1",
        dashboard_port=dashboard_port,
        _metrics_export_port=metrics_port,
        log_to_driver=log_to_driver,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port, "request_timeout_s": REQUEST_TIMEOUT_S})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
