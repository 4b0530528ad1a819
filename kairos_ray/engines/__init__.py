"""Engines behind the prefill and decode pools: one ``Engine`` protocol, backends picked by name (``engine:``).

- ``emulated`` (``engines.emulated``): the simulator's node models
  (``kairos_ray.nodes``) in wall-clock time, each step sleeping for the
  emulated hardware's step time (``kairos_ray.emulation``); deterministic
  tokens; KV payloads (scaled down) really travel through the KV transport.
- ``vllm`` (``engines.vllm_engine``): a real vLLM ``AsyncLLM`` per node, with
  KV hand-off through ``kairos_ray.kv`` and per-request chunk schedules
  (``engines.vllm_scheduler``).

``build_engine(kind, spec)`` builds the backend the registry ``ENGINES``
names, from a ``NodeSpec`` (what every backend is told about its node).
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from kairos_ray.core import Policy
from kairos_ray.messages import EngineRequest, KVHandoff, NodeState, Role, TokenEvent

if TYPE_CHECKING:
    from vllm import SamplingParams

ENGINES: dict[str, str] = {
    "emulated": "kairos_ray.engines.emulated:EmulatedEngine",
    "vllm": "kairos_ray.engines.vllm_engine:VllmEngine",
}
"""Registry: backend name (a pool's ``engine:``) -> ``module:class`` implementing ``Engine``, imported on use."""


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """The serving knobs engines use (from the app's ``serving`` section)."""

    report_interval_s: float = 0.02  # push a change of the node's shape to the router at most this often
    report_refresh_s: float = 0.25  # push otherwise (the KV's steady growth) this often while stepping
    kv_timeout_s: float = 30.0  # decode: past this wait for a hand-off's KV, recompute the prompt
    kv_channel: Literal["gloo", "nccl"] | None = None  # vLLM: gloo/NCCL pairs for hand-offs to a named decode node
    kv_hold_blocks: bool = False  # vLLM prefill: keep a hand-off's KV blocks until the decode node has them
    time_scale: float = 1.0  # emulated: wall seconds per emulated second
    kv_scale: int = 1000  # emulated: KV payload bytes divided by this
    seed: int = 0  # emulated: step-noise seed (per node: plus a hash of its id)
    stall_timeout_s: float = 10.0  # unhealthy: no step and no answer to a ping for this long


@dataclass(frozen=True)
class NodeSpec:
    """What an engine server tells its engine, whatever the backend."""

    node_id: str  # "<role>-<replica unique id>"
    role: Role
    policy: Policy  # the app's policy: its decode model predicts steps, its chunk guard checks chunks when they run
    profile: str  # the step-latency profile file (the predictor; the emulated hardware too)
    prefill_chunk_tokens: int  # chi_p, the prefill nodes' chunk size
    options: EngineOptions = EngineOptions()
    model_source: str = ""  # vLLM: where the weights are
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)  # vLLM: engine arguments, as-is
    engine_metrics: bool = False  # vLLM: export vLLM's own metrics as Ray metrics (ray_vllm_*)
    local_rank: int = 0  # this replica's rank among the pool's replicas on its host
    ray_node_id: str = ""  # the Ray node (host) of the replica
    app_name: str = "kairos"  # the Serve application (its engines share a staging directory per host)
    app_secret: bytes = b""  # shared by the application's engines: KV channel peers prove it
    on_state: Callable[[NodeState], None] | None = None  # where state reports go (the router)


def check_schedule(request: EngineRequest) -> None:
    """A deflected request's chunk schedule covers its prompt, or the suffix the router found uncached here
    (the engine computes what its own cache lacks: ``nodes.covering``)."""
    schedule = request.chunk_schedule
    if not schedule or min(schedule) < 1 or sum(schedule) > request.prompt_tokens:
        raise ValueError(
            f"a deflected request needs a chunk schedule of at most its {request.prompt_tokens} "
            f"prompt tokens, got {schedule}"
        )


def without_prompt_logprobs(sampling: SamplingParams | None) -> SamplingParams | None:
    """``sampling`` for a run whose prompt's logprobs are computed once elsewhere (a hand-off's prefill node, a
    request's first sample, a migration's first run): none asked for, and the prefix cache read as for any
    request (vLLM skips it for a request with prompt logprobs, whose every position it must compute)."""
    if sampling is None or sampling.prompt_logprobs is None:
        return sampling
    plain = copy.copy(sampling)
    plain.prompt_logprobs = None
    plain.skip_reading_prefix_cache = False
    return plain


class EngineUnhealthy(RuntimeError):
    """The engine died or stopped making progress: its replica must be replaced, its requests run elsewhere."""


class Engine(Protocol):
    """One prefill or decode node."""

    node_id: str
    role: Role

    async def start(self) -> None:
        """Bring the engine up (seconds to minutes for vLLM) and start its reports; call from the event loop."""
        ...

    async def prefill(self, request: EngineRequest) -> KVHandoff:
        """Prefill the whole prompt and hand its KV over (prefill nodes)."""
        ...

    def generate(self, request: EngineRequest, handoff: KVHandoff | None) -> AsyncIterator[list[TokenEvent]]:
        """Stream the request's tokens (decode nodes): from ``handoff``'s KV, or deflected per its chunk schedule.

        Each item holds every token that is ready when the consumer asks: one
        item per token while it keeps up, several once it falls behind (never
        waiting to batch), so that a slow serving path does not fall further
        behind with one message per token.
        """
        ...

    def release(self, request_id: int) -> None:
        """The decode node has the KV of ``request_id`` (or recomputes it): stop holding it (prefill nodes)."""
        ...

    def state(self) -> NodeState:
        """What the router needs of this node now (``healthy`` false once ``check_health`` would raise)."""
        ...

    def check_health(self) -> None:
        """Raise ``EngineUnhealthy`` if the engine died or has made no progress for ``stall_timeout_s``."""
        ...

    def engine_pids(self) -> list[int]:
        """The processes that step this engine (a vLLM engine core; the replica itself for an emulated engine)."""
        ...

    def residue(self) -> dict[str, int]:
        """Entries of each per-request structure the engine keeps (``messages.Residue``): all 0 once idle."""
        ...

    async def shutdown(self) -> None:
        """Stop stepping and give back what the engine holds; idempotent."""
        ...


def build_engine(kind: str, spec: NodeSpec) -> Engine:
    """The ``kind`` backend's engine for ``spec`` (not started)."""
    if kind not in ENGINES:
        raise ValueError(f"unknown engine {kind!r}; known: {', '.join(ENGINES)}")
    module, _, name = ENGINES[kind].partition(":")
    engine: Engine = getattr(importlib.import_module(module), name).from_spec(spec)
    return engine
