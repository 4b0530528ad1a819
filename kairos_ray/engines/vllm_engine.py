"""Real vLLM engines behind the ``Engine`` protocol: one ``AsyncLLM`` per node.

Prefill node: the prompt runs with ``max_tokens=1`` and ``kv_transfer_params
= {"do_remote_decode": true}``; ``engines.kv_connector`` stages the prompt's
KV blocks when its last chunk is computed (vLLM frees them at once, or,
with ``hold_blocks``, once the decode node has the KV); this
engine reads the staged bytes and hands them over by one of two transports:

- the Ray object store (the general path): the bytes are put there and the
  ``KVHandoff`` holds the reference, pinned here until the decode node has it
  (``release``);
- a KV channel (``kv_channel="gloo"`` or ``"nccl"``, the fast path, when the
  router named the decode node): the hand-off holds a ``ChannelTicket`` and
  the bytes go straight to that node over the pair's process group
  (``engines.kv_channel``); the send returns once the decode node has them.

Decode node: a disaggregated request's KV is fetched from the object store or
received from the channel (at most ``kv_timeout_s``), staged for the connector, and the request is
submitted with those ``kv_transfer_params``; vLLM then computes only the
prompt's last token. If the KV is lost (its owner or sender died), late or unreadable,
the request is recomputed here from its prompt instead of failing, and the
engine counts it. A deflected request carries its chunk schedule in
``extra_args["chunk_schedule"]`` for ``engines.vllm_scheduler``.

With another P/D connector in the pool's ``engine_kwargs`` (vLLM's
``NixlConnector``, say), the prefill node's ``kv_transfer_params`` are the
hand-off itself and the decode node's connector pulls the KV over that
connector's own transport; nothing goes through the object store.

Live state: a stat logger runs after every step in this process; it records
the step's measured time with its prefill tokens and batch size, and pushes
the node's state to the router (at most every ``report_interval_s``, plus a
heartbeat).
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import ray

from kairos_ray.core import StepLatency
from kairos_ray.engines import EngineRequest, KVHandoff, TokenEvent
from kairos_ray.engines.kv_channel import ChannelError, ChannelTicket, KVChannel
from kairos_ray.engines.node_state import KVPins, StateReporter
from kairos_ray.engines.vllm_args import (
    GUARD_KEY,
    HOLD_KEY,
    KV_PATH,
    KV_TOKENS,
    REMOTE_DECODE,
    SCHEDULE_KEY,
    default_staging_dir,
    mark_taken,
    rank_path,
)

logger = logging.getLogger("ray.serve")

HEARTBEAT_S = 1.0
CONNECTOR = "kairos_ray.engines.kv_connector"
SCHEDULER = "kairos_ray.engines.vllm_scheduler.ChunkScheduleScheduler"


def engine_args(
    role: str, model: str, engine_kwargs: dict[str, Any], staging_dir: str, hold_blocks: bool = False
) -> dict[str, Any]:
    """vLLM engine arguments for a node of ``role``: the pool's ``engine_kwargs`` plus what Kairos needs.

    Prefill nodes get the Kairos KV connector as producer (keeping a request's
    blocks until the decode node has its KV if ``hold_blocks``), decode nodes
    as consumer plus the chunk-schedule scheduler. A ``kv_transfer_config`` in
    ``engine_kwargs`` (e.g. vLLM's ``NixlConnector``) replaces the Kairos one.
    """
    kv_config: dict[str, Any] = {
        "kv_connector": "KairosKVConnector",
        "kv_connector_module_path": CONNECTOR,
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"staging_dir": staging_dir, HOLD_KEY: hold_blocks and role == "prefill"},
    }
    args: dict[str, Any] = {
        "model": model,
        "kv_transfer_config": kv_config,
        "enable_log_requests": False,
        "enable_logging_iteration_details": True,  # each step's time and token counts, for the router
        **engine_kwargs,
    }
    if role == "decode":
        args.setdefault("scheduler_cls", SCHEDULER)
    return args


def bind_cpu_core(role: str, local_rank: int) -> None:
    """On a CPU platform, pin this engine's threads to one core, spreading a host's engines over its cores.

    vLLM's automatic binding puts every engine of a host on the same core;
    prefill engine ``r`` gets core ``r`` and decode engine ``r`` core ``r + 1``
    (modulo the cores), so each core serves both pools. A
    ``VLLM_CPU_OMP_THREADS_BIND`` already set (in the pool's ``runtime_env``) wins.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[(local_rank + (role == "decode")) % len(cores)])


@dataclass
class _Step:
    elapsed_s: float
    batch_size: int  # requests decoding in the step
    prefill_tokens: int


class VllmEngine:
    """A prefill or decode node (``role``) running ``vllm.v1.engine.async_llm.AsyncLLM``."""

    def __init__(
        self,
        node_id: str,
        role: str,
        model: str,
        engine_kwargs: dict[str, Any],
        predictor: StepLatency | None = None,
        guard: dict[str, Any] | None = None,
        kv_timeout_s: float = 30.0,
        report_interval_s: float = 0.02,
        on_state: Callable[[dict[str, Any]], None] | None = None,
        staging_dir: str | None = None,
        kv_channel: str | None = None,
        hold_blocks: bool = False,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        self.node_id, self.role, self.predictor, self.guard = node_id, role, predictor, guard
        self.kv_timeout_s = kv_timeout_s
        host = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self.channel = KVChannel(node_id, host, kv_channel, kv_timeout_s) if kv_channel else None
        self.reporter = StateReporter(self.state, on_state, report_interval_s)
        self.staging_dir = staging_dir or default_staging_dir()
        os.makedirs(self.staging_dir, exist_ok=True)
        self.args = engine_args(role, model, engine_kwargs, self.staging_dir, hold_blocks)
        extra = self.args["kv_transfer_config"].get("kv_connector_extra_config") or {}
        self._holds = bool(extra.get(HOLD_KEY))  # the connector holds blocks until told the KV was taken
        self.connector = str(self.args["kv_transfer_config"].get("kv_connector", ""))
        self.llm: Any = None
        self.kv_capacity_tokens = 0
        self.kv_recomputes = 0  # disaggregated requests whose KV never arrived: recomputed here
        self._queue: OrderedDict[int, int] = OrderedDict()  # prefill: rid -> prompt tokens, not yet prefilled
        self._prefilled_since_head = 0  # prefill: prompt tokens computed since the queue's head arrived
        self._active: dict[int, int] = {}  # decode: rid -> resident tokens
        self._committed: dict[int, tuple[int, ...]] = {}  # decode: rid -> schedule, until its first token
        self._pins = KVPins()  # prefill: KV payloads handed off, until the decode node has them
        self._sending: set[asyncio.Task[None]] = set()  # prefill: channel sends not taken yet
        self._staged: dict[int, tuple[str, list[int]]] = {}  # prefill, holding: rid -> (staged prefix, ranks)
        self._waiting = 0  # requests vLLM has not scheduled yet
        self._kv_usage = 0.0
        self._last: _Step | None = None
        self._heartbeat: asyncio.Task[None] | None = None

    # ---- life cycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Build the engine (tens of seconds) and start the heartbeat; call from the event loop."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if self.connector == "NixlConnector" and "VLLM_NIXL_SIDE_CHANNEL_PORT" not in os.environ:
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(_free_port())  # one per engine on a host
        args = AsyncEngineArgs(**self.args)
        self.llm = AsyncLLM.from_engine_args(args, stat_loggers=[self._stat_logger])
        cache = self.llm.vllm_config.cache_config
        self.kv_capacity_tokens = int(cache.num_gpu_blocks or 0) * int(cache.block_size)
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat())

    def shutdown(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            self.reporter.report(force=True)

    def _stat_logger(self, vllm_config: Any, engine_index: int = 0) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self

        class _Reporter(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
                engine._record(scheduler_stats)

            def log_engine_initialized(self) -> None:
                pass

        return _Reporter(vllm_config, engine_index)

    def _record(self, stats: Any) -> None:
        if stats is None:
            return
        self._waiting, self._kv_usage = stats.num_waiting_reqs, stats.kv_cache_usage
        details = stats.iteration_details
        if details is not None and not details.is_dummy and details.elapsed_ms > 0:
            self._last = _Step(details.elapsed_ms / 1e3, details.num_generation_requests, details.num_ctx_tokens)
            self._prefilled_since_head += details.num_ctx_tokens
        self.reporter.report()

    # ---- the protocol -----------------------------------------------------------------------

    def _sampling(self, request: EngineRequest, max_tokens: int, extra: dict[str, Any]) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            max_tokens=max_tokens,
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra or None,
            **request.sampling,
        )

    def _prompt(self, request: EngineRequest) -> dict[str, Any]:
        if len(request.prompt_token_ids) != request.prompt_tokens:
            raise ValueError(
                f"request {request.request_id}: a vLLM engine needs the prompt's token ids "
                f"({request.prompt_tokens} tokens counted, {len(request.prompt_token_ids)} ids given)"
            )
        return {"prompt_token_ids": list(request.prompt_token_ids)}

    async def prefill(self, request: EngineRequest) -> KVHandoff:
        if self.role != "prefill":
            raise RuntimeError(f"{self.node_id} is a {self.role} node")
        # the request every P/D connector understands: prefill here, decode elsewhere
        remote: dict[str, Any] = {REMOTE_DECODE: True, "do_remote_prefill": False}
        remote |= dict.fromkeys(("remote_engine_id", "remote_block_ids", "remote_host", "remote_port"))
        params = self._sampling(request, 1, {"kv_transfer_params": remote})
        if not self._queue:
            self._prefilled_since_head = 0
        self._queue[request.request_id] = request.prompt_tokens
        self.reporter.accepted.append(request.request_id)
        final = None
        try:
            async for output in self.llm.generate(self._prompt(request), params, request_id=f"p{request.request_id}"):
                final = output
        finally:
            self._pop_queue(request.request_id)
        end_wall = time.time()
        if final is None or not final.kv_transfer_params:
            raise RuntimeError(f"prefill of request {request.request_id} returned no kv_transfer_params")
        queue_s, exec_s = _prefill_times(final.metrics)
        kv: Any = final.kv_transfer_params  # another connector's hand-off: its parameters
        kv_bytes, transport = 0, self.connector
        if KV_PATH in final.kv_transfer_params:  # the Kairos connector staged the KV
            prefix = str(final.kv_transfer_params[KV_PATH])
            payload = self._collect(prefix)
            kv_bytes = sum(len(b) for b in payload.values())
            if self._holds:
                self._staged[request.request_id] = (prefix, list(payload))
            if self.channel is not None and request.kv_receiver:  # straight to the chosen decode node
                kv, transport = self.channel.ticket(request.kv_receiver, request.request_id), self.channel.backend
                task = asyncio.get_running_loop().create_task(self._send(request.request_id, kv, payload))
                self._sending.add(task)
                task.add_done_callback(self._sending.discard)
            else:  # into the object store
                kv, transport = ray.put(payload), "object_store"
                self._pins.pin(request.request_id, kv)
        return KVHandoff(
            kv=kv,
            kv_bytes=kv_bytes,
            node_id=self.node_id,
            prefill_queue_s=queue_s,
            prefill_exec_s=exec_s,
            prefill_end_wall_s=end_wall,
            transport=transport,
        )

    def _pop_queue(self, rid: int) -> None:
        head = next(iter(self._queue), None)
        tokens = self._queue.pop(rid, 0)
        if rid == head:
            self._prefilled_since_head = max(0, self._prefilled_since_head - tokens)

    @staticmethod
    def _collect(prefix: str) -> dict[int, bytes]:
        """Read and delete the staged files of every tensor-parallel rank: {rank: bytes}."""
        payload: dict[int, bytes] = {}
        for rank, path in _staged_files(prefix):
            with open(path, "rb") as f:
                payload[rank] = f.read()
            os.unlink(path)
        if not payload:
            raise RuntimeError(f"no staged KV at {prefix}")
        return payload

    async def _send(self, rid: int, ticket: ChannelTicket, payload: dict[int, bytes]) -> None:
        assert self.channel is not None
        try:
            await self.channel.send(ticket, payload)
        except ChannelError as error:  # the decode node recomputes when it does not receive
            logger.warning("%s: %s", self.node_id, error)
        finally:
            self._taken(rid)

    def release(self, request_id: int) -> None:
        self._pins.release(request_id)
        self._taken(request_id)

    def _taken(self, rid: int) -> None:
        """The decode node has the request's KV (or will recompute it): a holding connector frees its blocks."""
        staged = self._staged.pop(rid, None)
        if staged is not None:
            with contextlib.suppress(OSError):
                mark_taken(*staged)

    async def _receive(self, kv: Any) -> dict[int, bytes]:
        """A hand-off's KV bytes {rank: bytes}, from the channel or the object store."""
        if not isinstance(kv, ChannelTicket):
            return dict(await kv)
        if self.channel is None:
            raise ChannelError(f"KV sent over a channel to {self.node_id}, which has none (set serving.kv_channel)")
        return await self.channel.receive(kv)

    async def _fetch(self, request: EngineRequest, handoff: KVHandoff) -> dict[str, Any] | None:
        """Stage the hand-off's KV for the connector: its ``kv_transfer_params``, or None to recompute."""
        if isinstance(handoff.kv, dict):  # another connector's parameters: it pulls the KV itself
            return handoff.kv
        try:
            payload = await asyncio.wait_for(self._receive(handoff.kv), timeout=self.kv_timeout_s)
            prefix = os.path.join(self.staging_dir, f"{self.node_id}-{request.request_id}")
            for rank, data in payload.items():
                with open(rank_path(prefix, int(rank)), "wb") as f:
                    f.write(data)
        except (TimeoutError, ChannelError, ray.exceptions.RayError, OSError, AttributeError, ValueError) as error:
            self.kv_recomputes += 1
            logger.warning(
                "%s: KV of request %s from %s not received (%s); recomputing its prompt here",
                self.node_id,
                request.request_id,
                handoff.node_id,
                type(error).__name__,
            )
            return None
        return {KV_PATH: prefix, KV_TOKENS: request.prompt_tokens}

    async def generate(self, request: EngineRequest, handoff: KVHandoff | None) -> AsyncIterator[TokenEvent]:
        if self.role != "decode":
            raise RuntimeError(f"{self.node_id} is a {self.role} node")
        prompt = self._prompt(request)
        submitted = time.time()
        timings: dict[str, float] = {}
        extra: dict[str, Any] = {}
        if handoff is None:
            if not request.chunk_schedule or sum(request.chunk_schedule) != request.prompt_tokens:
                raise ValueError(
                    f"a deflected request needs a chunk schedule summing to its {request.prompt_tokens} "
                    f"prompt tokens, got {request.chunk_schedule}"
                )
            extra[SCHEDULE_KEY] = list(request.chunk_schedule)
            if self.guard:
                extra[GUARD_KEY] = self.guard
            self._committed[request.request_id] = request.chunk_schedule
        else:
            timings = {"prefill_queue_s": handoff.prefill_queue_s, "prefill_exec_s": handoff.prefill_exec_s}
            kv_params = await self._fetch(request, handoff)
            submitted = time.time()
            timings["kv_transfer_s"] = max(0.0, submitted - handoff.prefill_end_wall_s)
            if kv_params is not None:
                extra["kv_transfer_params"] = kv_params
        self.reporter.accepted.append(request.request_id)
        self._active[request.request_id] = request.prompt_tokens
        index = 0
        try:
            params = self._sampling(request, request.max_tokens, extra)
            async for output in self.llm.generate(prompt, params, request_id=f"d{request.request_id}"):
                completion = output.outputs[0]
                ids = list(completion.token_ids)
                for i, token in enumerate(ids):
                    last = i == len(ids) - 1
                    finished = output.finished and last
                    first: dict[str, float] = {}
                    if index == 0:
                        self._committed.pop(request.request_id, None)
                        wait = time.time() - submitted
                        first = {**timings, "prefill_exec_s" if handoff is None else "decode_queue_s": wait}
                    yield TokenEvent(
                        token,
                        index,
                        finished,
                        first,
                        self.node_id,
                        text=completion.text if last else "",
                        finish_reason=(completion.finish_reason or "length") if finished else None,
                    )
                    index += 1
                    self._active[request.request_id] += 1
        finally:
            self._active.pop(request.request_id, None)
            self._committed.pop(request.request_id, None)
            staged = extra.get("kv_transfer_params", {}).get(KV_PATH)
            for _, path in _staged_files(staged) if staged else ():  # left when the request ended before loading
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def state(self) -> dict[str, Any]:
        step = self._last
        kv_tokens = sum(self._active.values())
        features = (step.batch_size, kv_tokens, step.prefill_tokens) if step else None
        state: dict[str, Any] = {
            "node_id": self.node_id,
            "role": self.role,
            "wall_s": time.time(),
            "measured_step_s": step.elapsed_s if step else 0.0,
            "predicted_step_s": self.predictor.step_s(*features) if features and self.predictor else 0.0,
            "step_features": features,
            "kv_usage": self._kv_usage,
            "kv_recomputes": self.kv_recomputes,
        }
        if self.role == "prefill":
            state.update(
                queued=list(self._queue.values()),
                head_prefilled=min(self._prefilled_since_head, next(iter(self._queue.values()), 0)),
                pinned_kv=len(self._pins) + len(self._sending),
            )
        else:
            state.update(
                batch_size=len(self._active) - len(self._committed),
                kv_tokens=kv_tokens,
                free_kv_tokens=max(0, self.kv_capacity_tokens - kv_tokens),
                committed=[list(s) for s in self._committed.values()],
                waiting=self._waiting,
            )
        return state


def _staged_files(prefix: str) -> list[tuple[int, str]]:
    """(rank, path) of every staged file of ``prefix``."""
    paths = glob.glob(glob.escape(prefix) + ".rank*.pt")
    return [(int(path[len(prefix) + len(".rank") : -len(".pt")]), path) for path in paths]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prefill_times(metrics: Any) -> tuple[float, float]:
    """(queue, execution) seconds of a prefill from vLLM's request stats (engine-core clock)."""
    queued = getattr(metrics, "queued_ts", 0.0) or 0.0
    scheduled = getattr(metrics, "scheduled_ts", 0.0) or 0.0
    first = getattr(metrics, "first_token_ts", 0.0) or 0.0
    if not (queued and scheduled and first):
        return 0.0, 0.0
    return max(0.0, scheduled - queued), max(0.0, first - scheduled)
