"""The router's state keeping, without Serve: nodes join and leave, the ledger shows undelivered decisions."""

from dataclasses import replace

import pytest

from kairos_ray.config import KairosConfig
from kairos_ray.core import CacheDelta, DecodeNodeView, PrefillNodeView, Route, block_ids
from kairos_ray.messages import NodeState, PrefixDelta
from kairos_ray.serve.router import MissingState, RouterState


def prefill_state(node, queued, accepted=()):
    return NodeState(PrefillNodeView(node, tuple(queued)), "", 0.0, accepted_request_ids=tuple(accepted))


def decode_state(node, batch=0, accepted=(), free_kv_tokens=1_000_000):
    view = DecodeNodeView(node, batch_size=batch, kv_tokens=0, free_kv_tokens=free_kv_tokens)
    return NodeState(view, "", 0.0, accepted_request_ids=tuple(accepted))


def fresh_router(ttl=2.0):
    return RouterState(KairosConfig().build_policy("pd"), pending_ttl_s=ttl, node_timeout_s=5.0)


def test_router_needs_both_pools_before_deciding():
    router = fresh_router()
    router.report(prefill_state("p0", []), now=0.0)
    with pytest.raises(MissingState, match="1 prefill and 0 decode"):
        router.decide(1, 100, 10, now=0.1)


def test_nodes_join_by_reporting_and_leave_when_silent():
    router = fresh_router()
    router.report(prefill_state("p0", [100]), now=0.0)
    router.report(prefill_state("p1", []), now=0.0)
    router.report(decode_state("d0"), now=0.0)
    assert router.decide(1, 500, 10, now=1.0)[0].prefill_node == "p1"  # the idle one
    for t in (3.0, 6.0):  # p1 falls silent
        router.report(prefill_state("p0", [100]), now=t)
        router.report(decode_state("d0"), now=t)
    view, _ = router.view(now=6.5)
    assert [n.node_id for n in view.prefill] == ["p0"]
    assert router.decide(2, 500, 10, now=6.5)[0].prefill_node == "p0"


def test_ledger_shows_undelivered_decisions_until_acknowledged_or_expired():
    router = fresh_router()
    router.report(prefill_state("p0", []), now=0.0)
    router.report(decode_state("d0"), now=0.0)
    decision, staleness = router.decide(1, 500, 10, now=0.5)
    assert decision.route is Route.PREFILL and staleness == pytest.approx(0.5)
    view, _ = router.view(now=0.6)
    assert view.prefill[0].queued_prompt_tokens == (500,)  # the engine has not said it has it yet
    router.report(prefill_state("p0", [500], accepted=[1]), now=0.7)
    router.report(decode_state("d0"), now=0.7)
    view, _ = router.view(now=0.8)
    assert view.prefill[0].queued_prompt_tokens == (500,)  # now from the engine, not twice
    router.decide(2, 300, 10, now=1.0)
    router.report(prefill_state("p0", [500]), now=3.5)
    router.report(decode_state("d0"), now=3.5)
    view, _ = router.view(now=3.6)  # never acknowledged: dropped after the TTL
    assert view.prefill[0].queued_prompt_tokens == (500,)


def test_a_deflection_in_the_ledger_commits_its_schedule_and_reserves_its_output_kv():
    router = RouterState(KairosConfig().build_policy("sl:4096"), pending_ttl_s=2.0)
    router.report(prefill_state("p0", []), now=0.0)
    router.report(decode_state("d0", free_kv_tokens=100_000), now=0.0)
    decision, _ = router.decide(1, 3000, 500, now=0.1)
    assert decision.route is Route.DEFLECT and sum(decision.chunk_schedule) == 3000
    (node,) = router.view(now=0.2)[0].decode
    assert node.committed == (decision.chunk_schedule,)
    assert node.free_kv_tokens == 100_000 - 500 and node.headroom_kv_tokens == 100_000 - 500 - 3000
    router.report(decode_state("d0", accepted=[1], free_kv_tokens=96_500), now=0.3)  # the engine has it now
    (node,) = router.view(now=0.4)[0].decode
    assert node.committed == () and node.free_kv_tokens == 96_500


