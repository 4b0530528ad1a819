"""Engines behind the prefill and decode pools, all speaking one ``Engine`` protocol.

- ``emulated``: the simulator's node model (``kairos_ray.nodes``) in wall-clock
  time, each step sleeping for the profile's step time; deterministic tokens;
  KV payloads (scaled down) really travel through the Ray object store.
- ``vllm``: real vLLM engines (``vllm_engine.VllmEngine``, one ``AsyncLLM``
  per node), with KV hand-off through the Ray object store or point-to-point
  gloo/NCCL pairs (``kv_connector``, ``kv_channel``) and per-request chunk
  schedules (``vllm_scheduler``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class EngineRequest:
    request_id: int
    prompt_tokens: int
    max_tokens: int
    arrival_wall_s: float  # time.time() when the ingress accepted it
    chunk_schedule: tuple[int, ...] = ()  # set for a deflected request: prefill in these chunks, in place
    prompt_token_ids: tuple[int, ...] = ()  # the prompt, tokenized by the ingress (vLLM engines need it)
    sampling: dict[str, Any] = field(default_factory=dict)  # vLLM SamplingParams fields (temperature, ...)
    kv_receiver: str = ""  # disaggregated: the decode node chosen to continue it (a KV channel sends there)


@dataclass(frozen=True)
class KVHandoff:
    """What a prefill node hands to a decode node for a disaggregated request."""

    kv: Any  # ray.ObjectRef of the KV payload (object store), a kv_channel.ChannelTicket, or a connector's params
    kv_bytes: int
    node_id: str  # the prefill node that built it
    prefill_queue_s: float
    prefill_exec_s: float
    prefill_end_wall_s: float  # time.time() when the prompt's last chunk finished
    transport: str = "object_store"  # how the KV travels: object_store, gloo or nccl (a channel), a connector's name


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    index: int  # 0 for the first token
    finished: bool
    timings: dict[str, float] = field(default_factory=dict)  # TTFT breakdown, on the first token only
    node_id: str = ""  # the decode node that streams it
    text: str = ""  # the text this token adds
    finish_reason: str | None = None  # on the last token: "length" or "stop"


class Engine(Protocol):
    """One prefill or decode node."""

    node_id: str

    async def prefill(self, request: EngineRequest) -> KVHandoff:
        """Prefill the whole prompt and hand its KV over (prefill nodes)."""
        ...

    def generate(self, request: EngineRequest, handoff: KVHandoff | None) -> AsyncIterator[TokenEvent]:
        """Stream the request's tokens (decode nodes): from ``handoff``'s KV, or deflected per its chunk schedule."""
        ...

    def state(self) -> dict[str, Any]:
        """What the router needs of this node now (see ``kairos_ray.serve.router``).

        Reports to the router add ``accepted``: the requests taken since the last report.
        """
        ...
