"""Delivery of each call to the replica the Kairos router chose (Serve's request-router hook; the decision is
``serve.router``'s).

A pool (prefill or decode) is one deployment whose replicas are the pool's
nodes; a node's id is ``<role>-<replica unique id>``. Calls carry the chosen
node as the ``node`` keyword; ``ChosenNodeRouter`` ranks that replica first. A
call with no node (a fallback decision), or for a node that is gone (scaled
down, replaced), may go to any replica but those in the ``avoid`` keyword
(nodes that failed this request), so no request is lost while replicas come
and go.

Each call to a pool is made as a request of its own (``apart``). A call made
inside a Serve request inherits that request's ``internal_request_id``, and
Serve's request router (Ray 2.60) indexes the calls waiting for a replica by
that id: of two calls of one request waiting at once on one deployment (a
``cancel`` to a dead node still being routed when the migration's ``start``
comes), only the first is indexed. The other can never be given its
replica, and its routing task loops without yielding, which stalls every
call of that process's handles.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kairos_ray.messages import NodeId

P = ParamSpec("P")
T = TypeVar("T")


def apart(remote: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``remote(*args, **kwargs)`` (a handle method's ``remote``) outside the current Serve request's context.

    Serve then gives the call an ``internal_request_id`` of its own, and no
    other call of the same request can hide it from the request router.
    """
    return contextvars.Context().run(remote, *args, **kwargs)


def replica_of(node_id: str) -> str:
    """The replica unique id inside a node id ("" for a string that is none: no replica has that id)."""
    try:
        return NodeId.parse(node_id).replica
    except ValueError:
        return ""


class ChosenNodeRouter(RequestRouter):
    """The replica the call's ``node`` names; else any replica not in ``avoid`` (any at all if none is left)."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        wanted = kwargs.get("node")
        if wanted:
            unique = replica_of(wanted)
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == unique]
            if chosen:
                return [chosen]
        avoided = {replica_of(node) for node in kwargs.get("avoid") or ()}
        return [[r for r in candidate_replicas if r.replica_id.unique_id not in avoided] or candidate_replicas]