def test_a_hand_off_stays_on_its_decode_node_s_ledger_until_that_node_has_it():
    router = fresh_router()  # pd
    router.report(prefill_state("p0", []), now=0.0)
    router.report(decode_state("d0"), now=0.0)
    router.report(decode_state("d1"), now=0.0)
    first, _ = router.decide(1, 8000, 500, now=0.1)
    assert (first.prefill_node, first.decode_node) == ("p0", "d0")
    router.report(prefill_state("p0", [8000], accepted=[1]), now=0.2)  # prefilling: no decode node reports it
    d0 = router.view(now=0.3)[0].decode[0]
    assert (d0.incoming_requests, d0.incoming_kv_tokens) == (1, 8500)
    second, _ = router.decide(2, 8000, 500, now=0.3)
    assert second.decode_node == "d1"  # d0's KV is spoken for
    router.report(decode_state("d0", batch=1, accepted=[1], free_kv_tokens=991_500), now=0.4)  # its KV arrived
    d0, d1 = router.view(now=0.5)[0].decode
    assert (d0.batch_size, d0.incoming_requests, d0.free_kv_tokens) == (1, 0, 991_500)  # from the report alone
    assert (d1.incoming_requests, d1.incoming_kv_tokens) == (1, 8500)
    for node in ("d0", "d1"):
        router.report(decode_state(node), now=30.2)
    router.report(prefill_state("p0", []), now=30.2)
    assert router.view(now=30.2)[0].decode[1].incoming_requests == 1  # its prefill and transfer may take long
    assert router.view(now=30.4)[0].decode[1].incoming_requests == 0  # never taken: dropped after handoff_ttl_s


def test_the_view_kept_between_decisions_equals_one_rebuilt_from_the_reports_and_the_ledger():
    router = RouterState(KairosConfig().build_policy("sl:2000"), pending_ttl_s=2.0)
    router.report(prefill_state("p0", [3000]), now=0.0)
    router.report(decode_state("d0", batch=3), now=0.0)
    router.report(decode_state("d1"), now=0.0)
    for rid, prompt in enumerate((500, 4000, 1200, 9000, 300)):
        router.decide(rid, prompt, 50, now=0.1 + rid / 100)
    kept, _ = router.view(now=0.2)
    router._view = None  # rebuild from scratch
    rebuilt, _ = router.view(now=0.2)
    assert kept == rebuilt and rebuilt.prefill[0].queued_prompt_tokens == (3000, 4000, 9000)
    router.decide(1, 4000, 50, now=0.3)  # a retry of request 1 replaces its entry: counted once
    assert router.view(now=0.31)[0].prefill[0].queued_prompt_tokens.count(4000) == 1
    assert router.view(now=2.15)[0].prefill[0].queued_prompt_tokens == (3000, 4000)  # the rest expired


@pytest.mark.parametrize("seed", range(8))
def test_the_view_rebuilt_node_by_node_equals_one_rebuilt_whole_through_reports_acks_retries_and_expiry(seed):
    import random

    rng = random.Random(seed)
    router = RouterState(KairosConfig().build_policy("sl:2000"), pending_ttl_s=0.5)
    nodes = ["p0", "p1", "d0", "d1"]
    decided: list[int] = []
    now = 0.0
    for step in range(300):
        now += rng.uniform(0.0, 0.02)
        node = rng.choice(nodes)
        action = rng.random()
        if action < 0.3:  # a report that takes some of the decisions made so far
            taken = rng.sample(decided, min(len(decided), rng.randint(0, 3)))
            if node.startswith("p"):
                router.report(prefill_state(node, [rng.randint(1, 4000)], accepted=taken), now=now)
            else:
                router.report(decode_state(node, batch=rng.randint(0, 9), accepted=taken), now=now)
        elif len(router.states) == len(nodes):
            rid = rng.choice(decided) if decided and action > 0.9 else step  # now and then a retry
            router.decide(rid, rng.randint(50, 9000), 64, now=now)
            decided.append(rid)
        if len(router.states) == len(nodes) and step % 7 == 0:
            kept, _ = router.view(now=now)
            router._view = None
            assert router.view(now=now)[0] == kept
    assert len(router.pending) > 0 and any(len(entries) for entries in router._pending_at.values())


def prefix(seq, stored=(), removed=(), full=False, block_tokens=16):
    return PrefixDelta(block_tokens, seq, CacheDelta(full, tuple(stored), tuple(removed)))


def kairos_router():
    return RouterState(KairosConfig().build_policy("kairos"), node_timeout_s=5.0)


HISTORY = tuple(range(1000, 1000 + 2048))  # a conversation's turns so far: 128 blocks of 16
PROMPT = (*HISTORY, *range(40))  # its next turn: the history and a new message


