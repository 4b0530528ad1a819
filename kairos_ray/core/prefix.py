"""Prefix identity of prompts: vLLM's chained block hashes, a node's LRU block cache, and the hits a policy reads.

A prompt's KV is held in blocks of ``block_tokens`` tokens. As in vLLM
(``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens``,
``get_request_block_hasher``), every *full* block is named by a hash chained
over everything before it,

    h_0 = H((NONE_HASH, tokens[0:b], None)),   h_i = H((h_{i-1}, tokens[i*b:(i+1)*b], None))

with H = sha256 of the pickled tuple (vLLM's default ``prefix_caching_hash_algo``)
and NONE_HASH = H("vllm-none-hash") (vLLM's seed when ``PYTHONHASHSEED`` is
unset). So a hash names a whole prefix, two prompts share exactly the leading
blocks whose hashes agree, and a partial last block is never cached.
``block_hashes`` reproduces vLLM's hashes bit for bit for plain text requests;
LoRA adapters, multimodal inputs, prompt embeddings and ``cache_salt`` add
extra keys to vLLM's tuple (the third element) and are not modelled.

The hashes are of token ids, after the tokenizer and the chat template: the
template's BOS and role markers are tokens like any other, so a system prompt
shared across conversations is a shared prefix only when the template renders
it first and identically (a per-request date in the template breaks it), and
the next turn of a conversation reuses the last turn's prompt *and answer*
only when the re-rendered history tokenizes to the same ids. Templates that
drop earlier turns' reasoning, and a detokenized answer that tokenizes
differently, cut the shared prefix at that point. The block size is the
engine's (vLLM: 16 on GPUs unless the attention backend needs another, 128
on CPUs); traces carry their own (Mooncake: 512).

``BlockCache`` is a node's cache of such blocks: reference counts for the
blocks running requests hold, the others evictable in LRU order (a request's
blocks are freed tail first, as vLLM frees them, so a long history loses its
end before its start). The simulator's and the emulated engines' nodes keep
one each (``kairos_ray.nodes``); a router can mirror an engine's cache from
vLLM's KV events with ``store``, ``remove`` and ``clear``.

A hit is the cache's leading run of the prompt's block hashes, capped at
``prompt_tokens - 1`` in whole blocks: vLLM recomputes at least the last
prompt token to get its logits. ``PrefixHits`` carries, per node, the hit of
the request being decided; the estimators then price only the uncached
suffix, each chunk from the cached context (Eq. 1-2, 5, 6).
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice

BlockHash = bytes | int
"""A block's chained hash: vLLM's sha256 bytes, or an integer id (traces; vLLM's int KV events)."""

NONE_HASH_SEED = "vllm-none-hash"


def _sha256(value: object) -> bytes:
    """vLLM's ``sha256``: SHA-256 of the object pickled with the highest protocol."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


NONE_HASH = _sha256(NONE_HASH_SEED)
"""The parent of a prompt's first block (vLLM's ``NONE_HASH`` for sha256 without ``PYTHONHASHSEED``)."""


def hash_block_tokens(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """One full block's hash, chained to its parent's (vLLM's ``hash_block_tokens`` with no extra keys)."""
    return _sha256((parent or NONE_HASH, tuple(token_ids), None))


def block_hashes(token_ids: Sequence[int], block_tokens: int) -> tuple[bytes, ...]:
    """Chained hashes of every full block of ``token_ids``; a partial last block has none."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    hashes: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        parent = hash_block_tokens(parent, token_ids[start : start + block_tokens])
        hashes.append(parent)
    return tuple(hashes)


def block_ids(token_ids: Sequence[int], block_tokens: int) -> tuple[int, ...]:
    """``block_hashes`` as the 64-bit integers vLLM's KV events carry (its default
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: the hash's last 8 bytes, big-endian)."""
    return tuple(event_id(h) for h in block_hashes(token_ids, block_tokens))


def event_id(block_hash: BlockHash) -> int:
    """A block hash as vLLM's int KV events name it (``maybe_convert_block_hash``); an int is one already."""
    return block_hash if isinstance(block_hash, int) else int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True, slots=True)
