import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kairos_ray.core import (
    DecodeNodeView,
    PrefillNodeView,
    decode_ttft_s,
    prefill_ttft_exact_s,
    prefill_ttft_paper_s,
    queue_wait_paper_s,
)
from kairos_ray.core.estimate import QueueWalks, after_committed, queue_wait_exact_s, runs_of

from .strategies import OWN, SIMPLE, models

QUEUE = PrefillNodeView("p0", (300, 100))


def test_eq2_queue_wait_by_hand():
    # S = 400, chi_p = 200: 400/200 * T(0, 200, 200) = 2 * (0.01 + 200 * (1e-4 + 2e-5)) = 0.068
    assert queue_wait_paper_s(SIMPLE, 400, 200) == pytest.approx(0.068)
    assert queue_wait_paper_s(SIMPLE, 0, 200) == 0.0


def test_eq1_paper_estimate_by_hand():
    # W_queue = 0.068; T_pf(100) = 100/200 * T(0, 50, 200) = 0.5 * (0.01 + 200 * 1.05e-4) = 0.0155
    assert prefill_ttft_paper_s(SIMPLE, QUEUE, 100, 200) == pytest.approx(0.0835)


def test_exact_estimate_walks_the_fifo_by_hand():
    # 300 tokens: T(0,0,200) + T(0,200,100) = 0.03 + 0.022; 100 tokens: 0.02; then r (100): 0.02
    assert prefill_ttft_exact_s(SIMPLE, QUEUE, 100, 200) == pytest.approx(0.092)


def test_exact_estimate_counts_the_heads_cached_context():
    head_done = PrefillNodeView("p0", (100,), head_prefilled_tokens=1000)
    # head: T(0, 1000, 100) = 0.01 + 100 * (1e-4 + 1e-4) = 0.03; r: 0.02
    assert prefill_ttft_exact_s(SIMPLE, head_done, 100, 200) == pytest.approx(0.05)


def test_prefill_chunks_pay_for_their_own_prompts_prefix_by_hand():
    # 300 tokens: T(0, 0, 200) + 100 tokens at P = 200: 0.03 + 0.01 + 100 * (1e-4 + 2e-5) = 0.052;
    # 100 tokens from P = 0: 0.02; r (100): 0.02. The paper's form gives the same: on a prefill node K = P.
    assert prefill_ttft_exact_s(OWN, QUEUE, 100, 200) == pytest.approx(0.092)
    # Eq. 2: the S / 2 cached tokens are the context each chunk attends over: 2 * T(0, 200, 200, P = 200)
    assert queue_wait_paper_s(OWN, 400, 200) == pytest.approx(0.068)


def test_estimators_differ_when_a_short_prompt_waits_behind_a_long_one():
    queue = PrefillNodeView("p0", (30_000, 200))
    paper, exact = (f(SIMPLE, queue, 200, 2048) for f in (prefill_ttft_paper_s, prefill_ttft_exact_s))
    assert paper != pytest.approx(exact, rel=0.01)


@given(models(), st.lists(st.integers(1, 32_768), max_size=8), st.integers(1, 32_768), st.integers(1, 32_768))
def test_more_queued_work_never_shortens_the_estimate(model, queue, extra, prompt):
    for estimate in (prefill_ttft_paper_s, prefill_ttft_exact_s):
        before = estimate(model, PrefillNodeView("p", tuple(queue)), prompt, 2048)
        after = estimate(model, PrefillNodeView("p", (*queue, extra)), prompt, 2048)
        assert after >= before


def test_eq6_decode_ttft_by_hand():
    # T(0,0,400) + T(0,400,200) + T(0,600,100) = 0.05 + 0.038 + 0.026
    assert decode_ttft_s(SIMPLE, 0, 0, (400, 200, 100)) == pytest.approx(0.114)


def test_eq6_prices_each_chunk_by_its_own_prefix_by_hand():
    # T(0,0,400,P=0) + T(0,400,200,P=400) + T(0,600,100,P=600), the node's 10^6 other KV tokens aside
    assert decode_ttft_s(OWN, 0, 1_000_000, (400, 200, 100)) == pytest.approx(0.114)
    # a deflection 400 tokens in: its next chunks start from that prefix
    assert decode_ttft_s(OWN, 0, 400, (200, 100), prefix_tokens=400) == pytest.approx(0.064)


# ---- cached prefixes ----------------------------------------------------------------------


def test_exact_estimate_prices_only_the_uncached_suffix_from_its_context():
    # 1300 tokens, 1000 cached: T(0, 1000, 200) + T(0, 1200, 100) = 0.05 + 0.032
    assert prefill_ttft_exact_s(SIMPLE, PrefillNodeView("p0"), 1300, 200, cached_tokens=1000) == pytest.approx(0.082)


def test_exact_estimate_walks_a_queue_of_cached_prompts_by_hand():
    queue = PrefillNodeView("p0", (100, 100), queued_cached_tokens=(0, 2000))
    # head from 0: 0.02; the next from its cached 2000: 0.01 + 100 * (1e-4 + 2e-4) = 0.04; r: 0.02
    assert prefill_ttft_exact_s(SIMPLE, queue, 100, 200) == pytest.approx(0.08)
    # the head's context is its hit plus what it prefilled since: 1500, so 0.01 + 100 * 2.5e-4
    head = PrefillNodeView("p0", (100,), head_prefilled_tokens=500, queued_cached_tokens=(1000,))
    assert head.context_tokens(0) == 1500
    assert prefill_ttft_exact_s(SIMPLE, head, 100, 200) == pytest.approx(0.035 + 0.02)


