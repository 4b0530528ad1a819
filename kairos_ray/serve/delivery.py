"""Delivery of each call to the replica the Kairos router chose (Serve's request-router hook; the decision is
``serve.router``'s).

A node group is one deployment whose replicas are the group's nodes (a pool,
prefill or decode, has one group or several: ``NodeGroups``); a node's id is
``<group>-<replica unique id>`` (``messages.NodeId``). Calls go through the
handle of the group the node's id names and carry the chosen node as the
``node`` keyword; ``ChosenNodeRouter`` ranks that replica first. A
call with no node (a fallback decision: then to a group drawn at random), or
for a node that is gone (scaled down, replaced), may go to any replica but those in the ``avoid`` keyword
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
import random
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

from ray.serve.handle import DeploymentHandle
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


class NodeGroups:
    """A pool's deployments, one per node group, in the groups' order: the handle that reaches a node."""

    def __init__(self, handles: Sequence[DeploymentHandle[Any]]) -> None:
        if not handles:
            raise ValueError("a pool has at least one node group")
        self.handles = tuple(handles)

    def of(self, node_id: str | None) -> DeploymentHandle[Any]:
        """The handle of the group ``node_id`` names; with no node (or none of this pool's), a group's at random."""
        if node_id:
            try:
                group = NodeId.parse(node_id).group
            except ValueError:
                group = -1
            if 0 <= group < len(self.handles):
                return self.handles[group]
        return random.choice(self.handles)


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
