"""The event loop, the KV link, the decode batcher and the sim/core agreement, on cases small enough to do by hand."""

import itertools
import operator
from dataclasses import replace

import pytest

from kairos_ray.core import (
    ClusterView,
    Decision,
    PolicyParams,
    PrefixHits,
    Route,
    StepLatencyModel,
    StepwiseLatency,
    make_policy,
)
from kairos_ray.emulation import ClusterHardware
from kairos_ray.nodes import DecodeNode
from kairos_ray.sim.cluster import ClusterSim, Kind
from kairos_ray.workloads import Request, Workload


class Fixed(StepwiseLatency):
    """Every step: 0.1 s plus 1 ms per prefill token, whatever the batch and KV."""

    def step_s(self, batch_size: int, kv_tokens: float, chunk_tokens: float, prefix_tokens: float = 0) -> float:
        return 0.1 + 0.001 * chunk_tokens


# 1 MB per token over 1 GB/s: 1 ms per token, plus 0.1 s setup
HW = ClusterHardware(
    kv_bytes_per_token=1_000_000,
    kv_link_gbytes_per_s=1.0,
    kv_link_setup_s=0.1,
    kv_capacity_tokens=100_000,
    max_batch_size=8,
    noise_cv=0.0,
)
MODEL = StepLatencyModel(0.1, 0.0, 0.0, 0.001, 0.0, 0.0)  # the same as Fixed, as a predictor
PARAMS = PolicyParams(prefill_chunk_tokens=100, chunk_candidates=(100,), static_chunk_tokens=100, tbt_slo_s=1.0)


def replay(spec, workload, num_prefill=1, num_decode=1, hardware=HW, seed=0):
    sim = ClusterSim(make_policy(spec, PARAMS, MODEL), Fixed(), hardware, num_prefill, num_decode, 100, seed)
    return sim.run(workload)


def simulate(spec, requests, num_prefill=1, num_decode=1, hardware=HW, seed=0):
    return replay(spec, Workload("test", tuple(Request(*r) for r in requests)), num_prefill, num_decode, hardware, seed)


def test_tie_order_is_written_down():
    assert [k.name for k in sorted(Kind)] == [
        "PREFILL_STEP_END",
        "DECODE_STEP_END",
        "KV_ARRIVAL",
        "KV_WAIT_END",
        "REQUEST_ARRIVAL",
    ]


def test_disaggregated_request_by_hand():
    (record,) = simulate("pd", [(0.0, 250, 3)]).records
    # prefill: 100, 100, 50 tokens -> 0.2 + 0.2 + 0.15 s; KV: 0.1 + 250 * 1 ms; first decode step 0.1 s
    assert record.route == "prefill"
    assert record.prefill_queue_s == pytest.approx(0.0)
    assert record.prefill_exec_s == pytest.approx(0.55)
    assert record.kv_transfer_s == pytest.approx(0.35)
    assert record.decode_queue_s == pytest.approx(0.1)
    assert record.ttft_s == pytest.approx(1.0)
    assert record.tbt_gaps_s.tolist() == pytest.approx([0.1, 0.1])
    assert record.finish_s == pytest.approx(1.2)


def test_deflected_request_by_hand():
    (record,) = simulate("sl:1000", [(0.0, 250, 3)]).records
    # chunks 100, 100, 50 on the decode node; the last one yields the first token; two decode steps follow
    assert record.route == "deflect" and record.prefill_node == ""
    assert record.ttft_s == pytest.approx(0.55)
    assert (record.prefill_queue_s, record.kv_transfer_s, record.decode_queue_s) == (0.0, 0.0, 0.0)
    assert record.tbt_gaps_s.tolist() == pytest.approx([0.1, 0.1])
    assert record.finish_s == pytest.approx(0.75)


