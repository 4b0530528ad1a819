"""The node models with a prefix cache: hits taken, suffixes computed, blocks kept and evicted, views as the ledger."""

import pytest

from kairos_ray.core import BlockCache, ClusterView, Decision, Route, StepLatencyModel, apply_decision, join_guard
from kairos_ray.nodes import FINISH_WINDOW, DecodeNode, FinishRate, Job, PrefillNode, covering


def decode_node(capacity_tokens: int = 10_000) -> DecodeNode:
    return DecodeNode("d", kv_capacity_tokens=capacity_tokens, max_batch_size=8, cache=BlockCache(50))


def run_deflection(node: DecodeNode, job: Job) -> None:
    """Commit ``job`` and step the node until its prefill is done."""
    node.deflect(job)
    while job in node.deflections:
        node.begin_step(0.0)
        node.end_step(0.0, 0.1)


def test_a_schedule_is_cut_to_the_uncached_suffix_or_topped_up():
    assert covering((400, 400, 200), 500) == (400, 100)
    assert covering((200, 100), 300) == (200, 100)
    assert covering((200,), 300) == (200, 100)  # the cache lost blocks since the plan


def test_a_deflected_turn_takes_its_history_and_computes_the_rest_from_there():
    node = decode_node()
    run_deflection(node, Job(0, 0.0, 180, 31, schedule=(100, 80), block_hashes=(1, 2, 3, 4)))
    node.begin_step(0.0)  # its 30 decode steps: it holds prompt and answer
    while node.running:
        node.end_step(0.0, 0.1)
        node.begin_step(0.0)
    # 180 + 31 - 1 tokens have KV: 4 whole blocks stay cached
    assert node.cache is not None and node.cache.cached_tokens((1, 2, 3, 4, 5, 6), 300) == 200
    turn = Job(1, 0.0, 300, 2, schedule=(100, 100, 100), block_hashes=(1, 2, 3, 4, 5, 6))  # planned cache-blind
    node.deflect(turn)
    assert (turn.cached_tokens, turn.schedule) == (200, (100,))
    assert node.begin_step(0.0) == (0, 200, 100)  # the history is resident with the chunk
    assert node.prefix_tokens == 200  # and the chunk attends over it (Eq. 4's P)
    node.end_step(0.0, 0.1)
    assert node.kv_tokens == 300 and node.running == 1


def test_free_blocks_give_way_to_the_kv_of_new_requests():
    node = decode_node(capacity_tokens=150)
    run_deflection(node, Job(0, 0.0, 100, 1, schedule=(100,), block_hashes=(1, 2)))
    assert node.cache is not None and node.cache.cached_tokens((1, 2, 3), 150) == 100
    node.deflect(Job(1, 0.0, 100, 50, schedule=(100,), block_hashes=(7, 8)))  # takes all 150 tokens
    assert node.cache.cached_tokens((1, 2, 3), 150) == 0


def test_a_hand_off_carries_only_the_blocks_the_decode_node_lacks():
    node = decode_node()
    run_deflection(node, Job(0, 0.0, 100, 1, schedule=(100,), block_hashes=(1, 2)))
    assert node.expect(Job(1, 0.0, 230, 5, block_hashes=(1, 2, 3, 4))) == 130


def test_an_assigned_hand_off_counts_on_its_decode_node_until_it_joins_the_batch():
    node = DecodeNode("d", kv_capacity_tokens=10_000, max_batch_size=8)
    job = Job(0, 0.0, 1000, 50)
    node.assign(job)  # decided: its prefill and KV transfer are still to come
    view = node.view()
    assert (view.batch_size, view.incoming_requests, view.incoming_kv_tokens, view.free_kv_tokens) == (
        0,
        1,
        1050,
        10_000,
    )
    node.transferred(job, 0.5)  # waiting for a step start
    assert (node.view().incoming_requests, node.view().incoming_kv_tokens) == (1, 1050)
    assert node.begin_step(0.5) == (1, 1000, 0)
    view = node.view()
    assert (view.batch_size, view.incoming_requests, view.incoming_kv_tokens, view.free_kv_tokens) == (1, 0, 0, 8_950)


