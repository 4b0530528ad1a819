"""Small types the serving path's deployments share, kept apart so that a replica imports only what it uses.

The ingress and the engines need these of the router, not the router itself
(its refit imports scikit-learn).
"""

from __future__ import annotations

from dataclasses import dataclass


class LineOff(RuntimeError):
    """The router takes Ray actor calls only (``serving.router_tcp: false``)."""


@dataclass(frozen=True)
class RouterOptions:
    """What the router takes from the app's ``serving`` section (``ServingConfig.router_options``)."""

    refit_every_steps: int = 0
    """Refit the step-latency model every N reported steps (0: never)."""
    handoff_ttl_s: float = 30.0
    """Count a prefill-routed request on its decode node until that node takes it, or this long."""
    tcp_line: bool = True
    """Take decisions and reports on a TCP line (``serve.wire``) besides Ray actor calls."""
    shard: int = 0
    """This router's shard number (``serving.router_shards``; ``core.shards``)."""
    shards: int = 1
    """How many router shards the app runs: each decides on the decode nodes it owns among the live ones."""
    group_profiles: tuple[tuple[str, str], ...] = ()
    """(node group name, step-latency profile) of each node group with a profile of its own (``PoolConfig.profile``):
    the router prices those nodes with it; the others with the predictor's."""