def test_paper_estimate_prices_the_suffix_from_its_cached_context():
    # 300 uncached tokens after 1000: 300 / 200 * T(0, 1000 + 150, 200) = 1.5 * (0.01 + 200 * 2.15e-4)
    assert prefill_ttft_paper_s(SIMPLE, PrefillNodeView("p0"), 1300, 200, cached_tokens=1000) == pytest.approx(0.0795)


def test_a_committed_deflection_starts_from_its_cached_prefix():
    node = DecodeNodeView(
        "d0", 0, 0, 10_000, committed=((200, 100),), committed_cached_tokens=(1000,)
    )  # not started: its 1000 cached tokens join K with its first chunk
    # T(0, 1000, 200) + T(0, 1200, 100) = 0.05 + 0.032; it then decodes with its whole prompt in K
    assert after_committed(SIMPLE, node) == pytest.approx((0.082, 1, 1300))
    under_way = DecodeNodeView(
        "d0", 0, 1200, 10_000, committed=((100,),), head_prefilled_tokens=200, committed_cached_tokens=(1000,)
    )  # 200 prefilled: K holds its hit already
    assert after_committed(SIMPLE, under_way) == pytest.approx((0.032, 1, 1300))


@given(
    models(),
    st.integers(0, 128),
    st.integers(0, 400_000),
    st.lists(st.integers(1, 2048), max_size=40),
    st.integers(0, 8192),
)
def test_eq6_equals_the_plain_sum(model, batch_size, kv_tokens, schedule, prefix):
    expected, kv, own = 0.0, kv_tokens, prefix
    for chunk in schedule:
        expected += model.step_s(batch_size, kv, chunk, own)
        kv += chunk
        own += chunk
    got = decode_ttft_s(model, batch_size, kv_tokens, schedule, prefix)
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_runs_of_groups_equal_neighbours():
    assert runs_of((512, 512, 256, 256, 256, 100)) == [(512, 2), (256, 3), (100, 1)]
    assert runs_of(()) == []


def test_committed_deflections_run_first_and_join_the_batch():
    node = DecodeNodeView("d0", batch_size=0, kv_tokens=0, free_kv_tokens=10_000, committed=((100,), (100,)))
    # first: T(0, 0, 100) = 0.02; second: T(1, 100, 100) = 0.01 + 0.001 + 100 * 1.1e-4 = 0.022
    seconds, batch_size, kv_tokens = after_committed(SIMPLE, node)
    assert seconds == pytest.approx(0.042)
    assert (batch_size, kv_tokens) == (2, 200)


def test_a_committed_deflection_under_way_continues_from_its_prefix():
    node = DecodeNodeView(
        "d0",
        batch_size=0,
        kv_tokens=1000,
        free_kv_tokens=10_000,
        committed=((100,), (100,)),
        head_prefilled_tokens=1000,
    )
    # the head's last chunk: T(0, 1000, 100, P = 1000) = 0.03; the next starts from P = 0: T(1, 1100, 100) = 0.021
    seconds, batch_size, kv_tokens = after_committed(OWN, node)
    assert seconds == pytest.approx(0.051)
    assert (batch_size, kv_tokens) == (2, 1200)


@given(
    models(),
    st.lists(
        st.tuples(st.sampled_from(["grow", "pop", "head"]), st.integers(1, 9000), st.integers(0, 2048)),
        min_size=1,
        max_size=40,
    ),
)
def test_a_resumed_queue_walk_equals_the_full_walk_bit_for_bit(model, changes):
    """Queues growing at the tail (resumed), losing their head or changing it (walked again) price as walked whole."""
    walks = QueueWalks(min_items=1)
    queued: tuple[int, ...] = ()
    cached: tuple[int, ...] = ()
    committed: tuple[tuple[int, ...], ...] = ()
    head = 0
    for change, tokens, hit in changes:
        if change == "grow":
            queued, committed = (*queued, tokens), (*committed, (min(tokens, 512),) * (1 + tokens // 512))
            cached = (*cached, hit) if hit % 3 == 0 else cached  # () and short tuples mean the rest cached nothing
        elif change == "pop" and queued:
            queued, committed, cached = queued[1:], committed[1:], cached[1:]
        else:
            head = hit
        prefill = PrefillNodeView("p0", queued, head_prefilled_tokens=head, queued_cached_tokens=cached[: len(queued)])
        decode = DecodeNodeView(
            "d0",
            3,
            5000,
            10**6,
            committed,
            head_prefilled_tokens=head,
            committed_cached_tokens=cached[: len(committed)],
        )
        assert queue_wait_exact_s(model, prefill, 512, walks) == queue_wait_exact_s(model, prefill, 512)
        assert after_committed(model, decode, walks) == after_committed(model, decode)


def test_a_walk_is_not_resumed_for_another_model_or_head():
    walks = QueueWalks(min_items=1)
    node = PrefillNodeView("p0", (4000, 300))
    first = queue_wait_exact_s(SIMPLE, node, 512, walks)
    slower = dataclasses.replace(SIMPLE, c0=0.02)
    assert queue_wait_exact_s(slower, node, 512, walks) == queue_wait_exact_s(slower, node, 512) != first
    moved = PrefillNodeView("p0", (4000, 300), head_prefilled_tokens=1024)
    assert queue_wait_exact_s(SIMPLE, moved, 512, walks) == queue_wait_exact_s(SIMPLE, moved, 512) != first
