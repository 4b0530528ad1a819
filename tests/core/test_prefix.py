"""Block hashing as vLLM does it, the LRU block cache, and its mirror of vLLM's KV events."""

import pytest

from kairos_ray.core import BlockCache, JournaledBlockCache, PrefixHits, block_hashes, block_ids
from kairos_ray.core.prefix import NONE_HASH, hash_block_tokens

# vLLM 0.32: init_none_hash(sha256); hash_block_tokens(sha256, None, range(16)), then chained with range(16, 32)
VLLM_FIRST = "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798"
VLLM_SECOND = "8be7aaa33831156d316f1f463ae57e643deb63f42e633e2d631df88815cc4629"


def test_hashes_are_vllms_for_the_same_tokens():
    first, second = block_hashes(list(range(32)), 16)
    assert (first.hex(), second.hex()) == (VLLM_FIRST, VLLM_SECOND)


def test_hashes_agree_with_the_installed_vllm():
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import sha256

    kv_cache_utils.init_none_hash(sha256)
    assert kv_cache_utils.NONE_HASH == NONE_HASH
    tokens = list(range(100, 164))
    expected, parent = [], None
    for start in range(0, 64, 16):
        parent = kv_cache_utils.hash_block_tokens(sha256, parent, tokens[start : start + 16])
        expected.append(parent)
    assert list(block_hashes(tokens, 16)) == expected


def test_only_full_blocks_are_hashed_and_each_names_its_whole_prefix():
    tokens = list(range(40))
    assert len(block_hashes(tokens, 16)) == 2  # the last 8 tokens fill no block
    changed = block_hashes([999, *tokens[1:]], 16)
    assert all(a != b for a, b in zip(block_hashes(tokens, 16), changed, strict=True))  # the chain carries it on
    assert block_hashes(tokens[:32], 16)[1] == hash_block_tokens(block_hashes(tokens, 16)[0], tokens[16:32])


def test_a_hit_is_the_leading_run_in_whole_blocks_short_of_the_last_token():
    cache = BlockCache(block_tokens=16)
    cache.pin(["a", "b", "d"])
    assert cache.cached_tokens(["a", "b", "c", "d"], 100) == 32  # "c" is missing: "d" cannot count
    assert cache.cached_tokens(["a", "b"], 32) == 16  # vLLM recomputes the last prompt token
    assert cache.cached_tokens(["x", "a"], 100) == 0


def test_free_blocks_are_evicted_least_recently_freed_first_and_a_request_s_tail_first():
    cache = BlockCache(block_tokens=16)
    cache.pin(["s", "a1", "a2"])
    cache.unpin(["s", "a1", "a2"])  # freed tail first: a2, a1, s
    cache.pin(["b1"])
    cache.unpin(["b1"])
    cache.trim(3)
    assert cache.cached_tokens(["s", "a1", "a2"], 100) == 32  # a2 went first
    cache.trim(1)  # then a1, then s; b1, freed last, stays
    assert cache.cached_tokens(["s"], 100) == 0 and cache.cached_tokens(["b1"], 100) == 16
    assert len(cache) == cache.free_blocks == 1


def test_held_blocks_are_never_evicted_and_sharing_is_counted():
    cache = BlockCache(block_tokens=16)
    cache.pin(["s", "a"])
    cache.pin(["s", "b"])  # "s" held twice: one block a per-request ledger counts twice
    assert cache.shared_blocks == 1
    cache.trim(0)
    assert len(cache) == 3
    cache.unpin(["s", "a"])
    assert cache.shared_blocks == 0 and cache.free_blocks == 1
    cache.trim(0)
    assert cache.cached_tokens(["s", "b"], 100) == 32 and cache.cached_tokens(["a"], 100) == 0


def test_the_cache_mirrors_vllms_kv_events():
    mirror = BlockCache(block_tokens=16)
    mirror.store([1, 2, 3])  # BlockStored
    assert mirror.cached_tokens([1, 2, 3, 4], 100) == 48
    mirror.remove([2])  # BlockRemoved: the chain breaks there
    assert mirror.cached_tokens([1, 2, 3], 100) == 16
    mirror.clear()  # AllBlocksCleared
    assert len(mirror) == 0


def test_ids_are_vllms_int_kv_event_hashes():
    tokens = list(range(64))
    ids = block_ids(tokens, 16)
    # vLLM's maybe_convert_block_hash: int.from_bytes(hash, "big") & (2**64 - 1)
    assert ids == tuple(int.from_bytes(h, "big") & (2**64 - 1) for h in block_hashes(tokens, 16))


def _mirrored(node: JournaledBlockCache, mirror: BlockCache) -> bool:
    delta = node.take()
    if delta is not None:
        mirror.apply(delta)
    return set(mirror._holders) == set(node._holders)


def test_a_journal_s_deltas_keep_a_mirror_equal_to_the_node_s_cache():
    node, mirror = JournaledBlockCache(16), BlockCache(16)
    first = node.take()
    assert first is not None and first.full and first.stored == ()  # the first report starts the mirror over
    assert node.take() is None  # nothing changed since
    node.pin([1, 2, 3])
    node.unpin([1, 2, 3])
    assert _mirrored(node, mirror)
    node.trim(1)  # 3 and 2 evicted: unpin freed the tail first
    node.store([2, 9])  # 2 comes back, 9 is new
    node.remove([9])  # and goes again before any report: never reported
    delta = node.take()
    assert delta is not None and not delta.full and 9 not in delta.stored + delta.removed
    mirror.apply(delta)
    assert set(mirror._holders) == set(node._holders)
    node.remove([1])
    node.store([1])  # out and back in within one report: the mirror still ends up holding it
    node.remove([1])
    assert _mirrored(node, mirror) and len(mirror) == len(node)


def test_a_cleared_cache_reports_in_full_and_a_full_take_restarts_a_mirror():
    node, mirror = JournaledBlockCache(16), BlockCache(16)
    node.store([1, 2])
    assert _mirrored(node, mirror)
    node.clear()
    node.store([5])
    delta = node.take()
    assert delta is not None and delta.full and delta.stored == (5,)
    mirror.apply(delta)
    assert set(mirror._holders) == {5}
    stale = BlockCache(16)  # a mirror that lost reports
    stale.store([7])
    stale.apply(node.take(full=True) or pytest.fail("a full take always answers"))
    assert set(stale._holders) == {5}


def test_hits_name_nodes():
    hits = PrefixHits({"decode-0": 6000})
    assert hits.at("decode-0") == 6000 and hits.at("decode-1") == 0
