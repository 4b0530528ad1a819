"""The general KV transport: the Ray object store (shared memory on one host, chunked transfer between hosts).

The hand-off carries only an ``ObjectRef``; the prefill node pins the
object (holds a reference) until the decode node has it, or ``pin_s`` at
most, so it is not freed before the decode node fetches it. If its owner
dies the object is lost, and the decode node's ``receive`` says so at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import ray

from kairos_ray.kv.transport import KVLost, KVPayload

KV_PIN_S = 120.0  # longest a prefill node holds a KV payload that no decode node has confirmed


class KVPins:
    """References a sender holds until the decode node has them, or ``pin_s`` at most.

    A pin whose release never comes (its request ended where the release
    could not reach this node) expires on any use, ``len`` included: the
    node's periodic report reads ``held``, so an idle node drops it too.
    ``clock`` times the pins (tests move it).
    """

    def __init__(self, pin_s: float = KV_PIN_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.pin_s = pin_s
        self._clock = clock
        self._pinned: dict[int, tuple[Any, float]] = {}  # request id -> (reference, since), oldest first

    def _expire(self) -> float:
        now = self._clock()
        while self._pinned:
            oldest, (_, since) = next(iter(self._pinned.items()))
            if now - since <= self.pin_s:
                break
            del self._pinned[oldest]
        return now

    def pin(self, request_id: int, reference: Any) -> None:
        now = self._expire()
        self._pinned.pop(request_id, None)  # a re-pin moves to the end, keeping the oldest first
        self._pinned[request_id] = (reference, now)

    def release(self, request_id: int) -> None:
        self._pinned.pop(request_id, None)
        self._expire()

    def __len__(self) -> int:
        self._expire()
        return len(self._pinned)


class ObjectStoreTransport:
    """KV through the Ray object store; a receive waits at most ``timeout_s``.

    ``on_taken(request_id)`` runs when the sender learns the decode node has
    the KV (``release``), e.g. to free KV blocks a vLLM engine still holds.
    """

    def __init__(self, timeout_s: float, on_taken: Callable[[int], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.on_taken = on_taken
        self._pins = KVPins()

    async def hand_off(self, request_id: int, payload: KVPayload, receiver: str) -> tuple[Any, str]:
        # A copy of the whole KV into the object store: on a thread, not on the replica's event loop (which
        # runs Serve's own work too, kairos_ray.serve.CLUSTER_ENV), so other requests' tokens keep flowing.
        reference = await asyncio.to_thread(ray.put, payload)
        self._pins.pin(request_id, reference)
        return reference, "object_store"

    async def receive(self, reference: Any) -> KVPayload:
        if not isinstance(reference, ray.ObjectRef):
            raise KVLost(f"not an object-store reference: {type(reference).__name__}")
        try:
            payload: KVPayload = await asyncio.wait_for(reference, timeout=self.timeout_s)
        except TimeoutError:
            raise KVLost(f"KV not fetched within {self.timeout_s} s") from None
        except ray.exceptions.RayError as error:  # its owner died, or it was freed
            raise KVLost(f"KV lost from the object store: {type(error).__name__}") from error
        return payload

    def release(self, request_id: int) -> None:
        self._pins.release(request_id)
        if self.on_taken is not None:
            self.on_taken(request_id)

    @property
    def held(self) -> int:
        return len(self._pins)

    def close(self) -> None:
        self._pins = KVPins()