def test_a_hand_offs_transfer_counts_on_its_decode_node_until_its_kv_arrives():
    node = DecodeNode("d", kv_capacity_tokens=10_000, max_batch_size=8)
    job = Job(
        0, 0.0, 1000, 50, decision=Decision(Route.PREFILL, "p", "d", (), 1.0, None, "", receiver_cached_tokens=400)
    )
    node.assign(job)
    assert (node.view().incoming_transfers, node.view().incoming_transfer_tokens) == (1, 600)
    node.transferred(job, 0.5)  # landed: off the link, still bound for the batch
    view = node.view()
    assert (view.incoming_transfers, view.incoming_transfer_tokens, view.incoming_requests) == (0, 0, 1)


def test_a_decode_node_reports_how_fast_it_finishes_requests():
    node = DecodeNode("d", kv_capacity_tokens=100_000, max_batch_size=64)
    assert node.view().finished_per_s == 0.0  # nothing finished: unknown
    for i in range(FINISH_WINDOW + 8):  # one request finishing every 0.5 s
        node.transferred(Job(i, 0.0, 10, 1), 0.0)
        node.begin_step(0.5 * i)
        node.end_step(0.5 * (i + 1), 0.5)
    assert node.view().finished_per_s == 2.0


def test_with_a_join_guard_a_waiting_hand_off_joins_only_within_the_budget():
    # T = 0.01 + 0.02 B: two in the batch fit 0.055 s, three do not
    node = DecodeNode("d", 10_000, 8, join_guard=join_guard(StepLatencyModel(0.01, 0.02, 0, 0, 0, 0), 0.055))
    for i in range(3):
        node.transferred(Job(i, 0.0, 10, 5), 0.0)
    assert node.begin_step(0.0) == (2, 20, 0)  # the third waits
    node.end_step(0.05, 0.05)
    assert len(node.waiting) == 1


def test_a_prefill_node_computes_the_uncached_suffix_and_keeps_the_prompt():
    node = PrefillNode("p", 100, cache=BlockCache(50), kv_capacity_tokens=10_000)
    first = Job(0, 0.0, 150, 1, block_hashes=(1, 2, 3))
    node.enqueue(first)
    while node.queue:
        node.begin_step(0.0)
        node.end_step(0.0)
    second = Job(1, 0.0, 260, 1, block_hashes=(1, 2, 3, 4, 5))
    node.enqueue(second)
    assert second.cached_tokens == 150
    assert node.view().queued_prompt_tokens == (110,) and node.view().queued_cached_tokens == (150,)
    assert node.begin_step(0.0) == (150, 100)  # from its cached context on


def test_a_deflection_on_held_blocks_leaves_the_view_the_ledger_expects():
    node = decode_node()
    node.deflect(Job(0, 0.0, 100, 500, schedule=(100,), block_hashes=(1, 2)))  # holds blocks 1 and 2 from now
    node.begin_step(0.0)
    node.end_step(0.0, 0.1)
    before = node.view()
    turn = Job(1, 0.0, 150, 5, schedule=(50,), block_hashes=(1, 2, 9))
    node.deflect(turn)
    decision = Decision(Route.DEFLECT, None, "d", (50,), 1.0, 0.1, "", cached_prompt_tokens=100)
    assert node.view() == apply_decision(ClusterView((), (before,)), 150, decision, 5).decode[0]


def test_a_deflection_on_free_blocks_takes_them_off_the_free_kv_the_ledger_shows():
    node = decode_node()
    run_deflection(node, Job(0, 0.0, 100, 1, schedule=(100,), block_hashes=(1, 2)))  # finished: blocks free
    before = node.view()
    node.deflect(Job(1, 0.0, 150, 5, schedule=(50,), block_hashes=(1, 2, 9)))
    decision = Decision(Route.DEFLECT, None, "d", (50,), 1.0, 0.1, "", cached_prompt_tokens=100)
    ledger = apply_decision(ClusterView((), (before,)), 150, decision, 5).decode[0]
    assert ledger.free_kv_tokens - node.view().free_kv_tokens == 100  # the node's next report corrects it


def test_a_decode_nodes_finishing_rate_follows_its_last_finishes():
    rate = FinishRate()
    assert rate.per_s == 0.0  # unknown until two finishes
    rate.finished(10.0)
    assert rate.per_s == 0.0
    for i in range(1, 5):
        rate.finished(10.0 + 0.5 * i)  # 2 a second
    assert rate.per_s == pytest.approx(2.0)
    for i in range(FINISH_WINDOW):
        rate.finished(20.0 + 0.1 * i)  # a burst: 10 a second, the slow ones out of the window
    assert rate.per_s == pytest.approx(10.0)