class CacheDelta:
    """A node's prefix-cache changes over an interval, folded: apply ``full`` (clear), then ``removed``, then
    ``stored`` (``BlockCache.apply``) and a mirror holds what the node holds."""

    full: bool  # the node's cache was cleared first: ``stored`` is every block it holds now
    stored: tuple[BlockHash, ...] = ()  # blocks cached since (vLLM's ``BlockStored``)
    removed: tuple[BlockHash, ...] = ()  # blocks evicted since (``BlockRemoved``); empty when ``full``


class BlockCache:
    """A node's prefix cache: blocks by chained hash, held ones counted, free ones evicted least recent first.

    ``pin`` and ``unpin`` are a request taking and releasing blocks (a pinned
    block is never evicted); ``trim`` evicts free blocks down to what the
    node's KV has room for. ``shared_blocks`` counts the pins beyond a
    block's first: a ledger that charges each request its whole prompt counts
    those blocks twice, and subtracts them.
    """

    def __init__(self, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self._holders: dict[BlockHash, int] = {}  # every cached block -> requests holding it (0: free)
        self._free: OrderedDict[BlockHash, None] = OrderedDict()  # free blocks, least recently freed first
        self.shared_blocks = 0  # sum over held blocks of (holders - 1)

    def __len__(self) -> int:
        return len(self._holders)

    @property
    def free_blocks(self) -> int:
        """Cached blocks no request holds (evictable)."""
        return len(self._free)

    def usable_blocks(self, hashes: Sequence[BlockHash], prompt_tokens: int) -> int:
        """Leading blocks of a prompt a hit may count: whole ones, at most ``prompt_tokens - 1`` tokens (its last
        token is computed whatever the cache holds, as vLLM does)."""
        return min(len(hashes), (prompt_tokens - 1) // self.block_tokens)

    def cached_tokens(self, hashes: Sequence[BlockHash], prompt_tokens: int) -> int:
        """Leading tokens of a prompt the cache holds: whole blocks, at most ``prompt_tokens - 1``."""
        holders = self._holders
        usable = self.usable_blocks(hashes, prompt_tokens)
        hit = 0
        while hit < usable and hashes[hit] in holders:
            hit += 1
        return hit * self.block_tokens

    def pin(self, hashes: Iterable[BlockHash]) -> None:
        """A request holds these blocks: cached ones are taken, missing ones (just computed) are added."""
        holders, free = self._holders, self._free
        for h in hashes:
            count = holders.get(h)
            if count is None:
                holders[h] = 1
            elif count == 0:
                del free[h]
                holders[h] = 1
            else:
                holders[h] = count + 1
                self.shared_blocks += 1

    def unpin(self, hashes: Sequence[BlockHash]) -> None:
        """A request releases these blocks; each one it was the last to hold becomes free, the tail first."""
        holders, free = self._holders, self._free
        for h in reversed(hashes):
            count = holders[h]
            if count == 1:
                holders[h] = 0
                free[h] = None
            else:
                holders[h] = count - 1
                self.shared_blocks -= 1

    def trim(self, max_free_blocks: int) -> None:
        """Evict least recently freed blocks until at most ``max_free_blocks`` free ones remain."""
        holders, free = self._holders, self._free
        while len(free) > max(0, max_free_blocks):
            h, _ = free.popitem(last=False)
            del holders[h]

    def store(self, hashes: Iterable[BlockHash]) -> None:
        """Mirror of vLLM's ``BlockStored`` event: these blocks are cached now (free until pinned)."""
        holders, free = self._holders, self._free
        for h in hashes:
            if h not in holders:
                holders[h] = 0
                free[h] = None

    def remove(self, hashes: Iterable[BlockHash]) -> None:
        """Mirror of vLLM's ``BlockRemoved`` event: the engine evicted these blocks."""
        for h in hashes:
            if self._holders.pop(h, None) is not None:
                self._free.pop(h, None)

    def clear(self) -> None:
        """Mirror of vLLM's ``AllBlocksCleared`` event."""
        self._holders.clear()
        self._free.clear()
        self.shared_blocks = 0

    def apply(self, delta: CacheDelta) -> None:
        """A node's reported changes (``JournaledBlockCache.take``), as its own cache went through them."""
        if delta.full:
            self.clear()
        self.remove(delta.removed)
        self.store(delta.stored)


class JournaledBlockCache(BlockCache):
    """A ``BlockCache`` that keeps its changes until they are taken: what a node reports to a router's mirror.

    Blocks come in (``pin`` of a block not cached, ``store``) and go (``trim``,
    ``remove``, ``clear``); ``take`` hands over the changes since the last
    ``take``, folded so that applying them is one set operation per block
    however often it came and went. The simulator's nodes use a plain
    ``BlockCache``: it keeps no journal.
    """

    def __init__(self, block_tokens: int) -> None:
        super().__init__(block_tokens)
        self._stored: dict[BlockHash, None] = {}  # in since the last take, in order
        self._removed: dict[BlockHash, None] = {}  # out since the last take (and cached before it)
        self._full = True  # the next take is the whole cache (the first one, or after a clear)

    def _came(self, hashes: Iterable[BlockHash]) -> None:
        for h in hashes:
            self._stored[h] = None

    def _went(self, hashes: Iterable[BlockHash]) -> None:
        for h in hashes:
            if h in self._stored:  # came since the last take (if it was cached before, ``_removed`` has it)
                del self._stored[h]
            elif not self._full:
                self._removed[h] = None

    def pin(self, hashes: Iterable[BlockHash]) -> None:
        hashes = tuple(hashes)
        self._came([h for h in hashes if h not in self._holders])
        super().pin(hashes)

    def trim(self, max_free_blocks: int) -> None:
        self._went(list(islice(self._free, max(0, len(self._free) - max(0, max_free_blocks)))))
        super().trim(max_free_blocks)

    def store(self, hashes: Iterable[BlockHash]) -> None:
        hashes = tuple(hashes)
        self._came([h for h in hashes if h not in self._holders])
        super().store(hashes)

    def remove(self, hashes: Iterable[BlockHash]) -> None:
        hashes = tuple(hashes)
        self._went([h for h in hashes if h in self._holders])
        super().remove(hashes)

    def clear(self) -> None:
        super().clear()
        self._stored.clear()
        self._removed.clear()
        self._full = True

    @property
    def changed(self) -> bool:
        """Whether ``take`` has something to hand over."""
        return self._full or bool(self._stored or self._removed)

    def take(self, full: bool = False) -> CacheDelta | None:
        """The changes since the last take (None: none); ``full``: the whole cache, for a mirror to start over."""
        if full or self._full:
            delta = CacheDelta(True, tuple(self._holders))
        elif self._stored or self._removed:
            delta = CacheDelta(False, tuple(self._stored), tuple(self._removed))
        else:
            return None
        self._stored.clear()
        self._removed.clear()
        self._full = False
        return delta


@dataclass(frozen=True, slots=True)
class PrefixHits:
    """Leading prompt tokens of the request being decided that each node's prefix cache holds (by node id).

    Built by the caller per request (``BlockCache.cached_tokens`` on each node's
    cache); a node it does not name holds nothing. Read-only for policies.
    """

    tokens_by_node: Mapping[str, int]

    def at(self, node_id: str) -> int:
        return self.tokens_by_node.get(node_id, 0)

    def within(self, prompt_tokens: int) -> PrefixHits:
        """These hits, each at most ``prompt_tokens`` - 1 and at least 0: a node computes at least the prompt's
        last token whatever its cache holds (vLLM does), so a schedule never has fewer than one token to run."""
        top = prompt_tokens - 1
        if all(0 <= hit <= top for hit in self.tokens_by_node.values()):
            return self
        return PrefixHits({node: min(max(hit, 0), top) for node, hit in self.tokens_by_node.items()})
