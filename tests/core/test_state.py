"""The ledger's one-pass rebuild of a node (``node_after``) against applying its decisions one by one."""

from __future__ import annotations

from dataclasses import replace
from functools import reduce

from hypothesis import given, settings
from hypothesis import strategies as st

from kairos_ray.core import (
    Admission,
    ClusterView,
    Decision,
    DecodeNodeView,
    PrefillNodeView,
    Route,
    ShedReason,
    apply_decision,
    node_after,
)

NODES = ("p0", "p1", "d0", "d1")


@st.composite
def decisions(draw: st.DrawFn) -> tuple[int, Decision, int]:
    """(prompt tokens, decision, output tokens): to a prefill node and a decode node, or deflected to a decode node;
    some of them shed by admission."""
    prompt = draw(st.integers(1, 20_000))
    cached = draw(st.sampled_from((0, 0, draw(st.integers(0, prompt)))))  # mostly cold
    decode = draw(st.sampled_from(("d0", "d1")))
    if draw(st.booleans()):
        schedule = tuple(draw(st.lists(st.integers(1, 2048), min_size=1, max_size=4)))
        decision = Decision(Route.DEFLECT, None, decode, schedule, None, 0.1, "test", cached_prompt_tokens=cached)
    else:
        prefill = draw(st.sampled_from(("p0", "p1")))
        held = draw(st.integers(0, prompt))
        decision = Decision(
            Route.PREFILL,
            prefill,
            decode,
            (),
            0.1,
            None,
            "test",
            cached_prompt_tokens=cached,
            receiver_cached_tokens=held,
        )
    if draw(st.integers(0, 3)) == 0:
        decision = replace(decision, admission=Admission(False, ShedReason.NO_ROUTE_IN_TIME, 9.0, 4.0, 5.0))
    return prompt, decision, draw(st.integers(0, 2048))


@st.composite
def reported(draw: st.DrawFn, node_id: str) -> PrefillNodeView | DecodeNodeView:
    """A node as its last report shows it, queues and cached prefixes included (or none)."""
    if node_id.startswith("p"):
        queue = tuple(draw(st.lists(st.integers(1, 9000), max_size=3)))
        cached = tuple(draw(st.lists(st.integers(0, 500), max_size=len(queue))))
        return PrefillNodeView(node_id, queue, draw(st.integers(0, 100)) if queue else 0, cached)
    committed = tuple(
        tuple(draw(st.lists(st.integers(1, 2048), min_size=1, max_size=3))) for _ in range(draw(st.integers(0, 2)))
    )
    cached = tuple(draw(st.lists(st.integers(0, 500), max_size=len(committed))))
    return DecodeNodeView(
        node_id,
        draw(st.integers(0, 64)),
        draw(st.integers(0, 100_000)),
        draw(st.integers(0, 1_000_000)),
        committed,
        committed_cached_tokens=cached,
        incoming_requests=draw(st.integers(0, 3)),
        incoming_kv_tokens=draw(st.integers(0, 20_000)),
        incoming_transfers=draw(st.integers(0, 3)),
        incoming_transfer_tokens=draw(st.integers(0, 20_000)),
    )


@settings(max_examples=300, deadline=None)
@given(st.data(), st.lists(decisions(), max_size=12))
def test_a_node_rebuilt_in_one_pass_equals_its_decisions_applied_one_by_one(data, decided):
    for node_id in NODES:
        node = data.draw(reported(node_id))
        alone = ClusterView((node,), ()) if isinstance(node, PrefillNodeView) else ClusterView((), (node,))
        folded = reduce(lambda view, d: apply_decision(view, d[0], d[1], d[2]), decided, alone)
        assert node_after(node, decided) == (folded.prefill or folded.decode)[0]


def test_a_handoff_counts_on_its_decode_node_with_what_its_link_carries_and_a_shed_one_nowhere():
    view = ClusterView((PrefillNodeView("p0"),), (DecodeNodeView("d0", 3, 1000, 50_000),))
    handoff = Decision(Route.PREFILL, "p0", "d0", (), 1.0, None, "test", receiver_cached_tokens=300)
    after = apply_decision(view, 1000, handoff, 100)
    assert after.prefill[0].queued_prompt_tokens == (1000,)
    assert (after.decode[0].incoming_requests, after.decode[0].incoming_kv_tokens) == (1, 1100)
    assert (after.decode[0].incoming_transfers, after.decode[0].incoming_transfer_tokens) == (1, 700)
    shed = replace(handoff, admission=Admission(False, ShedReason.PRIORITY, 1.0, 0.75, 1.0))
    assert shed.shed and apply_decision(view, 1000, shed, 100) == view
    deflect = Decision(Route.DEFLECT, None, "d0", (1000,), None, 1.0, "test")
    assert apply_decision(view, 1000, replace(deflect, admission=shed.admission), 100) == view


def test_a_node_no_decision_touches_is_returned_as_it_is():
    node = DecodeNodeView("d1", 3, 1000, 5000)
    deflected = Decision(Route.DEFLECT, None, "d0", (512,), None, 0.1, "test")
    assert node_after(node, [(512, deflected, 16)]) is node
