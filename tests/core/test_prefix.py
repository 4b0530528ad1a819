"""Block hashing as vLLM does it, the LRU block cache, and its mirror of vLLM's KV events."""

import pytest

from kairos_ray.core import BlockCache, PrefixHits, block_hashes
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


def test_hits_name_nodes():
    hits = PrefixHits({"decode-0": 6000})
    assert hits.at("decode-0") == 6000 and hits.at("decode-1") == 0
