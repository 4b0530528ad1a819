import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kairos_ray.core import (
    ClusterView,
    DecodeNodeView,
    PolicyParams,
    PrefillNodeView,
    PrefixHits,
    Route,
    StepLatencyModel,
    Thresholds,
    apply_decision,
    decode_ttft_s,
    make_policy,
)
from kairos_ray.core.estimate import after_committed

from .strategies import CANDIDATES, SIMPLE, models, prompts, views

SMALL = PolicyParams(prefill_chunk_tokens=200, chunk_candidates=(400, 200, 100), tbt_slo_s=0.051, beta=1.0)
IDLE_DECODE = DecodeNodeView("d0", batch_size=0, kv_tokens=0, free_kv_tokens=10_000)
VIEW = ClusterView((PrefillNodeView("p0", (300, 100)),), (IDLE_DECODE,))


def kairos(alpha=1.0, params=SMALL, model=SIMPLE):
    return make_policy("kairos", replace(params, alpha=alpha), model)


def test_algorithm1_deflects_when_decode_is_faster():
    # TTFT_pf = 0.092 (exact estimator, see test_estimate); TTFT_dec = T(0, 0, 100) = 0.02
    decision = kairos().decide(100, VIEW)
    assert decision.route is Route.DEFLECT
    assert decision.decode_node == "d0" and decision.prefill_node is None
    assert decision.chunk_schedule == (100,)
    assert decision.ttft_prefill_s == pytest.approx(0.092)
    assert decision.ttft_decode_s == pytest.approx(0.02)


def test_alpha_margin_keeps_close_calls_on_the_prefill_node():
    assert kairos(alpha=4).decide(100, VIEW).route is Route.DEFLECT  # 0.08 < 0.092
    decision = kairos(alpha=5).decide(100, VIEW)  # 0.10 >= 0.092
    assert decision.route is Route.PREFILL
    assert decision.prefill_node == "p0" and decision.decode_node == "d0"
    assert decision.chunk_schedule == ()
    assert decision.ttft_decode_s == pytest.approx(0.02)


def test_paper_estimator_is_selectable():
    decision = kairos(params=replace(SMALL, prefill_estimator="paper")).decide(100, VIEW)
    assert decision.ttft_prefill_s == pytest.approx(0.0835)


def test_fastest_feasible_node_wins():
    busy = DecodeNodeView("busy", batch_size=20, kv_tokens=0, free_kv_tokens=10_000)
    view = ClusterView(VIEW.prefill, (busy, IDLE_DECODE))
    decision = kairos().decide(100, view)
    assert decision.decode_node == "d0"


def test_no_tbt_safe_node_means_prefill():
    overloaded = DecodeNodeView("d0", batch_size=50, kv_tokens=0, free_kv_tokens=10_000)  # T0 = 0.06 > 0.051
    decision = kairos().decide(100, ClusterView(VIEW.prefill, (overloaded,)))
    assert decision.route is Route.PREFILL
    assert decision.ttft_decode_s is None
    assert "1 infeasible" in decision.reason


def test_second_deflection_waits_for_the_first():
    first = kairos().decide(100, VIEW)
    view = apply_decision(VIEW, 100, first)
    assert view.decode[0].committed == ((100,),)
    second = kairos().decide(100, view)
    # 0.02 for the committed prefill, then T(1, 100, 100) = 0.022 with the first request now decoding
    assert second.ttft_decode_s == pytest.approx(0.042)


def test_kv_capacity_is_respected_including_commitments():
    tight = DecodeNodeView("d0", batch_size=0, kv_tokens=0, free_kv_tokens=150, committed=((100,),))
    decision = kairos().decide(100, ClusterView(VIEW.prefill, (tight,)))
    assert decision.route is Route.PREFILL
    assert "1 short of KV" in decision.reason


def test_pd_never_deflects_and_picks_least_wait_and_most_headroom():
    view = ClusterView(
        (PrefillNodeView("p-busy", (5000,)), PrefillNodeView("p-idle")),
        (
            DecodeNodeView("d-full", 0, 9_000, 1_000),
            DecodeNodeView("d-roomy", 0, 1_000, 9_000),
        ),
    )
    decision = make_policy("pd", SMALL, SIMPLE).decide(100, view)
    assert decision.route is Route.PREFILL
    assert (decision.prefill_node, decision.decode_node) == ("p-idle", "d-roomy")


