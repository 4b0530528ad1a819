"""A vLLM engine's prefix cache as the router sees it: vLLM's own KV cache events, mirrored in the engine's actor.

vLLM's scheduler, which owns the prefix cache, runs in the engine core
process, and its KV events (``vllm/distributed/kv_events.py``: ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``, taken from the block pool after each
step) leave that process only through an event publisher: ``null`` drops them
and there is no in-process hook (a custom publisher would have to be
registered inside the engine core, and ``KVEventsConfig.publisher`` accepts
only ``null`` or ``zmq``). So each engine runs vLLM's ZMQ publisher on a
private IPC socket in its staging directory (``ipc://`` binds there, nothing
listens on the network) and its actor subscribes to it: one msgpack batch per
engine step that changed the cache, a sequence number each.

The events name blocks by vLLM's chained hashes: 64-bit ints by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), sha256 bytes without it; the mirror
keeps both as ints (``core.prefix.event_id``), as the ingress hashes prompts
(``core.prefix.block_ids``). The mirror is a ``JournaledBlockCache``: the
node's reports carry its changes (``engines.reporting``). A gap in the
publisher's sequence numbers (a batch dropped past ZMQ's high-water mark)
clears the mirror: the router then knows only what the engine caches from
there on, a smaller hit than the engine's, never a larger one.

The router's hashes match the engine's only with vLLM's default hash
(``prefix_caching_hash_algo: sha256``, ``PYTHONHASHSEED`` unset); with
another the engine's hashes are its own and nothing is mirrored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

from kairos_ray.core import JournaledBlockCache
from kairos_ray.core.prefix import event_id

logger = logging.getLogger("ray.serve")

TOPIC = b"kv"


def events_endpoint(staging_dir: str) -> str:
    """The engine's private event socket (in its staging directory, which only this user can enter)."""
    return f"ipc://{os.path.join(staging_dir, 'kv-events')}"


def events_config(endpoint: str) -> Any:
    """vLLM's ``KVEventsConfig`` publishing to ``endpoint`` (no replay socket: a gap clears the mirror)."""
    from vllm.config.kv_events import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic=TOPIC.decode())


def mirrorable(cache_config: Any) -> str:
    """Why the router cannot match this engine's block hashes ("" when it can)."""
    if not cache_config.enable_prefix_caching:
        return "prefix caching is off"
    if cache_config.prefix_caching_hash_algo != "sha256":
        return f"prefix_caching_hash_algo is {cache_config.prefix_caching_hash_algo}, the router hashes with sha256"
    if "PYTHONHASHSEED" in os.environ:
        return "PYTHONHASHSEED is set: vLLM seeds its first block's parent hash with it"
    return ""


class KVEventMirror:
    """Subscribes to an engine core's KV events and applies them to ``cache``."""

    def __init__(self, cache: JournaledBlockCache, endpoint: str, on_change: Callable[[], None] | None = None) -> None:
        self.cache, self.endpoint, self.on_change = cache, endpoint, on_change
        self._next_seq = 0
        self._task: asyncio.Task[None] | None = None
        self._socket: Any = None

    def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._socket.connect(self.endpoint)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        from msgspec.msgpack import Decoder
        from vllm.distributed.kv_events import KVEventBatch

        decoder = Decoder(type=KVEventBatch)
        while True:
            _, seq, payload = await self._socket.recv_multipart()
            try:
                self.apply(int.from_bytes(seq, "big"), decoder.decode(payload).events)
            except Exception:  # a batch it cannot read: forget rather than mirror wrongly
                logger.exception("unreadable KV event batch; clearing the prefix-cache mirror")
                self.cache.clear()
            if self.on_change is not None:
                self.on_change()

    def apply(self, seq: int, events: list[Any]) -> None:
        """One published batch (``seq``: the publisher's sequence number) applied to the mirror, in order."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        cache = self.cache
        if seq != self._next_seq:
            logger.warning("KV events %d..%d lost; clearing the prefix-cache mirror", self._next_seq, seq - 1)
            cache.clear()
        self._next_seq = seq + 1
        for event in events:
            if isinstance(event, BlockStored):
                cache.store([event_id(h) for h in event.block_hashes])
            elif isinstance(event, BlockRemoved):
                cache.remove([event_id(h) for h in event.block_hashes])
            elif isinstance(event, AllBlocksCleared):
                cache.clear()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._socket is not None:
            with contextlib.suppress(Exception):
                self._socket.close(linger=0)
            self._socket = None
