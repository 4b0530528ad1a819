"""KV moved by another vLLM P/D connector (vLLM's ``NixlConnector``, say) behind the ``KVTransport`` interface.

With such a connector in a pool's ``engine_kwargs``, the prefill engine's
``kv_transfer_params`` are the hand-off itself: they travel to the decode
node, whose connector pulls the KV over its own transport. Nothing is staged
or held here; the connector frees the prefill node's blocks when the pull
completes (or its own timeout passes).
"""

from __future__ import annotations

from typing import Any

from kairos_ray.kv.transport import KVLost, KVPayload


class ConnectorTransport:
    """The connector's ``kv_transfer_params`` pass through, under the connector's name."""

    def __init__(self, connector: str) -> None:
        self.name = connector

    async def hand_off(self, request_id: int, payload: KVPayload, receiver: str) -> tuple[Any, str]:
        return payload, self.name

    async def receive(self, reference: Any) -> KVPayload:
        if not isinstance(reference, dict):
            raise KVLost(f"expected {self.name}'s kv_transfer_params, got {type(reference).__name__}")
        return reference

    def release(self, request_id: int) -> None:
        """Nothing is held here: the connector frees the blocks itself."""

    @property
    def held(self) -> int:
        return 0

    def close(self) -> None:
        """Nothing to give back."""