def test_a_hand_off_counts_on_its_decode_node_until_it_joins_so_a_burst_spreads_out():
    view = ClusterView(
        (PrefillNodeView("p0"),),
        (DecodeNodeView("d0", 4, 0, 20_000), DecodeNodeView("d1", 4, 0, 15_000)),
    )
    pd = make_policy("pd", SMALL, SIMPLE)
    first = pd.decide(6000, view)
    assert first.decode_node == "d0"  # 20,000 free beats 15,000
    after = apply_decision(view, 6000, first, output_tokens=500)
    d0 = after.decode[0]
    # no engine has it yet (a prefill queue, then a KV transfer), but it will take 6,000 + 500 tokens of d0's KV
    assert (d0.batch_size, d0.incoming_requests, d0.incoming_kv_tokens, d0.free_kv_tokens) == (4, 1, 6_500, 20_000)
    assert after.decode[1] == view.decode[1]
    assert pd.decide(6000, after).decode_node == "d1"  # 15,000 > 20,000 - 6,500: a burst spreads out
    # at equal headroom the smaller batch wins, counting the requests bound for it: 4 + 1 > 4
    even = ClusterView(view.prefill, (replace(d0, free_kv_tokens=21_500), view.decode[1]))
    assert pd.decide(6000, even).decode_node == "d1"
    # a deflection's KV room is what is free now: the hand-off may wait in a prefill queue for long
    assert kairos().decide(100, ClusterView(VIEW.prefill, (replace(IDLE_DECODE, incoming_kv_tokens=10_000),))).deflected


def test_sq_deflects_on_queue_length_without_tbt_check():
    overloaded = DecodeNodeView("d0", batch_size=50, kv_tokens=0, free_kv_tokens=10_000)
    view = ClusterView((PrefillNodeView("p0", (300, 100)),), (overloaded,))
    assert make_policy("sq:2", SMALL, SIMPLE).decide(100, view).route is Route.DEFLECT
    assert make_policy("sq:3", SMALL, SIMPLE).decide(100, view).route is Route.PREFILL


def test_sl_deflects_short_prompts_in_fixed_chunks():
    sl = make_policy("sl:1024", replace(SMALL, static_chunk_tokens=256), SIMPLE)
    decision = sl.decide(600, VIEW)
    assert decision.route is Route.DEFLECT
    assert decision.chunk_schedule == (256, 256, 88)
    assert sl.decide(1025, VIEW).route is Route.PREFILL


def test_spec_thresholds_default_from_config():
    policy = make_policy("sq", SMALL, SIMPLE, thresholds=Thresholds(sq_queued_requests=7))
    assert policy.spec == "sq:7"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("fastest", "unknown policy 'fastest'; known: kairos, oracle, pd, sq:<theta>, sl:<tokens>"),
        ("sq:x", "threshold 'x' is not an integer"),
        ("sl:0", "threshold must be >= 1, got 0"),
        ("kairos:2", "takes no argument"),
    ],
)
def test_bad_specs_say_what_is_accepted(spec, message):
    with pytest.raises(ValueError, match=message):
        make_policy(spec, SMALL, SIMPLE)


def test_bad_requests_and_views_are_rejected():
    with pytest.raises(ValueError, match="prompt_tokens must be >= 1"):
        kairos().decide(0, VIEW)
    with pytest.raises(ValueError, match="at least one prefill and one decode node"):
        kairos().decide(10, ClusterView(VIEW.prefill, ()))


# ---- properties -------------------------------------------------------------------------

PARAMS = PolicyParams(chunk_candidates=CANDIDATES)


@given(models(), prompts, views())
def test_deflections_are_tbt_safe_behind_commitments_and_fit_kv(model, prompt, view):
    decision = make_policy("kairos", PARAMS, model).decide(prompt, view)
    if decision.route is not Route.DEFLECT:
        return
    node = next(n for n in view.decode if n.node_id == decision.decode_node)
    assert node.headroom_kv_tokens >= prompt
    assert sum(decision.chunk_schedule) == prompt
    assert_safe_and_priced_by_eq6(model, node, decision, cached=0)
    assert PARAMS.alpha * decision.ttft_decode_s < decision.ttft_prefill_s


