"""Router shards (``core.shards``): who owns a decode node, which shard a request asks, and what a shard missed."""

import pytest

from kairos_ray.core import Admission, Decision, Route, ShedReason
from kairos_ray.core.shards import assign, kept_from_better, shard_for

NODES = [f"decode-{i:04x}" for i in range(1200)]


def test_nodes_are_dealt_evenly_the_same_way_everywhere_and_a_dead_shards_go_to_the_others():
    live = [0, 1, 2, 3]
    owners = assign(NODES, live)
    counts = [sum(1 for o in owners.values() if o == shard) for shard in live]
    assert sorted(owners) == sorted(NODES) and counts == [300] * 4  # each node once, an equal share each
    assert assign(reversed(NODES), reversed(live)) == owners  # in whatever order the nodes and shards are listed
    after = assign(NODES, [0, 1, 3])  # shard 2 died
    assert sorted(sum(1 for o in after.values() if o == shard) for shard in (0, 1, 3)) == [400] * 3
    assert assign(NODES[:3], live)[NODES[0]] != assign(NODES[:3], live)[NODES[1]]  # fewer nodes: one each
    assert set(assign(NODES[:2], [0, 1]).values()) == {0, 1}  # as many nodes as shards: none left without one
    assert assign(NODES[:1], [0, 1])[NODES[0]] in (0, 1)
    with pytest.raises(ValueError, match="no live shard"):
        assign(NODES, [])


def test_requests_ask_the_shards_in_turn():
    assert [shard_for(i, [0, 2, 3]) for i in range(6)] == [0, 2, 3, 0, 2, 3]
    with pytest.raises(ValueError, match="no shard"):
        shard_for(0, [])


def decision(route: Route, ttft_prefill_s: float | None, ttft_decode_s: float | None, shed: bool = False) -> Decision:
    verdict = Admission(False, ShedReason.NO_ROUTE_IN_TIME, 9.0, 4.0, 1.0) if shed else None
    return Decision(route, "prefill-a", "decode-a", (), ttft_prefill_s, ttft_decode_s, "", admission=verdict)


@pytest.mark.parametrize(
    "shard, fleet, kept",
    [
        (decision(Route.PREFILL, 2.0, 3.0), decision(Route.DEFLECT, 2.0, 1.5), True),  # a faster node elsewhere
        (decision(Route.DEFLECT, 2.0, 1.5), decision(Route.DEFLECT, 2.0, 1.5), False),  # the same first token
        (decision(Route.DEFLECT, 2.0, 1.5), decision(Route.DEFLECT, 2.0, 1.5 - 1e-12), False),  # a float tie
        (decision(Route.DEFLECT, 2.0, 1.5), decision(Route.PREFILL, 1.2, 1.9), True),  # the prefill path: 1.2 s
        (decision(Route.PREFILL, 1.0, None), decision(Route.PREFILL, 1.0, None), False),
        (decision(Route.PREFILL, 9.0, None, shed=True), decision(Route.PREFILL, 3.0, None), True),  # admitted there
        (decision(Route.PREFILL, 9.0, None, shed=True), decision(Route.PREFILL, 9.0, None, shed=True), False),
        (decision(Route.PREFILL, 3.0, None), decision(Route.PREFILL, 1.0, None, shed=True), False),
    ],
)
def test_a_shard_kept_a_request_from_a_better_node_only_when_the_fleet_would_serve_it_sooner(shard, fleet, kept):
    assert kept_from_better(shard, fleet) is kept