def test_deflected_chunks_interleave_with_running_decodes():
    # A decodes from t = 1.0 (see the by-hand case); B is deflected at t = 1.05 onto the same node
    result = simulate("sl:100", [(0.0, 250, 10), (1.05, 100, 1)])
    a, b = result.records
    assert a.route == "prefill" and b.route == "deflect"
    # B's single chunk waits for the step in flight (ends 1.1), then runs with A's decode: 0.1 + 0.1 s
    assert b.prefill_queue_s == pytest.approx(0.05)
    assert b.ttft_s == pytest.approx(0.25)
    # A's gap during that step is the longer, mixed step
    assert sorted(a.tbt_gaps_s.tolist())[-1] == pytest.approx(0.2)


def test_transfers_to_one_decode_node_share_its_link():
    # two prefill nodes finish together (0.2 s); the second transfer waits for the first (0.2 s each)
    first, second = simulate("pd", [(0.0, 100, 1), (0.0, 100, 1)], num_prefill=2).records
    assert {first.prefill_node, second.prefill_node} == {"prefill-0", "prefill-1"}
    assert sorted([first.kv_transfer_s, second.kv_transfer_s]) == pytest.approx([0.2, 0.4])


def test_a_burst_of_hand_offs_spreads_over_the_decode_nodes():
    # each one is bound for its decode node from its decision on, through its prefill and KV transfer
    records = simulate("pd", [(0.0, 100, 5)] * 4, num_prefill=2, num_decode=2).records
    assert [r.decode_node for r in records] == ["decode-0", "decode-1", "decode-0", "decode-1"]


def test_decode_queue_waits_for_a_batch_slot():
    full = replace(HW, max_batch_size=1)
    first, second = simulate("pd", [(0.0, 100, 5), (0.0, 100, 5)], num_prefill=2, hardware=full).records
    # KV lands at 0.4 and 0.6; the first decodes 5 steps (0.4..0.9), the second starts after it
    assert first.decode_queue_s == pytest.approx(0.1)
    assert second.ttft_s == pytest.approx(1.0)
    assert second.decode_queue_s == pytest.approx(0.4)


def test_decode_queue_waits_for_kv_room():
    tight = replace(HW, kv_capacity_tokens=150)  # room for one request's prompt + output at a time
    first, second = simulate("pd", [(0.0, 100, 5), (0.0, 100, 5)], num_prefill=2, hardware=tight).records
    assert first.ttft_s == pytest.approx(0.5)
    assert second.ttft_s == pytest.approx(1.0)  # its KV landed at 0.6 but room frees only at 0.9


def test_a_deflection_never_fills_its_decode_node_past_its_kv(monkeypatch):
    # 1,000 prompt and 500 output tokens each, on a decode node of 2,500: after one deflection 1,000 are left
    overrun = []
    deflect = DecodeNode.deflect

    def watched(node, job):
        deflect(node, job)
        overrun.append(node.used_kv_tokens - node.kv_capacity_tokens)

    monkeypatch.setattr(DecodeNode, "deflect", watched)
    records = simulate("kairos", [(0.0, 1000, 500)] * 6, hardware=replace(HW, kv_capacity_tokens=2500)).records
    assert [r.route for r in records].count(Route.DEFLECT) == 1
    assert overrun == [-1000]


def test_an_arrival_sees_the_step_that_ends_at_the_same_instant():
    # A's single prefill step ends at exactly 0.2, when B arrives: B must find the prefill queue empty
    sim = ClusterSim(make_policy("pd", PARAMS, MODEL), Fixed(), HW, 1, 1, 100)
    result = sim.run(Workload("tie", (Request(0.0, 100, 1), Request(0.2, 100, 1))))
    b = result.requests[1]
    assert b.decision is not None
    assert b.decision.ttft_prefill_s == pytest.approx(0.2)  # its own step only, nothing queued ahead
    assert b.prefill_start_s == pytest.approx(0.2)


