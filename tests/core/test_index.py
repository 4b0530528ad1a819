"""Pruned decisions (core.index) are the exhaustive search's, on random fleets that change between decisions."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kairos_ray.core.index as index_module
import kairos_ray.core.policy as policy_module
from kairos_ray.config import resolve_profile
from kairos_ray.core import (
    AdmissionMode,
    AdmissionParams,
    ClusterView,
    DecodeNodeView,
    PolicyParams,
    PrefillNodeView,
    PrefixHits,
    StepLatencyModel,
    apply_decision,
    make_policy,
)
from kairos_ray.core.index import BLOCK, Floor, SortedBlocks, batch_cost_s, deflection_bound_s
from kairos_ray.core.sweep import largest_safe_runs
from tests.core.strategies import CANDIDATES, budgets, candidate_sets, models, prompts


@pytest.fixture(autouse=True)
def _min_nodes():
    kept = index_module.MIN_NODES
    yield
    index_module.MIN_NODES = kept


A100ISH = StepLatencyModel(
    c0=0.012, c_batch=8e-5, c_kv=2e-8, c_chunk=3.5e-5, c_chunk_kv=1e-10, c_chunk_sq=1e-9,
    c_chunk_prefix=2e-10, c_prefix=1e-8, c_batch_sq=2e-7, tile_tokens=128,
)  # fmt: skip
OWN_MODEL = replace(A100ISH, c0=0.009, c_batch=4e-5, c_chunk=1.2e-5)  # a node of a faster GPU


NODE_AND_PROMPT = {
    "model": models(),
    "batch": st.integers(0, 256),
    "kv": st.integers(0, 800_000),
    "prompt": prompts,
    "candidates": candidate_sets,
    "budget": budgets,
}


@settings(max_examples=400, deadline=None)
@given(**NODE_AND_PROMPT, wait=st.floats(0.0, 5.0))
def test_the_bound_is_below_every_largest_safe_schedule(model, batch, kv, prompt, candidates, budget, wait):
    found = largest_safe_runs(model, batch, kv, prompt, candidates, budget)
    bound = deflection_bound_s(model, prompt, wait, batch_cost_s(model, batch), kv, candidates, budget)
    if found is not None:
        assert bound <= wait + found[1]
    else:
        assert bound == float("inf") or bound > wait  # inf exactly when not even a one-token step fits
    if bound == float("inf"):
        assert found is None


@settings(max_examples=300, deadline=None)
@given(**NODE_AND_PROMPT, shares=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=3))
def test_the_floor_is_below_every_node_at_or_past_it(model, batch, kv, prompt, candidates, budget, shares):
    """E(x) and the lines drawn from it stay below the sweep of a node whose T0 - c0 is x or more, whatever its K."""
    found = largest_safe_runs(model, batch, kv, prompt, candidates, budget)
    step_s = batch_cost_s(model, batch) + model.c_kv * kv
    floor = Floor(model, prompt, candidates, budget)
    for x in sorted(share * step_s for share in shares):  # a search evaluates at ascending x
        if found is not None:
            assert floor.at(x) <= found[1]
            assert floor.below(step_s) <= found[1]
        elif floor.at(x) == float("inf"):
            assert floor.below(step_s) == float("inf")


def test_the_bound_is_close_to_the_sweep_on_the_shipped_profile():
    """The pruning reads only nodes whose bound is under the best time: it must count the steps that discrete
    chunk candidates take, also for long prompts whose chunks shrink as their prefix grows."""
    model = StepLatencyModel.load(resolve_profile("a100-deepseek-v2-lite"))
    params = PolicyParams()
    rng = random.Random(5)
    ratios = []
    for _ in range(400):
        batch, prompt = rng.randint(1, 128), rng.choice((rng.randint(1500, 4000), rng.randint(4000, 32_768)))
        kv = batch * rng.randint(500, 4000)
        found = largest_safe_runs(model, batch, kv, prompt, params.chunk_candidates, params.tbt_budget_s)
        if found is not None:
            bound = deflection_bound_s(
                model, prompt, 0.0, batch_cost_s(model, batch), kv, params.chunk_candidates, params.tbt_budget_s
            )
            ratios.append(bound / found[1])
    ratios.sort()
    assert len(ratios) > 300
    assert ratios[len(ratios) // 2] > 0.99
    assert ratios[len(ratios) // 10] > 0.95


@settings(max_examples=200, deadline=None)
@given(
    moves=st.lists(
        st.tuples(st.booleans(), st.integers(0, 10**6), st.floats(0.0, 1.0), st.just(0.0) | st.floats(0.0, 2.0)),
        max_size=400,
    )
)
def test_sorted_blocks_keep_their_pairs_in_order_with_each_blocks_least_wait(moves):
    """And name the pairs of least W in order of x: where a search starts."""
    blocks: SortedBlocks = SortedBlocks()
    held: dict[int, tuple[float, float]] = {}
    for id_, (add, pick, x, wait) in enumerate(moves):
        if add or not held:
            held[id_] = (x, wait)
            blocks.add((x, wait), id_)
        else:
            gone = sorted(held)[pick % len(held)]
            blocks.remove(held.pop(gone), gone)
    assert [pair for block in blocks.blocks for pair in block] == sorted((key, id_) for id_, key in held.items())
    assert all(0 < len(block) <= 2 * BLOCK for block in blocks.blocks)
    assert blocks.lows == [min(key[1] for key, _ in block) for block in blocks.blocks]
    least = min((wait for _, wait in held.values()), default=None)
    in_order = sorted((key, id_) for id_, key in held.items())
    assert list(blocks.least_waits()) == [id_ for (_, wait), id_ in in_order if wait == least]


def _decode(rng: random.Random, name: str, foreign: float = 0.0) -> DecodeNodeView:
    """A random decode node; of another GPU (its own model) with probability ``foreign``."""
    batch = rng.choice((0, 1, 2, 8, 32, 64, 128, rng.randint(0, 200)))
    kv = min(900_000, sum(rng.randint(100, 8000) for _ in range(batch)))
    committed = tuple(
        tuple(rng.choice((2048, 1024, 512)) for _ in range(rng.randint(1, 4))) for _ in range(rng.choice((0, 0, 1, 2)))
    )
    incoming = rng.choice((0, 0, 1, 3))
    prompts = incoming * rng.randint(500, 6000)
    return DecodeNodeView(
        name,
        batch_size=batch,
        kv_tokens=kv,
        free_kv_tokens=max(0, rng.choice((1_000_000, 200_000, 20_000)) - kv),
        committed=committed,
        head_prefilled_tokens=rng.choice((0, 512)) if committed else 0,
        incoming_requests=incoming,
        incoming_kv_tokens=prompts + incoming * rng.randint(0, 2000),
        incoming_prompt_tokens=prompts,
        incoming_transfers=incoming,
        incoming_transfer_tokens=incoming * rng.randint(0, 4000),
        finished_per_s=rng.choice((0.0, 2.0, 30.0)),
        model=OWN_MODEL if rng.random() < foreign else None,
    )


def _prefill(rng: random.Random, name: str, foreign: float = 0.0) -> PrefillNodeView:
    queued = tuple(rng.randint(1, 20_000) for _ in range(rng.choice((0, 0, 1, 3, 9))))
    prefilled = rng.choice((0, 2048)) if queued else 0
    return PrefillNodeView(name, queued, prefilled, model=OWN_MODEL if rng.random() < foreign else None)


def _fleet(rng: random.Random, num_prefill: int, num_decode: int, foreign: float = 0.0) -> ClusterView:
    decode = [_decode(rng, f"decode-{i}", foreign) for i in range(num_decode)]
    for i in range(0, num_decode - 1, 5):  # twins: the tie rule (the node first in the view) is exercised
        decode[i + 1] = replace(decode[i], node_id=f"decode-{i + 1}")
    prefill = [_prefill(rng, f"prefill-{i}", foreign) for i in range(num_prefill)]
    if num_prefill > 1:
        prefill[1] = replace(prefill[0], node_id="prefill-1")
    return ClusterView(tuple(prefill), tuple(decode))


def _hits(rng: random.Random, view: ClusterView, prompt: int) -> PrefixHits | None:
    if rng.random() < 0.5:
        return None
    nodes = [n.node_id for n in view.prefill] + [n.node_id for n in view.decode]
    return PrefixHits({n: rng.choice((0, 0, 16 * rng.randint(0, prompt // 16))) for n in nodes if rng.random() < 0.3})


def _report(rng: random.Random, view: ClusterView, foreign: float = 0.0) -> ClusterView:
    """A node's fresh report replaces its view (or, now and then, a node leaves or joins)."""
    decode, prefill = list(view.decode), list(view.prefill)
    roll = rng.random()
    if roll < 0.05 and len(decode) > 1:
        decode.pop(rng.randrange(len(decode)))
    elif roll < 0.1:
        decode.append(_decode(rng, f"decode-new-{rng.randrange(10**6)}", foreign))
    elif roll < 0.2:
        i = rng.randrange(len(prefill))
        prefill[i] = _prefill(rng, prefill[i].node_id, foreign)
    else:
        i = rng.randrange(len(decode))
        decode[i] = _decode(rng, decode[i].node_id, foreign)
    return ClusterView(tuple(prefill), tuple(decode))


