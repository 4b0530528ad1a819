"""Router shards: which shard owns a decode node, which shard a request asks, and what sharding cost a decision.

The paper's router is central; a fleet of hundreds of decode nodes may divide
them among S router shards. Each shard decides on every prefill node (their
view is shared) and on its own decode nodes only, with its own exact ledger,
so Algorithm 1 runs unchanged on a smaller cluster. A node's owner is chosen
by dealing the nodes, in the order of a hash of their ids, to the live shards
in turn (``assign``): every process computes the same owners from the node
ids and the set of live shards alone, and every shard owns an equal share of
the nodes (one more or less), so a fleet of as many nodes as shards leaves no
shard without one. When a shard dies, or a node comes or goes, owners are
dealt again: every shard keeps every node's state, so a node that changes
shard brings nothing along. Requests go to the shards in turn, so each sees
an equal share of the traffic for an equal share of the nodes.

A shard cannot see a better node in another shard: ``kept_from_better``
tells, for one request, whether the decision over the whole fleet would have
given it an earlier estimated first token (or admitted what the shard shed).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from kairos_ray.core.state import Decision

TIE_S = 1e-9  # estimated first tokens closer than this are the same (float noise of the same node's price)


def _rank(node_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(node_id.encode(), digest_size=8).digest(), "big")


def assign(node_ids: Iterable[str], shards: Iterable[int]) -> dict[str, int]:
    """Each decode node's shard among ``shards`` (the live ones' numbers): the nodes in the order of a hash of
    their ids, dealt to the shards in turn, so every shard owns N / S nodes, rounded either way (none is left
    without a node while there are as many nodes as shards), and every process given the same nodes and live
    shards computes the same owners."""
    live = sorted(shards)
    if not live:
        raise ValueError("no live shard")
    ordered = sorted(node_ids, key=lambda node: (_rank(node), node))
    return {node: live[i % len(live)] for i, node in enumerate(ordered)}


def shard_for(sequence: int, shards: Sequence[int]) -> int:
    """The shard a request asks: the ``sequence``-th request goes to the shards (those owning nodes) in turn."""
    if not shards:
        raise ValueError("no shard owns a decode node")
    return shards[sequence % len(shards)]


def first_token_s(decision: Decision) -> float | None:
    """The decision's estimated TTFT on its route (Eq. 6 when deflected, Eq. 1 on the prefill path)."""
    return decision.ttft_decode_s if decision.deflected else decision.ttft_prefill_s


def kept_from_better(shard: Decision, fleet: Decision) -> bool:
    """Whether the whole fleet's decision beats the shard's for the same request on the same state: it admits
    what the shard sheds, or its estimated first token comes earlier."""
    if shard.shed or fleet.shed:
        return shard.shed and not fleet.shed
    mine, best = first_token_s(shard), first_token_s(fleet)
    if best is None:
        return False
    return mine is None or best < mine - TIE_S