def test_the_router_mirrors_each_node_s_cache_from_the_deltas_its_reports_carry():
    router = kairos_router()
    ids = block_ids(PROMPT, 16)
    router.report(replace(decode_state("d0"), prefix=prefix(0, full=True)), now=0.0)
    router.report(replace(decode_state("d0"), prefix=prefix(1, stored=ids[:128])), now=0.1)
    assert router.hits({16: ids}, len(PROMPT)).tokens_by_node == {"d0": 2048}
    router.report(replace(decode_state("d0"), prefix=prefix(2, removed=ids[64:65])), now=0.2)
    assert router.hits({16: ids}, len(PROMPT)).at("d0") == 64 * 16  # the chain breaks at the removed block
    router.report(replace(decode_state("d0"), prefix=prefix(3, stored=ids[:8], full=True)), now=0.3)
    assert router.hits({16: ids}, len(PROMPT)).at("d0") == 8 * 16  # cleared, then 8 blocks stored
    assert router.block_tokens == (16,)
    assert router.hits({}, len(PROMPT)) is None  # a prompt without identity: priced cache-blind


def test_a_lost_report_drops_the_mirror_until_the_next_full_delta():
    router = kairos_router()
    ids = block_ids(PROMPT, 16)
    router.report(replace(decode_state("d0"), prefix=prefix(0, stored=ids[:128], full=True)), now=0.0)
    router.report(replace(decode_state("d0"), prefix=prefix(2, removed=ids[:1])), now=0.1)  # seq 1 never came
    assert router.hits({16: ids}, len(PROMPT)).at("d0") == 0 and router.block_tokens == ()
    router.report(replace(decode_state("d0"), prefix=prefix(3, stored=ids[1:4])), now=0.2)
    assert router.hits({16: ids}, len(PROMPT)).at("d0") == 0  # still waiting for a full one
    router.report(replace(decode_state("d0"), prefix=prefix(4, stored=ids[:128], full=True)), now=0.3)
    assert router.hits({16: ids}, len(PROMPT)).at("d0") == 2048


def test_a_node_that_leaves_or_reports_itself_unhealthy_drops_its_cache():
    router = kairos_router()
    ids = block_ids(PROMPT, 16)
    for node in ("d0", "d1"):
        router.report(replace(decode_state(node), prefix=prefix(0, stored=ids[:128], full=True)), now=0.0)
    router.report(replace(decode_state("d0"), healthy=False), now=1.0)
    router.report(decode_state("d1"), now=1.0)
    assert router.hits({16: ids}, len(PROMPT)).tokens_by_node == {"d1": 2048}
    router.forget_silent_nodes(now=7.0)
    assert router.hits({16: ids}, len(PROMPT)).tokens_by_node == {} and router.block_tokens == ()


def test_a_turn_goes_to_the_node_holding_its_history_priced_by_its_uncached_suffix():
    router = kairos_router()
    ids = block_ids(PROMPT, 16)
    router.report(prefill_state("p0", []), now=0.0)
    router.report(decode_state("d0", batch=8), now=0.0)
    router.report(replace(decode_state("d1", batch=8), prefix=prefix(0, stored=ids[:128], full=True)), now=0.0)
    cold, _ = router.decide(1, len(PROMPT), 10, now=0.1)  # no hashes: the whole prompt priced
    decision, _ = router.decide(2, len(PROMPT), 10, now=0.1, block_ids={16: ids})
    assert decision.route is Route.DEFLECT and decision.decode_node == "d1"
    assert decision.cached_prompt_tokens == 2048 and sum(decision.chunk_schedule) == len(PROMPT) - 2048
    assert cold.route is Route.PREFILL  # priced whole, the same prompt is disaggregated
    view, _ = router.view(now=0.2)  # the ledger charges the uncached suffix only
    d1 = next(n for n in view.decode if n.node_id == "d1")
    assert d1.committed[-1] == decision.chunk_schedule and d1.committed_cached_tokens[-1] == 2048


def test_a_sample_goes_where_its_prompt_s_kv_is_held_before_that_node_reports_it():
    """``held_on`` (another sample of the prompt has its first token on d1): d1's hit is every full block of the
    prompt though d1's mirror is empty, so the sample is deflected there onto the cached prompt."""
    router = kairos_router()
    ids = block_ids(PROMPT, 16)
    router.report(prefill_state("p0", []), now=0.0)
    for node in ("d0", "d1"):
        router.report(replace(decode_state(node, batch=8), prefix=prefix(0, full=True)), now=0.0)
    assert router.hits({16: ids}, len(PROMPT)).tokens_by_node == {"d0": 0, "d1": 0}
    assert router.hits({16: ids}, len(PROMPT), held_on="d1").tokens_by_node == {"d0": 0, "d1": 2048 + 32}
    assert router.hits({16: ids[:128]}, 2048, held_on="d1").at("d1") == 2048 - 16  # the last token is computed
    unhinted, _ = router.decide(1, len(PROMPT), 10, now=0.1, block_ids={16: ids})
    decision, _ = router.decide(2, len(PROMPT), 10, now=0.1, block_ids={16: ids}, held_on="d1")
    assert unhinted.route is Route.PREFILL  # priced whole, the prompt is disaggregated
    assert decision.route is Route.DEFLECT and decision.decode_node == "d1"
    assert sum(decision.chunk_schedule) == len(PROMPT) - decision.cached_prompt_tokens <= 16


