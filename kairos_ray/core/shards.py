"""Router shards: which shard owns a decode node, which shard a request asks, and what sharding cost a decision.

The paper's router is central; a fleet of hundreds of decode nodes may divide
them among S router shards. Each shard decides on every prefill node (their
view is shared) and on its own decode nodes only, with its own exact ledger,
so Algorithm 1 runs unchanged on a smaller cluster. A node's owner is chosen
by rendezvous (highest random weight) hashing of its id over the live shards:
every process computes the same owner from the node id and the set of live
shards alone, nodes spread evenly, and when a shard dies only its nodes move,
each to the live shard that ranks it next. Requests go to the shards that own
nodes in turn, so each sees an equal share of the traffic for an (about)
equal share of the nodes.

A shard cannot see a better node in another shard: ``kept_from_better``
tells, for one request, whether the decision over the whole fleet would have
given it an earlier estimated first token (or admitted what the shard shed).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from kairos_ray.core.state import Decision

TIE_S = 1e-9  # estimated first tokens closer than this are the same (float noise of the same node's price)


def _weight(node_id: str, shard: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{shard}/{node_id}".encode(), digest_size=8).digest(), "big")


def owner(node_id: str, shards: Iterable[int]) -> int:
    """The shard among ``shards`` (the live ones' numbers) that owns the decode node ``node_id``."""
    return max(shards, key=lambda shard: (_weight(node_id, shard), shard))


def owned(node_ids: Iterable[str], shard: int, shards: Iterable[int]) -> list[str]:
    """The nodes of ``node_ids`` that ``shard`` owns while ``shards`` are live, in their order."""
    live = tuple(shards)
    return [node for node in node_ids if owner(node, live) == shard]


class Owners:
    """``owner`` remembered per node and live set (a node's owner changes only when the live shards do), for a
    router that filters its view by it on every decision."""

    def __init__(self) -> None:
        self._by_live: dict[tuple[int, ...], dict[str, int]] = {}

    def of(self, node_id: str, live: tuple[int, ...]) -> int:
        """``owner(node_id, live)``; ``live`` sorted."""
        known = self._by_live.get(live)
        if known is None:
            known = self._by_live[live] = {}
        shard = known.get(node_id)
        if shard is None:
            shard = known[node_id] = owner(node_id, live)
        return shard

    def forget(self, node_id: str) -> None:
        """A node left: its entries go (nothing grows with the nodes that came and went)."""
        for known in self._by_live.values():
            known.pop(node_id, None)


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