def assert_safe_and_priced_by_eq6(model, node, decision, cached):
    """Behind the node's commitments, every chunk from the cached context on meets Eq. 5, and Eq. 6 is their sum."""
    wait_s, batch_size, kv = after_committed(model, node)
    total, prefix = wait_s, cached
    for chunk in decision.chunk_schedule:
        step = model.step_s(batch_size, kv + prefix, chunk, prefix)
        assert step <= PARAMS.tbt_budget_s
        total += step
        prefix += chunk
    assert decision.ttft_decode_s == pytest.approx(total, rel=1e-9)


@given(models(), prompts, views())
def test_no_deflection_when_every_node_is_infeasible(model, prompt, view):
    params = replace(PARAMS, tbt_slo_s=model.c0 / 2)  # below the cost of any step
    decision = make_policy("kairos", params, model).decide(prompt, view)
    assert decision.route is Route.PREFILL
    assert decision.ttft_decode_s is None


@given(models(), prompts, views())
def test_infinite_alpha_never_deflects(model, prompt, view):
    decision = make_policy("kairos", replace(PARAMS, alpha=math.inf), model).decide(prompt, view)
    assert decision.route is Route.PREFILL


@settings(suppress_health_check=[HealthCheck.filter_too_much])  # most random views deflect nothing
@given(models(), prompts, views(), st.integers(1, 32_768), st.data())
def test_more_queued_prefill_work_never_makes_deflection_less_likely(model, prompt, view, extra, data):
    for estimator in ("exact", "paper"):
        policy = make_policy("kairos", replace(PARAMS, prefill_estimator=estimator), model)
        before = policy.decide(prompt, view)
        assume(before.deflected)
        target = data.draw(st.sampled_from([n.node_id for n in view.prefill]))
        busier = ClusterView(
            tuple(
                replace(n, queued_prompt_tokens=(*n.queued_prompt_tokens, extra)) if n.node_id == target else n
                for n in view.prefill
            ),
            view.decode,
        )
        assert policy.decide(prompt, busier).deflected


@given(models(), st.lists(prompts, min_size=2, max_size=12), views())
def test_a_burst_never_overfills_a_node(model, burst, view):
    policy = make_policy("kairos", PARAMS, model)
    start = view
    for tokens in burst:
        decision = policy.decide(tokens, view)
        view = apply_decision(view, tokens, decision)
    for before, after in zip(start.decode, view.decode, strict=True):
        added = after.committed_tokens - before.committed_tokens
        assert added <= max(0, before.headroom_kv_tokens)


@given(models(), prompts, views())
def test_apply_decision_records_exactly_one_commitment(model, prompt, view):
    decision = make_policy("kairos", PARAMS, model).decide(prompt, view)
    after = apply_decision(view, prompt, decision)
    queued = sum(n.num_queued for n in after.prefill) - sum(n.num_queued for n in view.prefill)
    committed = sum(len(n.committed) for n in after.decode) - sum(len(n.committed) for n in view.decode)
    assert (queued, committed) == ((0, 1) if decision.deflected else (1, 0))


# ---- prefix-aware ---------------------------------------------------------------------------

# T = 0.01 + 0.001 B + 1e-7 K + chi * (1e-4 + 1e-8 P): a chunk pays for its own context P
CONTEXT = StepLatencyModel(
    c0=0.01, c_batch=0.001, c_kv=1e-7, c_chunk=1e-4, c_chunk_kv=0.0, c_chunk_sq=0.0, c_chunk_prefix=1e-8
)
AWARE = PolicyParams(prefill_chunk_tokens=2048, chunk_candidates=(400, 200, 100), tbt_slo_s=0.051, beta=1.0)
HISTORY = ClusterView(
    (PrefillNodeView("p0", (8000,)),),
    (DecodeNodeView("B", 0, 0, 1_000_000), DecodeNodeView("A", 0, 0, 1_000_000)),
)
ON_A = PrefixHits({"A": 6000})  # the conversation's last turn (prompt and answer) sits on A


