"""One local Ray with Serve for the test modules that serve apps, started by the first that needs it.

It is this pytest process's own: ``make test``'s two live runs each start theirs, on ports of their own.

Starting Ray and Serve, and shutting them down, costs tens of seconds on two
cores: the modules that deploy apps (``tests/serve/conftest.running_app``)
share one cluster, each deleting its apps when it is done. A module that needs
a Ray of its own (other resources, several nodes) calls ``stop()`` first; the
next module to serve an app starts the shared one again. The session's end
stops it (``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from kairos_ray.bench.local import free_port, local_serve


@dataclass(frozen=True)
class Cluster:
    url: str  # Serve's HTTP proxy
    metrics_url: str  # this node's Prometheus page (ray_* series)
    dashboard_url: str  # Ray's dashboard (serve status, ray list, its Serve page)


_stack: contextlib.ExitStack | None = None
_cluster: Cluster | None = None


def start() -> Cluster:
    """The shared cluster, started if it is not running."""
    global _stack, _cluster
    if _cluster is None:
        stack = contextlib.ExitStack()
        metrics_port, dashboard_port = free_port(), free_port()
        url = stack.enter_context(local_serve(dashboard_port=dashboard_port, metrics_port=metrics_port))
        _stack, _cluster = (
            stack,
            Cluster(url, f"http://127.0.0.1:{metrics_port}/metrics", f"http://127.0.0.1:{dashboard_port}"),
        )
    return _cluster


def stop() -> None:
    """Shut the shared cluster down, if it runs (Serve and Ray)."""
    global _stack, _cluster
    stack, _stack, _cluster = _stack, None, None
    if stack is not None:
        stack.close()