@settings(max_examples=120, deadline=None)
@given(
    model=models() | st.just(A100ISH),
    seed=st.integers(0, 2**31),
    admission=st.booleans(),
    estimator=st.sampled_from(("exact", "paper")),
    link=st.sampled_from(((0, 0.0), (256, 2e5), (0, 5e4))),
    num_decode=st.integers(1, 40),
    foreign=st.sampled_from((0.0, 0.0, 0.05)),
)
def test_pruned_decisions_are_the_exhaustive_ones(model, seed, admission, estimator, link, num_decode, foreign):
    index_module.MIN_NODES = 1  # small fleets indexed too (restored by the fixture)
    rng = random.Random(seed)
    params = PolicyParams(
        chunk_candidates=CANDIDATES,
        prefill_estimator=estimator,
        handoff_setup_tokens=link[0],
        handoff_tokens_per_s=link[1],
        admission=AdmissionParams(AdmissionMode.SHED if admission else AdmissionMode.OFF),
    )
    pruned = make_policy("kairos", params, model)
    exhaustive = make_policy("kairos", replace(params, prune=False), model)
    view = _fleet(rng, rng.randint(1, 4), num_decode, foreign)
    for _ in range(25):
        prompt = rng.choice((rng.randint(1, 2048), rng.randint(1, 32_768)))
        hits = _hits(rng, view, prompt)
        priority, output = rng.choice((0, 0, 1)), rng.randint(0, 2000)
        decision = pruned.decide(prompt, view, hits, priority, output)
        assert decision == exhaustive.decide(prompt, view, hits, priority, output)
        view = apply_decision(view, prompt, decision, output)
        for _ in range(rng.choice((0, 1, 3))):
            view = _report(rng, view, foreign)