def test_a_turn_whose_history_sits_on_a_node_is_deflected_there_for_its_suffix_only():
    decision = make_policy("kairos+prefix", AWARE, CONTEXT).decide(6500, HISTORY, ON_A)
    # from P = K = 6000: 400 would take 0.0106 + 400 * 1.6e-4 = 0.0746 > 0.051; 200 takes 0.0426,
    # then 0.04302 at P = 6200; the last 100 at P = 6400 take 0.02704
    assert decision.route is Route.DEFLECT and decision.decode_node == "A"
    assert decision.chunk_schedule == (200, 200, 100)
    assert decision.cached_prompt_tokens == 6000
    assert decision.ttft_decode_s == pytest.approx(0.0426 + 0.04302 + 0.02704)
    assert decision.ttft_decode_s == pytest.approx(decode_ttft_s(CONTEXT, 0, 6000, (200, 200, 100), 6000))


def test_the_ledger_adds_the_suffix_and_starts_it_from_the_cached_context():
    decision = make_policy("kairos+prefix", AWARE, CONTEXT).decide(6500, HISTORY, ON_A)
    node = apply_decision(HISTORY, 6500, decision, output_tokens=100).decode[1]
    assert node.committed == ((200, 200, 100),) and node.committed_cached_tokens == (6000,)
    assert (node.free_kv_tokens, node.headroom_kv_tokens) == (1_000_000 - 100, 1_000_000 - 600)
    # the next request waits for exactly those steps; then the turn decodes with its whole 6500-token prompt in K
    assert after_committed(CONTEXT, node) == pytest.approx((0.0426 + 0.04302 + 0.02704, 1, 6500))


def test_a_cold_request_is_decided_exactly_as_before():
    blind = make_policy("kairos+blind", AWARE, CONTEXT)
    aware = make_policy("kairos", AWARE, CONTEXT)  # prefix-aware by default
    assert aware.decide(6500, HISTORY) == aware.decide(6500, HISTORY, PrefixHits({})) == blind.decide(6500, HISTORY)
    assert blind.decide(6500, HISTORY, ON_A) == blind.decide(6500, HISTORY)  # cache-blind: hits are ignored


@pytest.mark.parametrize("hit", [6500, 7000, 1_000_000])
def test_a_hit_on_the_whole_prompt_or_beyond_still_computes_its_last_token(hit):
    decision = make_policy("kairos+prefix", AWARE, CONTEXT).decide(6500, HISTORY, PrefixHits({"A": hit}))
    assert decision.deflected and decision.decode_node == "A"
    assert decision.chunk_schedule == (1,) and decision.cached_prompt_tokens == 6499
    assert decision == make_policy("kairos+prefix", AWARE, CONTEXT).decide(6500, HISTORY, PrefixHits({"A": 6499}))


def test_a_deflection_needs_kv_room_for_its_suffix_only():
    tight = ClusterView(HISTORY.prefill, (DecodeNodeView("A", 0, 0, 600),))
    assert make_policy("kairos+prefix", AWARE, CONTEXT).decide(6500, tight, ON_A).deflected
    assert "1 short of KV" in make_policy("kairos+blind", AWARE, CONTEXT).decide(6500, tight, ON_A).reason


def bound_for(node_id, free_kv_tokens, requests, prompt_tokens, output_tokens=0, batch_size=0):
    """A decode node with ``requests`` hand-offs bound for it, their KV (prompts and outputs) still to arrive."""
    return DecodeNodeView(
        node_id,
        batch_size,
        0,
        free_kv_tokens,
        incoming_requests=requests,
        incoming_kv_tokens=prompt_tokens + output_tokens,
        incoming_prompt_tokens=prompt_tokens,
        incoming_transfers=requests,
        incoming_transfer_tokens=prompt_tokens,
    )