def test_a_live_router_switches_policy_on_its_configured_model_and_knobs():
    from kairos_ray.config import KairosConfig
    from kairos_ray.core import DecodeNodeView, PrefillNodeView, Route
    from kairos_ray.messages import DecisionRequest, NodeState
    from kairos_ray.serve.router import RouterActor
    from kairos_ray.serve.types import RouterOptions

    router = RouterActor(KairosConfig(), RouterOptions())
    for view in (PrefillNodeView("p0", (30_000,)), DecodeNodeView("d0", 0, 0, 1_000_000)):
        router.report(NodeState(view, "host", 0.0))
    request = [DecisionRequest(1, 200, 8)]  # a short prompt behind a long prefill queue: kairos deflects it
    assert router.decide_many(request)[0].decision.route is Route.DEFLECT
    before = router.state.policy
    router.model = replace(router.model, c0=3 * router.model.c0)  # as a refit adopts one
    assert router.use_policy("pd") == "kairos"
    assert router.decide_many([DecisionRequest(2, 200, 8)])[0].decision.route is Route.PREFILL
    assert router.state.policy.params == before.params and router.state.policy.decode_model is router.model
    assert router.model == KairosConfig().predictor.load()  # the refit starts over from the configured model


def shedding_router():
    config = KairosConfig.model_validate({"admission": {"mode": "shed"}})
    router = RouterState(config.build_policy("pd"), pending_ttl_s=2.0)
    router.report(prefill_state("p0", [60_000]), now=0.0)  # minutes of prefill queued: nothing meets 4 s there
    router.report(decode_state("d0"), now=0.0)
    return router


def test_a_shed_request_leaves_the_ledger_as_it_was_and_a_retry_is_never_shed():
    router = shedding_router()
    before, _ = router.view(now=0.1)
    decision, _ = router.decide(1, 500, 10, now=0.1, priority=0)
    assert decision.shed and decision.admission.retry_after_s > 0
    assert router.view(now=0.1)[0] == before and sum(router.residue().values()) == 0
    decision, _ = router.decide(1, 500, 10, now=0.2, sheddable=False)  # its retry, once admitted
    assert not decision.shed and decision.admission.admitted
    assert router.view(now=0.2)[0].prefill[0].queued_prompt_tokens == (60_000, 500)


def test_a_router_shard_decides_on_its_own_decode_nodes_and_takes_a_dead_shards_over():
    from kairos_ray.core.shards import assign

    shards = [RouterState(KairosConfig().build_policy("kairos"), shard=s, shards=2) for s in (0, 1)]
    nodes = [f"decode-{i:02d}" for i in range(12)]
    for router in shards:  # every shard takes every node's reports
        router.report(prefill_state("p0", [30_000]), now=0.0)  # a long queue: requests go to the decode nodes
        for node in nodes:
            router.report(decode_state(node), now=0.0)
    owners = assign(nodes, (0, 1))
    owned = {s: {n for n in nodes if owners[n] == s} for s in (0, 1)}
    assert len(owned[0]) == len(owned[1]) == 6
    for s, router in enumerate(shards):
        view, _ = router.view(now=0.1)
        assert [v.node_id for v in view.prefill] == ["p0"]  # the prefill nodes are every shard's
        assert {v.node_id for v in view.decode} == owned[s]
        for rid in range(6):
            assert router.decide(rid, 4_000, 16, now=0.1)[0].decode_node in owned[s]
    # shard 1 died: the requests that name shard 0 alone are decided on every decode node
    view, _ = shards[0].view(now=0.2, live=(0,))
    assert {v.node_id for v in view.decode} == set(nodes)
    assert shards[1].view(now=0.2, live=(0,))[0].decode == shards[1].view(now=0.2)[0].decode  # asked: it is live
    # a node leaves: the owners are dealt again over the eleven left
    shards[0].report(replace(decode_state(nodes[0]), healthy=False), now=0.3)
    view, _ = shards[0].view(now=0.3)
    assert {v.node_id for v in view.decode} == {n for n, s in assign(nodes[1:], (0, 1)).items() if s == 0}


def test_a_shard_that_owns_no_decode_node_decides_on_them_all():
    shards = [RouterState(KairosConfig().build_policy("kairos"), shard=s, shards=2) for s in (0, 1)]
    for router in shards:
        router.report(prefill_state("p0", []), now=0.0)
        router.report(decode_state("decode-only"), now=0.0)
    assert [router.decide(1, 500, 8, now=0.1)[0].decode_node for router in shards] == ["decode-only"] * 2