class Recording:
    """The real policy, with each (prompt, view, decision) it was asked kept for comparison."""

    def __init__(self, policy):
        self.policy, self.spec, self.calls = policy, policy.spec, []
        self.guards_chunks, self.decides_with_ground_truth = policy.guards_chunks, policy.decides_with_ground_truth
        self.params, self.decode_model = policy.params, policy.decode_model

    def chunk_guard(self, model=None):
        return self.policy.chunk_guard(model)

    def join_guard(self, model=None):
        return self.policy.join_guard(model)

    def model_of(self, node):
        return self.policy.model_of(node)

    def decide(
        self,
        prompt_tokens: int,
        view: ClusterView,
        hits: PrefixHits | None = None,
        priority: int = 0,
        output_tokens: int = 0,
    ) -> Decision:
        decision = self.policy.decide(prompt_tokens, view, hits, priority, output_tokens)
        self.calls.append((prompt_tokens, view, decision))
        return decision


@pytest.mark.parametrize("admission", ["off", "shed"])
def test_the_sim_shows_each_decision_the_view_the_routers_ledger_would(admission):
    """Requests arriving at one instant: each sees the cluster as ``apply_decision`` leaves it after the ones before,
    on both routes; so the simulator's node bookkeeping and the live router's ledger agree."""
    from kairos_ray.config import KairosConfig
    from kairos_ray.core import AdmissionMode, apply_decision
    from kairos_ray.sim.run import SimSetup

    setup = SimSetup.from_config(KairosConfig()).with_admission(AdmissionMode(admission))
    recording = Recording(setup.policy("kairos"))
    sim = ClusterSim(recording, setup.truth, setup.hardware, 2, 2, 2048)
    burst = [(1.0, prompt, 4) for prompt in (9000, 300, 12000, 700, 5000, 200, 16000, 900)]
    sim.run(Workload("burst", tuple(Request(*r) for r in burst)))
    calls = recording.calls
    assert {decision.route for _, _, decision in calls} == {Route.PREFILL, Route.DEFLECT}
    for (prompt, view, decision), (_, next_view, _) in itertools.pairwise(calls):
        assert next_view == apply_decision(view, prompt, decision, output_tokens=4)


def test_runs_are_deterministic_per_seed_and_lose_no_request():
    from kairos_ray.config import KairosConfig
    from kairos_ray.sim.run import SimSetup
    from kairos_ray.workloads.synthetic import synthetic

    setup = SimSetup.from_config(KairosConfig())
    workload = synthetic("bursty", 8, 400, seed=3)
    a, b = (setup.simulate("kairos", workload) for _ in range(2))
    assert [r.ttft_s for r in a.records] == [r.ttft_s for r in b.records]
    other = replace(setup, seed=9).simulate("kairos", workload)
    assert [r.ttft_s for r in other.records] != [r.ttft_s for r in a.records]
    assert len(a.records) == 400
    for r in a.records:
        parts = r.prefill_queue_s + r.prefill_exec_s + r.kv_transfer_s + r.decode_queue_s
        assert parts == pytest.approx(r.ttft_s)
        assert len(r.tbt_gaps_s) == r.output_tokens - 1
        assert r.finish_s >= r.arrival_s + r.ttft_s


# ---- prefix caching -----------------------------------------------------------------------------

# Turn 1: a 180-token prompt (3 whole 50-token blocks) and a 30-token answer; turn 2 at t = 10 s appends the
# answer and 90 new tokens: 300 prompt tokens whose first 4 blocks are turn 1's prompt and answer.
CONVERSATION = Workload(
    "two turns",
    (Request(0.0, 180, 30, (1, 2, 3, 4)), Request(10.0, 300, 2, (1, 2, 3, 4, 5, 6))),
    block_tokens=50,
)


