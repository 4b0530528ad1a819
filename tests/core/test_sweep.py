import itertools
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from kairos_ray.core import tbt_safe_schedule
from kairos_ray.core.sweep import largest_safe_chunk, largest_safe_runs

from .strategies import OWN, SIMPLE, budgets, candidate_sets, models, prompts, reference_largest_safe
from .test_latency import Stepwise

SMALL = (400, 200, 100)


def test_eq5_schedule_by_hand():
    # T(0, 0, 400) = 0.05 fits 0.051; at K=400, 400 would take 0.066 but 200 takes 0.038;
    # the last 100 tokens at K=600 take 0.026.
    assert tbt_safe_schedule(SIMPLE, 0, 0, 700, SMALL, 0.051) == (400, 200, 100)


def test_schedule_shrinks_as_kv_grows():
    # 200 stays safe up to K = 1000 (0.05), then only 100 fits: 0.01 + 100 * (1e-4 + 1e-7 K) <= 0.051 up to K = 3100
    assert tbt_safe_schedule(SIMPLE, 0, 0, 2000, SMALL, 0.051) == (400, 200, 200, 200, 200) + (100,) * 8


def test_schedule_shrinks_with_its_own_context_on_an_idle_node():
    # No batch and no other KV: each chunk pays only for its request's earlier chunks.
    # 400 at P = 0 takes 0.05; at P = 400, 0.066 > 0.051, but 200 takes 0.038 and fits up to P = 1000 (0.05);
    # from P = 1200 only 100 fits (0.01 + 100 * (1e-4 + 1e-7 P) <= 0.051 up to P = 3100).
    assert tbt_safe_schedule(OWN, 0, 0, 2000, SMALL, 0.051) == (400, 200, 200, 200, 200) + (100,) * 8


def test_schedule_does_not_shrink_when_only_the_nodes_other_kv_grows():
    # Other requests' KV costs the decode part of the step (c_kv), not the chunk: with room in the budget
    # for that (2e-4 s at 200K tokens), 200K more KV on the node leaves the schedule as it was.
    own = replace(OWN, c_kv=1e-9)
    idle = tbt_safe_schedule(own, 0, 0, 1600, SMALL, 0.055)
    assert idle == (400, 200, 200, 200, 200, 200, 100, 100)
    assert tbt_safe_schedule(own, 0, 200_000, 1600, SMALL, 0.055) == idle
    # in the paper's form (the chunk priced by all resident KV) the same node cannot take even 100 tokens
    assert tbt_safe_schedule(SIMPLE, 0, 200_000, 1600, SMALL, 0.055) is None


def test_last_chunk_is_what_is_left():
    assert tbt_safe_schedule(SIMPLE, 0, 0, 37, SMALL, 0.051) == (37,)


def test_infeasible_when_no_candidate_fits():
    # even the smallest step costs more than c0 = 0.01
    assert tbt_safe_schedule(SIMPLE, 0, 0, 700, SMALL, 0.009) is None
    # fits at first, then the KV built by the prompt itself pushes every candidate over budget
    assert tbt_safe_schedule(SIMPLE, 0, 0, 10_000, SMALL, 0.051) is None


def test_bigger_batch_gets_smaller_chunks():
    light = tbt_safe_schedule(SIMPLE, 0, 0, 1600, SMALL, 0.051)
    heavy = tbt_safe_schedule(SIMPLE, 15, 0, 1600, SMALL, 0.051)
    assert light is not None and heavy is not None
    assert max(heavy) < max(light)
    assert len(heavy) > len(light)


def test_limit_abandons_a_slow_node():
    assert largest_safe_runs(SIMPLE, 0, 0, 700, SMALL, 0.051, limit_s=0.2) is not None
    assert largest_safe_runs(SIMPLE, 0, 0, 700, SMALL, 0.051, limit_s=0.1) is None


