"""How a disaggregated request's KV travels from the prefill node that built it to the decode node that continues it.

One interface, ``KVTransport``, three implementations:

| transport | sender (prefill node) | receiver (decode node) |
|---|---|---|
| ``kv.object_store.ObjectStoreTransport`` | ``ray.put`` the bytes, pin the reference | fetch it |
| ``kv.channel.ChannelTransport`` | send the bytes over the pair's gloo/NCCL group | take them off the pair |
| ``kv.nixl.ConnectorTransport`` | another vLLM connector's params (NIXL) | its connector pulls the KV |

A hand-off's life: the prefill engine stages the KV (``kv.staging``, vLLM;
a payload of the right size, emulated) and calls ``hand_off``, which
returns the reference that travels in the ``KVHandoff``; the decode engine
calls ``receive``, which returns the payload or raises ``KVLost`` (sender
dead, too late, unreadable), and then recomputes the prompt itself; the
sender's ``release`` drops what it held once the decode node has the KV.
``held`` counts hand-offs not yet released (the node's ``pinned_kv``).
"""

from __future__ import annotations

from typing import Any, Protocol

KVBytes = dict[int, bytes]
"""A hand-off's KV bytes, per tensor-parallel rank."""

KVPayload = KVBytes | dict[str, Any]
"""What a transport carries: KV bytes, or another vLLM connector's ``kv_transfer_params`` (it moves the bytes)."""


class KVLost(RuntimeError):
    """A hand-off's KV cannot be had (its sender died, it came too late, or it is unreadable): recompute it."""


class KVTransport(Protocol):
    """One node's end of the KV hand-off (the sender on prefill nodes, the receiver on decode nodes)."""

    async def hand_off(self, request_id: int, payload: KVPayload, receiver: str) -> tuple[Any, str]:
        """Sender: make ``payload`` reachable for ``receiver`` ("": any decode node).

        Returns the reference to pass on and the name of the way the KV takes
        (``object_store``, ``gloo``, ``nccl`` or a connector's name: ``KVHandoff.transport``).
        """
        ...

    async def receive(self, reference: Any) -> KVPayload:
        """Receiver: the payload a reference stands for; raises ``KVLost`` when it cannot come in time."""
        ...

    def release(self, request_id: int) -> None:
        """Sender: the decode node has the request's KV (or recomputes it): stop holding it."""
        ...

    @property
    def held(self) -> int:
        """Sender: hand-offs not yet released."""
        ...

    def close(self) -> None:
        """Give back what the transport holds (threads, stores); idempotent."""
        ...