def test_a_disaggregated_request_goes_where_its_kv_arrives_first_counting_the_blocks_held():
    view = ClusterView(
        (PrefillNodeView("p0"), PrefillNodeView("p1")),
        (DecodeNodeView("roomy", 0, 0, 12_000), DecodeNodeView("holder", 0, 0, 10_000)),
    )
    hits = PrefixHits({"holder": 3000, "p1": 2048})
    decision = make_policy("pd+prefix", AWARE, CONTEXT).decide(6500, view, hits)
    # to the holder it sends 3,500 tokens, to roomy 6,500
    assert (decision.prefill_node, decision.decode_node, decision.cached_prompt_tokens) == ("p1", "holder", 2048)
    assert decision.receiver_cached_tokens == 3000  # the hand-off leaves out the holder's 3000 tokens
    queued = apply_decision(view, 6500, decision).prefill[1]
    assert (queued.queued_prompt_tokens, queued.queued_cached_tokens) == ((4452,), (2048,))
    blind = make_policy("pd+blind", AWARE, CONTEXT).decide(6500, view, hits)
    assert (blind.decode_node, blind.receiver_cached_tokens) == ("roomy", 0)  # 6,500 either way: most headroom
    # priced cache-blind, a hand-off to the holder still leaves out what it holds
    only_holder = ClusterView(view.prefill, (view.decode[1],))
    assert make_policy("pd+blind", AWARE, CONTEXT).decide(6500, only_holder, hits).receiver_cached_tokens == 3000
    # 4,000 tokens already on their way to the holder: 7,500 there against 6,500 to roomy
    busier = ClusterView(view.prefill, (view.decode[0], bound_for("holder", 20_000, 1, 4_000)))
    assert make_policy("pd+prefix", AWARE, CONTEXT).decide(6500, busier, hits).decode_node == "roomy"


@pytest.mark.parametrize("setup, chosen", [(0, "many-small"), (6430, "few-big")])
def test_a_hand_offs_link_counts_each_transfers_setup(setup, chosen):
    # a 1,000-token hand-off: few-big carries 8,000 + 1 setup + 1,000, many-small 2,000 + 4 setups + 1,000
    few_big, many_small = bound_for("few-big", 100_000, 1, 8_000), bound_for("many-small", 100_000, 4, 2_000)
    view = ClusterView((PrefillNodeView("p0"),), (few_big, many_small))
    params = replace(AWARE, handoff_setup_tokens=setup)
    assert make_policy("pd", params, CONTEXT).decide(1000, view).decode_node == chosen


@pytest.mark.parametrize("batch, chosen", [(38, "idle-link"), (40, "busy-link")])
def test_a_disaggregated_request_goes_only_where_the_decode_step_stays_within_budget(batch, chosen):
    # with the request, idle-link steps at 0.01 + 0.001 (B + 1) + 1e-7 * 6,500: 0.04965 s at B = 38, within
    # beta * tau = 0.051 s; at B = 40, 0.05165 s, over it, so busy-link takes it despite 20,000 tokens ahead
    idle_link = DecodeNodeView("idle-link", batch, 0, 50_000)
    busy_link = bound_for("busy-link", 50_000, 2, 20_000)
    view = ClusterView((PrefillNodeView("p0"),), (busy_link, idle_link))
    assert make_policy("pd", AWARE, CONTEXT).decide(6500, view).decode_node == chosen
    # where no node can take it: the most KV headroom once it holds the request
    full = ClusterView(view.prefill, (replace(idle_link, batch_size=60), replace(busy_link, batch_size=60)))
    assert make_policy("pd", AWARE, CONTEXT).decide(6500, full).decode_node == "idle-link"


def test_a_hand_off_ranks_nodes_by_the_prompts_their_links_still_carry_not_by_the_kv_they_reserve():
    # A: a 1,000-token prompt bound there with 16,000 output tokens (17,000 tokens to reserve, 1,000 to carry);
    # B: a 12,000-token prompt. A 1,000-token hand-off reaches A after 2,000 tokens, B after 13,000
    view = ClusterView(
        (PrefillNodeView("p0"),), (bound_for("B", 100_000, 1, 12_000), bound_for("A", 100_000, 1, 1_000, 16_000))
    )
    assert make_policy("pd", AWARE, CONTEXT).decide(1000, view).decode_node == "A"


def test_a_hand_off_ranks_nodes_by_what_their_links_carry_less_the_blocks_each_receiver_holds():
    view = ClusterView(
        (PrefillNodeView("p0"),), (DecodeNodeView("B", 0, 0, 100_000), DecodeNodeView("A", 0, 0, 100_000))
    )
    pd = make_policy("pd+prefix", AWARE, CONTEXT)
    # an 8,000-token prompt of which A holds 7,000 goes to A: 1,000 tokens to carry there, 8,000 to B
    first = pd.decide(8000, view, PrefixHits({"A": 7000}), output_tokens=100)
    assert (first.decode_node, first.receiver_cached_tokens) == ("A", 7000)
    view = apply_decision(view, 8000, first, 100)
    second = pd.decide(3000, ClusterView(view.prefill, view.decode[:1]), output_tokens=100)  # one for B
    view = apply_decision(view, 3000, second, 100)
    assert [(n.incoming_transfer_tokens, n.incoming_kv_tokens) for n in view.decode] == [(3000, 3100), (1000, 8100)]
    # a cold 1,000-token prompt: A's link carries 1,000 + 1,000 before its first token, B's 3,000 + 1,000
    assert pd.decide(1000, view).decode_node == "A"


