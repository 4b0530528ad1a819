"""SLO-aware admission and decode-side protection (``core.admission``), by hand and as properties.

The hand-computed cases use the model of ``strategies.SIMPLE``:
T = 0.01 + 0.001 B + chi * (1e-4 + 1e-7 K), so a decode step without a chunk
is 0.01 + 0.001 B and fits the budget of 0.0515 s up to B = 41.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kairos_ray.core import (
    AdmissionMode,
    AdmissionParams,
    ClusterView,
    Decision,
    DecodeNodeView,
    PolicyParams,
    PrefillNodeView,
    Route,
    ShedReason,
    StepLatencyModel,
    apply_decision,
    handoff_fits,
    handoff_ttft_s,
    join_guard,
    judge,
    kv_wait_s,
    make_policy,
)
from kairos_ray.core.admission import KV_WAIT_SIGMAS, _excess

from .strategies import SIMPLE, models, views

SHED = AdmissionParams(mode=AdmissionMode.SHED, ttft_slo_s=0.05, slack=1.0, retry_after_min_s=0.0)
SMALL = PolicyParams(prefill_chunk_tokens=200, chunk_candidates=(400, 200, 100), tbt_slo_s=0.0515, beta=1.0)
BUDGET_S = SMALL.tbt_budget_s
QUEUED = PrefillNodeView("p0", (300, 100))  # a prompt of 100 behind it: TTFT_pf = 0.092 s (test_policy)
IDLE = DecodeNodeView("d1", batch_size=0, kv_tokens=0, free_kv_tokens=10_000)
FULL = DecodeNodeView("d0", batch_size=50, kv_tokens=0, free_kv_tokens=10_000)  # T0 = 0.06: no chunk fits


def policy(spec="kairos", admission=SHED, alpha=1.0, **changes):
    return make_policy(spec, replace(SMALL, alpha=alpha, admission=admission, **changes), SIMPLE)


def test_a_request_in_time_on_one_decode_node_only_is_deflected_there_whatever_alpha():
    # the prefill path takes 0.092 s, then a decode step T(1, 100) = 0.011 s on d1: over the 0.05 s objective;
    # d0 is infeasible (Eq. 5), d1 takes it in T(0, 0, 100) = 0.02 s. alpha = 6 keeps it on the prefill node
    # under Algorithm 1 alone (0.12 >= 0.103)
    view = ClusterView((QUEUED,), (FULL, IDLE))
    assert policy(admission=AdmissionParams(), alpha=6).decide(100, view).route is Route.PREFILL
    decision = policy(alpha=6).decide(100, view)
    assert decision.route is Route.DEFLECT and decision.decode_node == "d1" and decision.chunk_schedule == (100,)
    assert decision.admission is not None and decision.admission.admitted and not decision.shed
    assert decision.admission.ttft_estimate_s == pytest.approx(0.02)
    assert decision.admission.threshold_s == pytest.approx(0.05)
    assert "in time" in decision.reason


def test_a_request_in_time_nowhere_is_shed_with_its_reason_and_when_to_retry():
    # both decode nodes run 50 requests: no chunk fits, and a hand-off waits for e = 50 - 41 = 9 of them and
    # itself to leave at 10 finishes/s, priced at its 95th percentile: (10 + 1.645 * sqrt(10)) / 10 = 1.5202 s;
    # then the hand-off's first decode step, T(51, 100) = 0.061 s (its link is unpriced here)
    busy = [replace(FULL, node_id=n, finished_per_s=10.0) for n in ("d0", "d1")]
    view = ClusterView((QUEUED,), tuple(busy))
    decision = policy().decide(100, view)
    wait_s = (10 + KV_WAIT_SIGMAS * math.sqrt(10)) / 10
    assert decision.route is Route.PREFILL and decision.kv_wait_s == pytest.approx(wait_s)
    assert decision.ttft_prefill_s == pytest.approx(wait_s + 0.061)
    assert decision.shed and decision.admission is not None
    assert decision.admission.reason is ShedReason.NO_ROUTE_IN_TIME
    assert decision.admission.retry_after_s == pytest.approx(wait_s + 0.061 - 0.05)  # drained to the threshold
    assert apply_decision(view, 100, decision) == view  # shed: nothing is dispatched


def test_priorities_order_the_shed_and_a_never_shed_class_queues():
    # deflected onto the idle node in 0.02 s; thresholds theta(p) = 0.025 * 0.75 ** p: 0.025, 0.01875, 0.0141
    admission = replace(SHED, ttft_slo_s=0.025, priority_reserve=0.25)
    view = ClusterView((QUEUED,), (IDLE,))
    kairos = policy(admission=admission)
    verdicts = {p: kairos.decide(100, view, priority=p).admission for p in (-1, 0, 1, 2)}
    assert all(v is not None for v in verdicts.values())
    assert verdicts[-1].admitted and verdicts[0].admitted  # more important than 0: 0's threshold
    assert verdicts[0].threshold_s == pytest.approx(0.025)
    assert not verdicts[1].admitted and verdicts[1].reason is ShedReason.PRIORITY  # in time, past its share
    assert verdicts[1].threshold_s == pytest.approx(0.01875)
    assert verdicts[1].retry_after_s == pytest.approx(0.02 - 0.01875)
    assert not verdicts[2].admitted and verdicts[2].threshold_s == pytest.approx(0.0140625)
    queues = policy(admission=replace(admission, never_shed_priorities=frozenset({2}))).decide(100, view, priority=2)
    assert queues.admission is not None and queues.admission.admitted and queues.admission.threshold_s == math.inf


def test_judge_keeps_the_retry_after_within_its_floor_and_cap():
    params = replace(SHED, retry_after_min_s=1.0, retry_after_max_s=30.0)
    decision = Decision(Route.PREFILL, "p0", "d0", (), 0.07, None, "test")
    assert judge(params, decision).retry_after_s == 1.0  # 0.02 s past the threshold
    assert judge(params, replace(decision, ttft_prefill_s=100.0)).retry_after_s == 30.0
    assert judge(params, replace(decision, ttft_prefill_s=math.inf)).reason is ShedReason.NO_ROUTE_IN_TIME
    assert judge(params, replace(decision, ttft_prefill_s=0.05)).admitted


def test_a_handoff_that_would_push_the_decode_step_past_budget_does_not_fit():
    # T(B + I + 1, K + I_p + l) with B = 40: 0.051 fits, with one hand-off bound there too 0.052 does not
    node = DecodeNodeView("d0", batch_size=40, kv_tokens=0, free_kv_tokens=10_000)
    assert handoff_fits(SIMPLE, node, 100, BUDGET_S)
    bound = replace(node, incoming_requests=1, incoming_kv_tokens=200, incoming_prompt_tokens=100)
    assert not handoff_fits(SIMPLE, bound, 100, BUDGET_S)
    assert not handoff_fits(SIMPLE, replace(node, free_kv_tokens=99), 100, BUDGET_S)  # no KV room
    assert handoff_fits(SIMPLE, replace(node, free_kv_tokens=99), 100, BUDGET_S, held_tokens=1)


def test_a_handoff_needs_room_for_its_output_and_its_step_counts_the_prompts_bound_there():
    # B = 39 with one hand-off bound (100 prompt, 5,000 output): T(41, ...) = 0.051 fits whatever K (c_kv = 0)
    node = DecodeNodeView(
        "d0", 39, 0, 10_000, incoming_requests=1, incoming_kv_tokens=5_100, incoming_prompt_tokens=100
    )
    assert handoff_fits(SIMPLE, node, 100, BUDGET_S, output_tokens=4_800)  # room 4,900 = 100 + 4,800
    assert not handoff_fits(SIMPLE, node, 100, BUDGET_S, output_tokens=4_801)
    costly = replace(SIMPLE, c_kv=1e-7)  # 0.051 + 1e-7 K: within 0.0515 up to K = 5,000 (prompts, not outputs)
    roomy = replace(node, free_kv_tokens=20_000)
    assert handoff_fits(costly, roomy, 4_800, BUDGET_S)  # K = 100 + 4,800
    assert not handoff_fits(costly, roomy, 5_000, BUDGET_S)


def test_a_handoff_leaves_room_for_the_next_chunk_of_the_deflection_under_way():
    # B = 30: alone T(31, ...) = 0.041; with the deflection's next chunk of 100 (prefix 200, K 200 + 100 joined)
    # 0.041 + 100 * (1e-4 + 1e-7 * 300) = 0.054
    node = DecodeNodeView("d0", batch_size=30, kv_tokens=200, free_kv_tokens=10_000, committed=((100, 100),))
    node = replace(node, head_prefilled_tokens=200)
    assert handoff_fits(SIMPLE, node, 100, BUDGET_S)
    assert not handoff_fits(SIMPLE, node, 100, BUDGET_S, with_deflection=True)


def test_a_deflection_must_leave_the_batch_it_joins_within_budget():
    # a model whose chunks cost nothing: on a node running 41 requests every chunk step is T0(41) = 0.051 and
    # fits Eq. 5, but once prefilled the request joins the batch: T0(42) = 0.052. Behind 5 x 2,000 queued tokens
    # (50 steps of 0.01 s) the decode path wins by far
    free_chunks = StepLatencyModel(0.01, 0.001, 0.0, 0.0, 0.0, 0.0)
    node = DecodeNodeView("d0", batch_size=41, kv_tokens=0, free_kv_tokens=10_000)
    view = ClusterView((PrefillNodeView("p0", (2000,) * 5),), (node,))
    off = make_policy("kairos", SMALL, free_chunks)
    assert off.decide(100, view).route is Route.DEFLECT  # the paper's check: every chunk step within budget
    on = make_policy("kairos", replace(SMALL, admission=SHED), free_chunks)
    assert on.decide(100, view).route is Route.PREFILL


def test_a_handoff_goes_where_its_first_token_is_expected_first():
    # d0 is full (finishing 10/s), d1 takes it now: its estimate is the prefill path's 0.092 s and T(1, 100) = 0.011
    view = ClusterView((QUEUED,), (replace(FULL, finished_per_s=10.0), IDLE))
    decision = policy("pd").decide(100, view)
    assert decision.decode_node == "d1" and decision.kv_wait_s == 0.0
    assert decision.ttft_prefill_s == pytest.approx(0.092 + 0.011)


def test_a_handoff_waits_behind_the_transfers_bound_to_its_link():
    # a link of 1,000 tokens/s with 100 tokens of setup; two transfers of 500 tokens each still bound there:
    # W_link = (1000 + 2 * 100) / 1000 = 1.2 s. Ready at R = 2 s, the link is busy 0.6 of the time: it starts at
    # max(2 + 0.6 * 0.6, 1.2) = 2.36 s; its own transfer (100 + 500 - 100 held) / 1000 = 0.5 s; one decode step
    # T(3 + 2 + 1, 0) = 0.016 s
    node = DecodeNodeView("d0", 3, 0, 10_000, incoming_requests=2, incoming_transfers=2, incoming_transfer_tokens=1000)
    assert handoff_ttft_s(SIMPLE, node, 2.0, 0.0, 500, 100, 100, 1000.0) == pytest.approx(2.36 + 0.5 + 0.016)
    # ready before the link has carried them (R = 0.5): it starts when they are done, at 1.2 s
    assert handoff_ttft_s(SIMPLE, node, 0.5, 0.0, 500, 100, 100, 1000.0) == pytest.approx(1.2 + 0.5 + 0.016)
    assert handoff_ttft_s(SIMPLE, node, 2.0, 3.0, 500, 100, 100, 0.0) == pytest.approx(3.0 + 0.016)  # unpriced


def test_without_a_measured_finishing_rate_a_full_node_promises_no_time():
    assert kv_wait_s(SIMPLE, FULL, 100, BUDGET_S) == math.inf
    assert kv_wait_s(SIMPLE, IDLE, 100, BUDGET_S) == 0.0


def test_the_join_guard_counts_the_chunk_planned_next():
    guard = join_guard(SIMPLE, BUDGET_S)
    assert guard(40, 0, 100, 0, 0)  # T(41) = 0.051
    assert not guard(41, 0, 100, 0, 0)
    assert not guard(30, 0, 100, 100, 0)  # 0.041 + 100 * (1e-4 + 1e-7 * 100) = 0.052


@settings(max_examples=200, deadline=None)
@given(models(), st.integers(1, 300), st.integers(0, 2_000_000), st.floats(0.01, 0.2))
def test_the_excess_is_the_fewest_leavers_that_make_the_step_fit(model, batch_size, kv_tokens, budget_s):
    def fits(leavers: int) -> bool:
        return model.step_s(batch_size - leavers, kv_tokens - leavers * kv_tokens / batch_size, 0) <= budget_s

    fewest = next((e for e in range(batch_size + 1) if fits(e)), batch_size)
    assert _excess(model, batch_size, kv_tokens, budget_s) == fewest


@settings(max_examples=200, deadline=None)
@given(views(), st.integers(1, 32_768), st.integers(-1, 3))
def test_admission_off_is_the_paper_and_on_sheds_exactly_what_misses_its_threshold(view, prompt, priority):
    params = PolicyParams(tbt_slo_s=0.07)
    plain = make_policy("kairos", params, SIMPLE).decide(prompt, view)
    assert plain.admission is None and plain.kv_wait_s == 0.0
    admission = AdmissionParams(mode=AdmissionMode.SHED, ttft_slo_s=1.0)
    decision = make_policy("kairos", replace(params, admission=admission), SIMPLE).decide(prompt, view, None, priority)
    verdict = decision.admission
    assert verdict is not None
    estimate = decision.ttft_decode_s if decision.deflected else decision.ttft_prefill_s
    assert verdict.ttft_estimate_s == estimate and verdict.threshold_s == admission.threshold_s(priority)
    assert decision.shed == (estimate > verdict.threshold_s)
    if decision.shed:
        assert apply_decision(view, prompt, decision, 16) == view