@given(models(), prompts, candidate_sets, budgets)
def test_every_step_meets_eq5_and_chunks_never_grow(model, prompt, candidates, budget):
    batch_size, kv_tokens = 32, 50_000
    schedule = tbt_safe_schedule(model, batch_size, kv_tokens, prompt, candidates, budget)
    if schedule is None:
        return
    assert sum(schedule) == prompt
    prefix = 0
    for i, chunk in enumerate(schedule):
        assert model.step_s(batch_size, kv_tokens + prefix, chunk, prefix) <= budget
        assert chunk in candidates or i == len(schedule) - 1
        prefix += chunk
    assert all(a >= b for a, b in itertools.pairwise(schedule))


@given(models(), prompts, candidate_sets, budgets)
def test_matches_stepwise_largest_safe(model, prompt, candidates, budget):
    expected = reference_largest_safe(model, 16, 20_000, prompt, candidates, budget)
    assert tbt_safe_schedule(model, 16, 20_000, prompt, candidates, budget) == expected
    # the generic step-by-step latency path agrees with the closed form
    assert tbt_safe_schedule(Stepwise(model), 16, 20_000, prompt, candidates, budget) == expected


def test_run_time_guard_shrinks_or_holds_a_planned_chunk():
    # planned 400 at K = 400 takes 0.066 > 0.051; 200 takes 0.038
    assert largest_safe_chunk(SIMPLE, 1, 0, 400, SMALL, 0.052) == 400  # 0.051 with B = 1: still fits
    assert largest_safe_chunk(SIMPLE, 0, 400, 400, SMALL, 0.051) == 400  # no batch, no TBT to protect
    assert largest_safe_chunk(SIMPLE, 1, 400, 400, SMALL, 0.051) == 200
    assert largest_safe_chunk(SIMPLE, 45, 0, 400, SMALL, 0.051) == 0  # T0 alone is 0.055: wait a step


def test_run_time_guard_counts_the_chunks_own_prefix():
    # B = 1: 400 fits 0.052 at P = 0 (0.051); 400 tokens in, 400 would take 0.067, 200 takes 0.039
    assert largest_safe_chunk(OWN, 1, 400, 400, SMALL, 0.052, prefix_tokens=0) == 400
    assert largest_safe_chunk(OWN, 1, 400, 400, SMALL, 0.052, prefix_tokens=400) == 200
    assert largest_safe_chunk(OWN, 1, 300_000, 400, SMALL, 0.052) == 400  # the others' KV: not the chunk's


def test_a_cached_prefix_starts_the_schedule_from_a_long_context():
    # 500 uncached tokens after 6000 cached, on an idle node: 400 at P = 6000 takes 0.01 + 400 * 7e-4 > 0.051,
    # and with OWN even 100 does (0.08): the suffix cannot go here; a cold 500-token prompt can
    assert tbt_safe_schedule(OWN, 0, 0, 500, SMALL, 0.051, prefix_tokens=6000) is None
    assert tbt_safe_schedule(OWN, 0, 0, 500, SMALL, 0.051) == (400, 100)
    # at P = 200: 400 takes 0.058, 200 takes 0.034 and 0.038 at P = 400; the last 100 at P = 600: 0.026
    assert tbt_safe_schedule(OWN, 0, 0, 500, SMALL, 0.051, prefix_tokens=200) == (200, 200, 100)


@given(models(), prompts, st.integers(0, 32_768), candidate_sets, budgets)
def test_a_schedule_from_a_cached_prefix_meets_eq5_never_grows_and_covers_the_suffix(
    model, suffix, cached, candidates, budget
):
    batch_size, kv_tokens = 32, 50_000
    schedule = tbt_safe_schedule(model, batch_size, kv_tokens, suffix, candidates, budget, prefix_tokens=cached)
    if schedule is None:
        return
    assert sum(schedule) == suffix
    prefix = cached
    for chunk in schedule:
        assert model.step_s(batch_size, kv_tokens + prefix, chunk, prefix) <= budget
        prefix += chunk
    assert all(a >= b for a, b in itertools.pairwise(schedule))