def test_a_hand_off_joins_where_the_prompts_bound_there_keep_the_step_in_budget_their_outputs_yet_to_come():
    # B = 38, one hand-off bound (1,000 prompt, 16,000 output): joined with a 6,500-token request the step is
    # 0.01 + 0.001 * 40 + 1e-7 * (1,000 + 6,500) = 0.05075 s, within beta * tau = 0.051 s (0.05235 s if the
    # outputs were resident already)
    long_answers = bound_for("long-answers", 100_000, 1, 1_000, 16_000, batch_size=38)
    view = ClusterView((PrefillNodeView("p0"),), (bound_for("elsewhere", 100_000, 1, 12_000), long_answers))
    assert make_policy("pd", AWARE, CONTEXT).decide(6500, view).decode_node == "long-answers"


def test_a_deflection_needs_kv_room_for_its_output_too_and_never_overfills_its_node():
    queue = (PrefillNodeView("p0", (20_000,)),)
    exact = ClusterView(queue, (DecodeNodeView("d0", 0, 0, 400),))
    assert kairos().decide(400, exact).deflected  # no output: 400 tokens fit exactly
    decision = kairos().decide(400, exact, output_tokens=200)
    assert not decision.deflected and "1 short of KV" in decision.reason
    roomy = ClusterView(queue, (DecodeNodeView("d0", 0, 0, 600),))
    decision = kairos().decide(400, roomy, output_tokens=200)
    assert decision.deflected
    assert apply_decision(roomy, 400, decision, 200).decode[0].headroom_kv_tokens == 0


def test_a_hand_off_needs_kv_room_for_its_output_and_waits_for_the_roomiest_node_when_none_has_it():
    short = DecodeNodeView("short", 0, 0, 6_600)  # an idle link
    enough = bound_for("enough", 11_500, 1, 4_000, 500)  # 7,000 tokens of room once its hand-off has joined
    view = ClusterView((PrefillNodeView("p0"),), (short, enough))
    pd = make_policy("pd", AWARE, CONTEXT)
    assert pd.decide(6500, view).decode_node == "short"
    assert pd.decide(6500, view, output_tokens=500).decode_node == "enough"  # 7,000 tokens: only enough holds it
    # no node holds 6,500 + 600: the one with the most room, whose queue it waits in until its KV fits
    assert pd.decide(6500, view, output_tokens=600).decode_node == "enough"


@settings(max_examples=150, deadline=None)
@given(view=views(), prompt=prompts, output=st.integers(0, 8000), spec=st.sampled_from(("kairos", "sq:1", "sl:32768")))
def test_no_decision_reserves_more_kv_than_its_node_has_room_for(view, prompt, output, spec):
    decision = make_policy(spec, SMALL, SIMPLE).decide(prompt, view, output_tokens=output)
    after = apply_decision(view, prompt, decision, output)
    at = view.position(decision.decode_node)
    assert at is not None
    node = after.decode[at[1]]
    if decision.deflected:
        assert node.headroom_kv_tokens >= 0
    elif any(n.headroom_kv_tokens - n.incoming_kv_tokens >= prompt + output for n in view.decode):
        assert node.headroom_kv_tokens - node.incoming_kv_tokens >= 0


FAST = StepLatencyModel(c0=0.005, c_batch=0.0005, c_kv=0.0, c_chunk=5e-5, c_chunk_kv=5e-8, c_chunk_sq=0.0)
"""SIMPLE at half its every cost: a node of a faster GPU."""


