"""KV hand-off for requests that are not deflected, behind one interface (``kv.transport.KVTransport``).

- ``transport``: the interface, ``KVLost`` (the receiver then recomputes), the payload types;
- ``object_store``: the general path, the Ray object store, with the sender's pins;
- ``channel``: the fast path, point-to-point gloo (CPU) or NCCL (GPU) pairs per (prefill, decode) node pair;
- ``rendezvous``: where those pairs meet, a torch store over Ray's cluster store (guarded by Ray's token auth);
- ``nixl``: another vLLM connector (NIXL) moves the KV, its params pass through;
- ``staging``: the files through which the Kairos vLLM connector and the engine exchange KV blocks;
- ``connector``: that connector, loaded by vLLM in the EngineCore process.

``build_transport`` picks one per node from the serving options.
"""

from __future__ import annotations

from collections.abc import Callable

from kairos_ray.kv.transport import KVBytes, KVLost, KVPayload, KVTransport

KAIROS_CONNECTOR = "KairosKVConnector"

__all__ = ["KAIROS_CONNECTOR", "KVBytes", "KVLost", "KVPayload", "KVTransport", "build_transport"]


def build_transport(
    node_id: str,
    host: str,
    timeout_s: float,
    channel: str | None = None,
    connector: str = KAIROS_CONNECTOR,
    on_taken: Callable[[int], None] | None = None,
    secret: bytes = b"",
) -> KVTransport:
    """A node's transport: another vLLM ``connector``'s own, a gloo/NCCL ``channel``, or the object store.

    ``on_taken(request_id)``: the decode node has that hand-off's KV (see ``ObjectStoreTransport``);
    ``secret``: the application's, which channel peers prove to each other.
    """
    if connector != KAIROS_CONNECTOR:
        from kairos_ray.kv.nixl import ConnectorTransport

        return ConnectorTransport(connector)
    from kairos_ray.kv.object_store import ObjectStoreTransport

    object_store = ObjectStoreTransport(timeout_s, on_taken)
    if channel is None:
        return object_store
    from kairos_ray.kv.channel import ChannelTransport, KVChannel

    return ChannelTransport(KVChannel(node_id, host, channel, timeout_s, secret), object_store)
