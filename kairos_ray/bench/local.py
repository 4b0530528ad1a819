"""A local Ray with Serve for the live scripts and the app's tests: ``local_serve()``, ``free_port()``."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import ray
from ray import serve

from kairos_ray.serve import use_cluster_env


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