def test_each_node_is_priced_with_its_own_model():
    pool, fast = DecodeNodeView("pool", 0, 0, 10_000), DecodeNodeView("fast", 0, 0, 10_000, model=FAST)
    view = ClusterView(VIEW.prefill, (pool, fast))
    decision = kairos().decide(100, view)
    # 100 tokens on an idle node: 0.01 + 100 * 1e-4 = 0.02 s priced with the pool's model, 0.01 s with its own
    assert decision.decode_node == "fast" and decision.ttft_decode_s == pytest.approx(0.01)
    assert kairos().decide(100, ClusterView(VIEW.prefill, (pool, replace(fast, model=None)))).decode_node == "pool"
    # prefill nodes too: the same queue (0.092 s on SIMPLE, test_algorithm1_deflects_when_decode_is_faster) is
    # half as long on the faster node
    prefill = (VIEW.prefill[0], replace(VIEW.prefill[0], node_id="p-fast", model=FAST))
    decision = make_policy("pd", SMALL, SIMPLE).decide(100, ClusterView(prefill, (pool,)))
    assert decision.prefill_node == "p-fast" and decision.ttft_prefill_s == pytest.approx(0.046)


def test_a_hand_off_goes_only_where_the_nodes_own_model_keeps_the_step_within_budget():
    slow = replace(SIMPLE, c0=0.05)  # a step of 0.05 + 0.001 (B + 1): over beta * tau = 0.051 s with B = 1
    crowded = DecodeNodeView("crowded", 1, 0, 50_000, model=slow)  # an idle link, but steps too slow for a join
    view = ClusterView((PrefillNodeView("p0"),), (crowded, bound_for("busy-link", 50_000, 2, 20_000)))
    assert make_policy("pd", AWARE, CONTEXT).decide(6500, view).decode_node == "busy-link"
    assert (
        make_policy("pd", AWARE, CONTEXT)
        .decide(6500, ClusterView(view.prefill, (replace(crowded, model=None), view.decode[1])))
        .decode_node
        == "crowded"
    )


def test_sl_with_prefix_is_llm_ds_uncached_suffix_threshold():
    sl = make_policy("sl:1024+prefix", replace(AWARE, static_chunk_tokens=256), CONTEXT)
    decision = sl.decide(6500, HISTORY, ON_A)
    assert decision.deflected and decision.decode_node == "A" and decision.chunk_schedule == (256, 244)
    assert decision.reason == "uncached suffix 500 <= 1024 tokens"
    assert not make_policy("sl:1024+blind", AWARE, CONTEXT).decide(6500, HISTORY, ON_A).deflected


def test_a_spec_suffix_sets_prefix_awareness_and_stays_in_the_spec():
    policy = make_policy("sl:1024+prefix", AWARE, CONTEXT)
    assert policy.spec == "sl:1024+prefix" and policy.params.prefix_aware
    blind = make_policy("kairos+blind", AWARE, CONTEXT)
    assert blind.spec == "kairos+blind" and not blind.params.prefix_aware
    assert make_policy("oracle", AWARE, CONTEXT).params.prefix_aware  # the default
    assert not make_policy("oracle", replace(AWARE, prefix_aware=False), CONTEXT).params.prefix_aware


@given(models(), prompts, views(), st.data())
def test_prefix_aware_deflections_are_tbt_safe_from_the_cached_context(model, prompt, view, data):
    hits = PrefixHits({n.node_id: data.draw(st.integers(0, prompt - 1)) for n in view.decode})
    decision = make_policy("kairos+prefix", PARAMS, model).decide(prompt, view, hits)
    if not decision.deflected:
        return
    node = next(n for n in view.decode if n.node_id == decision.decode_node)
    cached = hits.at(node.node_id)
    assert decision.cached_prompt_tokens == cached
    assert sum(decision.chunk_schedule) == prompt - cached <= node.headroom_kv_tokens
    assert all(a >= b for a, b in itertools.pairwise(decision.chunk_schedule))
    assert_safe_and_priced_by_eq6(model, node, decision, cached)


@given(models(), prompts, views())
def test_without_hits_prefix_awareness_changes_no_decision(model, prompt, view):
    zero = PrefixHits({n.node_id: 0 for n in (*view.prefill, *view.decode)})
    for spec in ("kairos", "pd", "sq:1", "sl:1024"):
        blind = make_policy(f"{spec}+blind", PARAMS, model).decide(prompt, view)
        assert make_policy(f"{spec}+prefix", PARAMS, model).decide(prompt, view, zero) == blind