def test_the_next_turn_is_deflected_to_its_history_by_hand():
    first, second = replay("kairos+prefix", CONVERSATION).records
    # turn 1, cold: 0.38 s either way, so alpha keeps it on the prefill node; 180 tokens travel
    assert (first.route, first.cached_tokens, first.kv_transfer_bytes) == ("prefill", 0, 180_000_000)
    # turn 2: the prefill node holds turn 1's prompt (150 tokens: 0.2 + 0.15 s to go), the decode node its prompt
    # and answer (200 tokens): one 100-token chunk, 0.2 s, which wins by alpha 1.2; nothing travels
    assert (second.route, second.cached_tokens, second.kv_transfer_bytes) == ("deflect", 200, 0)
    assert second.ttft_s == pytest.approx(0.2)


def test_a_cache_blind_policy_still_gets_the_engines_hits_by_hand():
    _, second = replay("kairos+blind", CONVERSATION).records
    # priced whole (0.6 s on either path), it goes to the prefill node, which computes the 150 tokens it lacks
    # (0.35 s); the decode node holds 200 of the 300 tokens, so 100 travel: 0.1 + 0.1 s; then a 0.1 s step
    assert (second.route, second.cached_tokens, second.kv_transfer_bytes) == ("prefill", 150, 100_000_000)
    assert second.ttft_s == pytest.approx(0.65)


def test_without_prefix_identity_no_node_keeps_a_cache():
    sim = ClusterSim(make_policy("kairos+prefix", PARAMS, MODEL), Fixed(), HW, 1, 1, 100)
    sim.run(Workload("cold", (Request(0.0, 100, 2),)))
    assert sim.prefill[0].cache is None and sim.decode[0].cache is None


def test_a_large_cluster_decides_on_its_index_as_the_exhaustive_search_would():
    """Views of nodes that did not change stay the same objects between decisions, so the policy's index
    updates only the changed ones (``core.index``), and a run decides exactly as pricing every node does."""
    from kairos_ray.config import KairosConfig
    from kairos_ray.sim.run import SimSetup
    from kairos_ray.workloads.synthetic import synthetic

    workload = synthetic("bursty", 160, 600, seed=2)
    runs = {}
    for prune in (True, False):
        setup = replace(SimSetup.from_config(KairosConfig.model_validate({"policy": {"prune": prune}})), num_prefill=24)
        recording = Recording(setup.policy("kairos"))
        sim = ClusterSim(recording, setup.truth, setup.hardware, 24, 24, 2048)
        runs[prune] = sim.run(workload), recording.calls
    (pruned, calls), (exhaustive, _) = runs[True], runs[False]
    assert [(r.route, r.decode_node, r.ttft_s) for r in pruned.records] == [
        (r.route, r.decode_node, r.ttft_s) for r in exhaustive.records
    ]
    assert sum(1 for r in pruned.records if r.route == Route.DEFLECT) > 50
    kept = [
        sum(map(operator.is_, view.decode, next_view.decode)) / len(view.decode)
        for (_, view, _), (_, next_view, _) in itertools.pairwise(calls)
    ]
    assert sorted(kept)[len(kept) // 2] > 0.8


def test_router_shards_each_decide_on_their_own_decode_nodes_and_count_what_another_shard_had_sooner():
    from kairos_ray.config import KairosConfig
    from kairos_ray.core.shards import assign, shard_for
    from kairos_ray.sim.run import SimSetup
    from kairos_ray.workloads.synthetic import synthetic

    setup = SimSetup.from_config(KairosConfig(), None, 2, 6, seed=1)
    workload = synthetic("bursty", 6, 400, seed=1)
    sharded = replace(setup, router_shards=3).simulate("kairos", workload)
    owners = assign([f"decode-{i}" for i in range(6)], range(3))
    for record in sharded.records:  # the request asked its shard, which sent it to a node of its own
        assert owners[record.decode_node] == shard_for(record.request_id, [0, 1, 2])
    assert sum(r.route == Route.DEFLECT for r in sharded.records) > 20
    assert sharded.kept_from_better is not None and 0 < sharded.kept_from_better < 1
    assert setup.simulate("kairos", workload).kept_from_better is None  # one router: nothing to miss
