"""Delivery of each pool call to the node the router chose (``serve.delivery``), on stand-in replicas."""

import asyncio
import contextvars
import types

import pytest

from kairos_ray.serve.delivery import ChosenNodeRouter, NodeGroups, apart, replica_of

REPLICAS = [types.SimpleNamespace(replica_id=types.SimpleNamespace(unique_id=u)) for u in ("aaaa", "bbbb", "cccc")]


def chosen(**kwargs) -> list[str]:
    """The replicas ``ChosenNodeRouter`` ranks first for a call with these keywords."""
    router = ChosenNodeRouter.__new__(ChosenNodeRouter)  # its choice alone: no Serve router state behind it
    pending = types.SimpleNamespace(kwargs=kwargs)
    (ranked,) = asyncio.run(router.choose_replicas(REPLICAS, pending))
    return [r.replica_id.unique_id for r in ranked]


def test_a_call_goes_to_the_node_it_names():
    assert chosen(node="decode-bbbb") == ["bbbb"]
    assert replica_of("decode-bbbb") == "bbbb"


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"node": "decode-gone", "avoid": ("decode-aaaa",)}, ["bbbb", "cccc"]),  # a node that left: any but the failed
        ({"avoid": ("decode-aaaa", "decode-cccc")}, ["bbbb"]),  # a fallback call: any the request did not fail on
        ({"avoid": ("decode-aaaa", "decode-bbbb", "decode-cccc")}, ["aaaa", "bbbb", "cccc"]),  # none left: any at all
    ],
)
def test_a_call_for_no_node_or_a_gone_one_avoids_the_nodes_that_failed_its_request(kwargs, expected):
    assert chosen(**kwargs) == expected


def test_a_call_made_apart_runs_outside_the_callers_context():
    marker = contextvars.ContextVar("serve_request", default="none")
    marker.set("the current request")
    assert apart(lambda: marker.get()) == "none"  # Serve gives such a call a request id of its own
    assert marker.get() == "the current request"


def test_a_node_is_reached_through_its_own_groups_handle_and_a_call_for_no_node_through_any_group():
    first, second = object(), object()
    groups = NodeGroups([first, second])  # type: ignore[list-item]
    assert groups.of("decode-aaaa") is first and groups.of("decode-1-aaaa") is second
    drawn = {id(groups.of(node)) for node in (None, "", "Router", "decode-7-aaaa") for _ in range(20)}
    assert drawn == {id(first), id(second)}  # a group drawn at random, never an error
    with pytest.raises(ValueError, match="at least one"):
        NodeGroups([])