@pytest.mark.parametrize("baseline", ["pd", "sq:1", "sl:2048"])
def test_baselines_route_their_prefill_path_as_before(baseline):
    index_module.MIN_NODES = 1
    rng = random.Random(3)
    params = PolicyParams()
    pruned = make_policy(baseline, params, A100ISH)
    exhaustive = make_policy(baseline, replace(params, prune=False), A100ISH)
    view = _fleet(rng, 6, 30)
    for _ in range(200):
        prompt = rng.randint(1, 16_000)
        hits = _hits(rng, view, prompt)
        decision = pruned.decide(prompt, view, hits, output_tokens=200)
        assert decision == exhaustive.decide(prompt, view, hits, output_tokens=200)
        view = _report(rng, apply_decision(view, prompt, decision, 200))


def _sweeps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return largest_safe_runs(*args, **kwargs)

    monkeypatch.setattr(policy_module, "largest_safe_runs", counted)
    return calls


@pytest.mark.parametrize("foreign", [0.0, 0.3])
def test_a_decision_on_a_large_fleet_prices_few_of_its_nodes(monkeypatch, foreign):
    calls = _sweeps(monkeypatch)
    rng = random.Random(7)
    fleet = _fleet(rng, 2, 1024, foreign)  # 30 %: a mixed fleet, each model's nodes in lists of their own
    decisions = 200
    for prune in (False, True):
        policy = make_policy("kairos", PolicyParams(prune=prune), A100ISH)
        view = fleet
        calls[0] = 0
        for _ in range(decisions):  # each decision on the view the last one left, as in the router
            prompt = rng.randint(64, 8000)
            view = apply_decision(view, prompt, policy.decide(prompt, view), 256)
        if prune:
            assert calls[0] / decisions < 0.015 * len(view.decode)
        else:
            assert calls[0] / decisions > 0.3 * len(view.decode)


def test_a_model_with_a_negative_coefficient_prices_every_node(monkeypatch):
    calls = _sweeps(monkeypatch)
    odd = replace(A100ISH, c_prefix=-1e-9)  # a refit may fit one: the bounds would not hold
    view = _fleet(random.Random(8), 2, 64)
    counts = []
    for prune in (True, False):
        calls[0] = 0
        make_policy("kairos", PolicyParams(prune=prune), odd).decide(3000, view)
        counts.append(calls[0])
    assert counts[0] == counts[1] > 0


def test_a_node_whose_own_model_has_no_bounds_has_every_node_priced(monkeypatch):
    calls = _sweeps(monkeypatch)
    view = _fleet(random.Random(8), 2, 64)
    odd = replace(view.decode[5], model=replace(A100ISH, c_prefix=-1e-9))
    counts = {}
    for name, fleet in (
        ("bounded", view),
        ("odd", ClusterView(view.prefill, (*view.decode[:5], odd, *view.decode[6:]))),
    ):
        for prune in (True, False):
            policy = make_policy("kairos", PolicyParams(prune=prune), A100ISH)
            first = policy.decide(3000, fleet)  # the index is built once views hold still between decisions
            calls[0] = 0
            policy.decide(3000, apply_decision(fleet, 3000, first, 100))
            counts[name, prune] = calls[0]
    assert counts["bounded", True] < counts["bounded", False]
    assert counts["odd", True] == counts["odd", False] > 0
