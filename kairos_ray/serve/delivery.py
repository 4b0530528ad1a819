"""Delivery of each call to the replica the Kairos router chose (Serve's request-router hook; the decision is
``serve.router``'s).

A pool (prefill or decode) is one deployment whose replicas are the pool's
nodes; a node's id is ``<role>-<replica unique id>``. Calls carry the chosen
node as the ``node`` keyword; ``ChosenNodeRouter`` ranks that replica first. A
call with no node (a fallback decision), or for a node that is gone (scaled
down, replaced), may go to any replica but those in the ``avoid`` keyword
(nodes that failed this request), so no request is lost while replicas come
and go.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


def replica_of(node_id: str) -> str:
    """The replica unique id inside a node id."""
    return node_id.split("-", 1)[-1]


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
