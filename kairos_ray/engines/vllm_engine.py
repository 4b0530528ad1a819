"""Real vLLM engines behind the ``Engine`` protocol: one ``AsyncLLM`` per node.

Requests carry the ``SamplingParams`` the ingress built as vLLM's OpenAI
server does (``serve.tokens``); the decode node generates with them as they
are (its ``max_tokens`` the request's), streaming each token's logprobs when
asked.

Prefill node: the prompt runs with ``max_tokens=1``, greedy (the token is
dropped: the decode node samples the first token itself, with the request's
parameters), and ``kv_transfer_params = {"do_remote_decode": true}``; the
Kairos connector (``kv.connector``) stages the prompt's KV blocks when its
last chunk is computed (vLLM frees them at once, or, with ``hold_blocks``,
once the decode node has the KV); this engine reads the staged bytes
(``kv.staging``) and hands them to its KV transport (``kv.transport``: the
Ray object store, or a gloo/NCCL pair to the decode node the router named).
The blocks the router says that decode node's prefix cache holds
(``EngineRequest.kv_receiver_cached_tokens``) are not staged: only the rest
travels (``KVHandoff.skipped_tokens``).

Decode node: a disaggregated request's KV is received from the transport
(at most ``kv_timeout_s``), staged for the connector, and the request is
submitted with those ``kv_transfer_params``; vLLM then computes only the
prompt's last token. If the KV is lost (its sender died), late or unreadable,
the request is recomputed here from its prompt instead of failing, and the
engine counts it. A deflected request carries its chunk schedule in
``extra_args["chunk_schedule"]`` for ``engines.vllm_scheduler``.

With another P/D connector in the pool's ``engine_kwargs`` (vLLM's
``NixlConnector``, say), the prefill node's ``kv_transfer_params`` are the
hand-off itself (``kv.nixl``) and the decode node's connector pulls the KV
over that connector's own transport. As in Ray Serve LLM, each NIXL engine
gets its own side channel and an engine id unique across replicas.

With ``engine_metrics`` (a pool's ``log_engine_metrics``), vLLM's own
metrics are exported as Ray metrics (``ray_vllm_*``) by vLLM's
``RayPrometheusStatLogger``, as Ray Serve LLM exports them.

Live state: a stat logger runs after every step in this process; it records
the step's measured time with its prefill tokens and batch size, and pushes
the node's state to the router (at most every ``report_interval_s``, plus a
heartbeat). With vLLM's prefix cache on, the engine core publishes its KV
cache events to this actor (``engines.vllm_events``), which mirrors the cache
and reports its changes with the state. A deflection's chunk schedule covers
the suffix the router found uncached here; the scheduler runs it after
vLLM's own hit. The prompt tokens vLLM found cached go back with the
hand-off (prefill node) or the first token (deflected).

Prompt logprobs (``prompt_logprobs``, and ``echo`` with logprobs) are
computed where the prompt is: on the prefill node, which returns them with
the hand-off (the decode node, which computes only the last token, runs
without them and puts them on the first token), or on the deflecting decode
node. vLLM reads no prefix cache for such a request; the ingress sends the
router no block hashes for it, so its schedule covers the whole prompt.

Health: the heartbeat also pings the engine core (a utility call it answers
between steps). Progress is the last step or answered ping; with none for
``stall_timeout_s`` (a stopped or wedged engine core), or once vLLM finds its
engine core dead, the engine is unhealthy: every request in flight fails at
once (the ingress runs it elsewhere), its reports say so (the router drops
the node) and ``check_health`` raises (Serve replaces the replica).
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Self, cast

import ray

from kairos_ray.core import DecodeNodeView, JournaledBlockCache, PrefillNodeView, StepLatencyModel
from kairos_ray.engines import EngineUnhealthy, NodeSpec, check_schedule, without_prompt_logprobs
from kairos_ray.engines.reporting import StateReporter
from kairos_ray.engines.vllm_args import GUARD_KEY, JOIN_KEY, SCHEDULE_KEY, guard_spec, join_spec, priced_with
from kairos_ray.engines.vllm_events import KVEventMirror, events_config, events_endpoint, mirrorable
from kairos_ray.engines.vllm_parent_watch import PARENT_ENV
from kairos_ray.engines.vllm_worker import EXTENSION as KAIROS_WORKER
from kairos_ray.kv import KAIROS_CONNECTOR, KVBytes, KVLost, KVTransport, build_transport
from kairos_ray.kv.staging import HOLD_KEY, SKIP_TOKENS, Staging, node_staging, remote_decode_params
from kairos_ray.messages import (
    EngineRequest,
    KVHandoff,
    NodeState,
    PromptLogprobs,
    Role,
    TokenEvent,
    TokenLogprob,
    TTFTBreakdown,
)
from kairos_ray.nodes import FinishRate

logger = logging.getLogger("ray.serve")

HEARTBEAT_S = 1.0
CONNECTOR_MODULE = "kairos_ray.kv.connector"
SCHEDULER = "kairos_ray.engines.vllm_scheduler.ChunkScheduleScheduler"


def engine_args(
    role: Role, model: str, engine_kwargs: Mapping[str, Any], staging_dir: str, hold_blocks: bool = False
) -> dict[str, Any]:
    """vLLM engine arguments for a node of ``role``: the pool's ``engine_kwargs`` plus what Kairos needs.

    Prefill nodes get the Kairos KV connector as producer (keeping a request's
    blocks until the decode node has its KV if ``hold_blocks``), decode nodes
    as consumer plus the chunk-schedule scheduler; both the worker extension
    that lets seeded requests prefill in chunks and workers idle on CPU
    (``engines.vllm_worker``).
    A ``kv_transfer_config`` in ``engine_kwargs`` (e.g. vLLM's
    ``NixlConnector``) replaces the Kairos one.
    """
    kv_config: dict[str, Any] = {
        "kv_connector": KAIROS_CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer" if role is Role.PREFILL else "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"staging_dir": staging_dir, HOLD_KEY: hold_blocks and role is Role.PREFILL},
    }
    args: dict[str, Any] = {
        "model": model,
        "kv_transfer_config": kv_config,
        "enable_log_requests": False,
        "enable_logging_iteration_details": True,  # each step's time and token counts, for the router
        **engine_kwargs,
    }
    args.setdefault("worker_extension_cls", KAIROS_WORKER)
    if role is Role.DECODE:
        args.setdefault("scheduler_cls", SCHEDULER)
    return args


def bind_cpu_core(role: Role, local_rank: int) -> None:
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
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[(local_rank + (role is Role.DECODE)) % len(cores)])


class VllmEngine:
    """A prefill or decode node (``role``) running ``vllm.v1.engine.async_llm.AsyncLLM``."""

    def __init__(
        self,
        node_id: str,
        role: Role,
        model: str,
        engine_kwargs: Mapping[str, Any],
        engine_metrics: bool = False,
        reporter: StateReporter | None = None,
        guard: dict[str, Any] | None = None,
        join_guard: dict[str, Any] | None = None,
        kv_timeout_s: float = 30.0,
        staging_dir: str | None = None,
        kv_channel: str | None = None,
        hold_blocks: bool = False,
        stall_timeout_s: float = 10.0,
        app_name: str = "kairos",
        secret: bytes = b"",
        ray_node_id: str = "",
    ) -> None:
        self.node_id, self.role, self.guard = node_id, Role(role), guard
        self.join_guard = join_guard  # decode, admission on: a hand-off joins the batch only within beta * tau
        self.stall_timeout_s = stall_timeout_s
        self.reporter = reporter or StateReporter("", None, None, 1.0)
        self.reporter.snapshot = self.state
        self.staging = Staging(staging_dir) if staging_dir else node_staging(app_name, node_id, ray_node_id)
        self.args = engine_args(self.role, model, engine_kwargs, self.staging.directory, hold_blocks)
        kv_config = self.args["kv_transfer_config"]
        self.connector = str(kv_config.get("kv_connector", ""))
        self._holds = bool((kv_config.get("kv_connector_extra_config") or {}).get(HOLD_KEY))
        host = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self.kv: KVTransport = build_transport(
            node_id, host, kv_timeout_s, kv_channel, self.connector, on_taken=self._taken, secret=secret
        )
        self.llm: Any = None
        self.engine_metrics = engine_metrics  # export vLLM's own metrics as Ray metrics (ray_vllm_*)
        self.kv_capacity_tokens = 0
        self.kv_recomputes = 0  # disaggregated requests whose KV never arrived: recomputed here
        self._queue: OrderedDict[int, int] = OrderedDict()  # prefill: request id -> prompt tokens, not yet prefilled
        self._prefilled_since_head = 0  # prefill: prompt tokens computed since the queue's head arrived
        self._active: dict[int, int] = {}  # decode: request id -> resident tokens
        self._finishes = FinishRate()  # decode: how fast requests end here (admission's KV-wait estimate)
        self._committed: dict[int, tuple[int, ...]] = {}  # decode: request id -> schedule, until its first token
        self._deflect_prefilled = 0  # decode: prompt tokens the first committed deflection has prefilled
        self._staged: dict[int, tuple[dict[str, Any], list[int]]] = {}  # prefill, holding: id -> (params, ranks)
        self._waiting = 0  # requests vLLM has not scheduled yet
        self._kv_usage = 0.0
        self._heartbeat: asyncio.Task[None] | None = None
        self._ping: asyncio.Task[None] | None = None
        self._progress_s = time.monotonic()  # last step or answered ping
        self._unhealthy = ""  # why the engine is unhealthy ("" while it is healthy)
        self.events: KVEventMirror | None = None  # the engine core's prefix cache, mirrored from its KV events

    @classmethod
    def from_spec(cls, spec: NodeSpec) -> Self:
        options = spec.options
        bind_cpu_core(spec.role, spec.local_rank)
        model = StepLatencyModel.load(spec.profile)
        policy = spec.policy
        guard = None
        if policy.guards_chunks:  # the scheduler re-checks each chunk with the model the policy decides with
            guard = guard_spec(policy.decode_model, policy.params.chunk_candidates, policy.params.tbt_budget_s)
        join_guard = None
        if policy.join_guard() is not None:  # admission's decode-side protection, checked by the scheduler
            join_guard = join_spec(policy.decode_model, policy.params.tbt_budget_s)
        return cls(
            spec.node_id,
            spec.role,
            spec.model_source,
            spec.engine_kwargs,
            spec.engine_metrics,
            reporter=StateReporter(
                spec.ray_node_id, model, spec.on_state, options.report_interval_s, options.report_refresh_s
            ),
            guard=guard,
            join_guard=join_guard,
            kv_timeout_s=options.kv_timeout_s,
            kv_channel=options.kv_channel,
            hold_blocks=options.kv_hold_blocks,
            stall_timeout_s=options.stall_timeout_s,
            app_name=spec.app_name,
            secret=spec.app_secret,
            ray_node_id=spec.ray_node_id,
        )

    # ---- life cycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Build the engine (tens of seconds) and start the heartbeat."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if self.connector == "NixlConnector":
            self._nixl_identity()
        args = AsyncEngineArgs(**self.args)
        config = args.create_engine_config()
        unmirrored = mirrorable(config.cache_config) if config.kv_events_config is None else "its own kv_events_config"
        if not unmirrored:
            endpoint = events_endpoint(self.staging.directory)
            config.kv_events_config = events_config(endpoint)
        elif config.cache_config.enable_prefix_caching:
            logger.warning("%s: prefix caching without prefix-aware routing: %s", self.node_id, unmirrored)
        if config.parallel_config.distributed_executor_backend == "ray":  # as Ray Serve LLM: workers in our bundles
            config.parallel_config.placement_group = ray.util.get_current_placement_group()
        loggers: list[Any] = [self._stat_logger]
        if self.engine_metrics:  # vLLM's metrics as Ray metrics, as Ray Serve LLM's log_engine_metrics exports them
            from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

            loggers.append(RayPrometheusStatLogger)
        os.environ[PARENT_ENV] = str(os.getpid())  # the engine core ends with this process (engines.vllm_parent_watch)
        self.llm = AsyncLLM.from_vllm_config(
            config,
            stat_loggers=loggers,
            enable_log_requests=args.enable_log_requests,
            disable_log_stats=args.disable_log_stats,
        )
        cache = self.llm.vllm_config.cache_config
        self.kv_capacity_tokens = int(cache.num_gpu_blocks or 0) * int(cache.block_size)
        if not unmirrored:
            self.reporter.cache = JournaledBlockCache(int(cache.block_size))
            self.events = KVEventMirror(self.reporter.cache, endpoint, on_change=self.reporter.report)
            self.events.start()
        if self.args.get("worker_extension_cls") == KAIROS_WORKER:
            await self.llm.collective_rpc("spin_briefly")
            if self.role is Role.DECODE:
                await self.llm.collective_rpc("rewind_cpu_generators")
        self._progress_s = time.monotonic()
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat())

    def _nixl_identity(self) -> None:
        """As Ray Serve LLM does: a side channel per engine on its host, and an engine id unique across replicas."""
        os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_PORT", str(_free_port()))
        kv_config = dict(self.args["kv_transfer_config"])
        side_channel = (os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"], os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        kv_config["engine_id"] = "-".join((str(kv_config.get("engine_id") or self.node_id), *side_channel))
        self.args["kv_transfer_config"] = kv_config

    async def shutdown(self) -> None:
        for task in (self._heartbeat, self._ping):
            if task is not None:
                task.cancel()
        self._heartbeat = self._ping = None
        if self.events is not None:
            self.events.close()
            self.events = None
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
        self.kv.close()
        self.staging.close()

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            self._watch()
            self.reporter.report(force=True)

    def _watch(self) -> None:
        """Ping the engine core; declare the engine unhealthy when it died or made no progress for too long."""
        if self._unhealthy or self.llm is None:
            return
        if self.llm.errored:
            self._fail("its engine core died")
        elif self._ping is None or self._ping.done():
            self._ping = asyncio.get_running_loop().create_task(self._pinged())
        elif time.monotonic() - self._progress_s > self.stall_timeout_s:
            self._fail(f"no step and no answer from its engine core for {self.stall_timeout_s:g} s")

    async def _pinged(self) -> None:
        await self.llm.is_sleeping()  # a utility call the engine core answers between steps
        self._progress_s = time.monotonic()

    def _fail(self, reason: str) -> None:
        """Unhealthy for good: fail every request in flight (vLLM's own path when its engine core dies)."""
        self._unhealthy = f"{self.node_id}: {reason}"
        logger.error("%s; failing its requests in flight", self._unhealthy)
        self.llm.output_processor.propagate_error(EngineUnhealthy(self._unhealthy))

    def engine_pids(self) -> list[int]:
        manager = self.llm.engine_core.resources.engine_manager if self.llm is not None else None
        return [int(p.pid) for p in getattr(manager, "processes", ()) if p.pid is not None]

    def residue(self) -> dict[str, int]:
        vllm_requests = len(self.llm.output_processor.request_states) if self.llm is not None else 0
        return {
            "prefill_queue": len(self._queue),
            "active": len(self._active),
            "committed": len(self._committed),
            "staged": len(self._staged),
            "staged_files": len(glob.glob(os.path.join(self.staging.directory, "*.pt"))),
            "kv_held": self.kv.held,
            "vllm_requests": vllm_requests,  # vLLM's own per-request state in this process (its output processor)
        }

    def check_health(self) -> None:
        if not self._unhealthy and self.llm is not None and self.llm.errored:
            self._unhealthy = f"{self.node_id}: its engine core died"
        if self._unhealthy:
            raise EngineUnhealthy(self._unhealthy)

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
        self._progress_s = time.monotonic()
        details = stats.iteration_details
        if details is not None and not details.is_dummy and details.elapsed_ms > 0:
            kv_tokens = sum(self._active.values())
            prefill_tokens = details.num_ctx_tokens
            # the chunk's own prefix: what its request had prefilled before (deflections run one at a time)
            prefix = self._prefilled_since_head if self.role is Role.PREFILL else self._deflect_prefilled
            elapsed_s = details.elapsed_ms / 1e3
            self.reporter.stepped(details.num_generation_requests, kv_tokens, prefill_tokens, elapsed_s, prefix)
            self._prefilled_since_head += prefill_tokens
            if self._committed:
                self._deflect_prefilled += prefill_tokens
        self.reporter.report()

    # ---- the protocol -----------------------------------------------------------------------

    @staticmethod
    def _sampling(request: EngineRequest, extra: dict[str, Any], handed_off: bool) -> Any:
        """The request's ``SamplingParams`` (vLLM's defaults without), streamed as deltas, plus Kairos's extra args;
        ``handed_off``: its prompt was prefilled elsewhere, which computed the prompt's logprobs if it asked."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sampling = without_prompt_logprobs(request.sampling) if handed_off else request.sampling
        params = sampling.clone() if sampling is not None else SamplingParams()
        params.max_tokens = request.max_tokens
        params.output_kind = RequestOutputKind.DELTA
        if extra:
            params.extra_args = {**(params.extra_args or {}), **extra}
        return params

    def _prompt(self, request: EngineRequest) -> dict[str, Any]:
        if len(request.prompt_token_ids) != request.prompt_tokens:
            raise ValueError(
                f"request {request.request_id}: a vLLM engine needs the prompt's token ids "
                f"({request.prompt_tokens} tokens counted, {len(request.prompt_token_ids)} ids given)"
            )
        prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_token_ids)}
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        return prompt

    async def prefill(self, request: EngineRequest) -> KVHandoff:
        if self.role is not Role.PREFILL:
            raise RuntimeError(f"{self.node_id} is a {self.role} node")
        from vllm import SamplingParams

        rid = request.request_id
        # The one token sampled here is dropped: the decode node samples the first token with the request's
        # own parameters (its seed's generator fresh, as in a single engine), so the prompt alone matters here.
        # the Kairos connector leaves out the blocks the decode node's cache holds; another moves what it moves
        skip = request.kv_receiver_cached_tokens if self.connector == KAIROS_CONNECTOR else 0
        extra = {"kv_transfer_params": remote_decode_params(skip)}
        # the prompt's logprobs, if asked for, are computed here, where its every position is (not on the decode node)
        asked = request.sampling.prompt_logprobs if request.sampling is not None else None
        params = SamplingParams(
            max_tokens=1, temperature=0.0, detokenize=asked is not None, prompt_logprobs=asked, extra_args=extra
        )
        if not self._queue:
            self._prefilled_since_head = 0
        self._queue[rid] = request.prompt_tokens
        self.reporter.accepted(rid)
        final = None
        prompt_logprobs: PromptLogprobs = ()
        try:
            request_id = f"p{rid}.{request.attempt}"
            prompt = self._prompt(request)
            async for output in self.llm.generate(prompt, params, request_id=request_id, priority=request.priority):
                final = output
                prompt_logprobs = prompt_logprobs or _prompt_entries(output.prompt_logprobs)
        finally:
            self._pop_queue(rid)
        end_wall = time.time()
        if final is None or not final.kv_transfer_params:
            raise RuntimeError(f"prefill of request {rid} returned no kv_transfer_params")
        queue_s, exec_s = _prefill_times(final.metrics)
        kv_params: dict[str, Any] = final.kv_transfer_params
        if self.connector != KAIROS_CONNECTOR:  # another connector's hand-off: its parameters
            kv, transport = await self.kv.hand_off(rid, kv_params, request.kv_receiver)
            kv_bytes = skipped = 0
        else:
            skipped = int(kv_params.get(SKIP_TOKENS, 0))
            payload = self.staging.collect(kv_params)
            kv_bytes = sum(len(b) for b in payload.values())
            if self._holds:
                self._staged[rid] = (kv_params, list(payload))
            kv, transport = await self.kv.hand_off(rid, payload, request.kv_receiver)
        return KVHandoff(
            kv=kv,
            kv_bytes=kv_bytes,
            node_id=self.node_id,
            prefill_queue_s=queue_s,
            prefill_exec_s=exec_s,
            prefill_end_wall_s=end_wall,
            transport=transport,
            cached_tokens=final.num_cached_tokens or 0,
            skipped_tokens=skipped,
            prompt_logprobs=prompt_logprobs,
        )

    def _pop_queue(self, rid: int) -> None:
        head = next(iter(self._queue), None)
        tokens = self._queue.pop(rid, 0)
        if rid == head:
            self._prefilled_since_head = max(0, self._prefilled_since_head - tokens)

    def release(self, request_id: int) -> None:
        self.kv.release(request_id)

    def _taken(self, rid: int) -> None:
        """The decode node has the request's KV (or recomputes it): a holding connector frees its blocks."""
        staged = self._staged.pop(rid, None)
        if staged is not None:
            self.staging.mark_taken(*staged)

    async def _kv_params(self, request: EngineRequest, handoff: KVHandoff) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` that load the hand-off's KV here, or None to recompute the prompt."""
        try:
            payload = await self.kv.receive(handoff.kv)
            if self.connector != KAIROS_CONNECTOR:  # the connector pulls the KV itself
                return cast(dict[str, Any], payload)
            name = f"{self.node_id}-{request.request_id}"
            return self.staging.stage(name, cast(KVBytes, payload), request.prompt_tokens, handoff.skipped_tokens)
        except (KVLost, OSError) as error:
            self.kv_recomputes += 1
            logger.warning(
                "%s: KV of request %s from %s not received (%s); recomputing its prompt here",
                self.node_id,
                request.request_id,
                handoff.node_id,
                error,
            )
            return None

    async def generate(self, request: EngineRequest, handoff: KVHandoff | None) -> AsyncIterator[list[TokenEvent]]:
        if self.role is not Role.DECODE:
            raise RuntimeError(f"{self.node_id} is a {self.role} node")
        rid = request.request_id
        prompt = self._prompt(request)
        submitted = time.time()
        earlier = TTFTBreakdown()  # what the prefill node and the hand-off took
        extra: dict[str, Any] = {}
        if handoff is None:
            check_schedule(request)
            extra[SCHEDULE_KEY] = list(request.chunk_schedule)
            if self.guard:
                extra[GUARD_KEY] = priced_with(self.guard, request.decode_model)
            self._committed[rid] = request.chunk_schedule
        else:
            kv_params = await self._kv_params(request, handoff)
            submitted = time.time()
            earlier = TTFTBreakdown(
                handoff.prefill_queue_s, handoff.prefill_exec_s, max(0.0, submitted - handoff.prefill_end_wall_s)
            )
            if kv_params is not None:
                extra["kv_transfer_params"] = kv_params
            if self.join_guard:
                extra[JOIN_KEY] = priced_with(self.join_guard, request.decode_model)
        self.reporter.accepted(rid)
        self._active[rid] = request.prompt_tokens
        index = 0
        try:
            params = self._sampling(request, extra, handed_off=handoff is not None)
            request_id = f"d{rid}.{request.attempt}"
            # vLLM merges the deltas a slow consumer has not taken yet: one output, every token ready
            async for output in self.llm.generate(prompt, params, request_id=request_id, priority=request.priority):
                completion = output.outputs[0]
                ids = list(completion.token_ids)
                logprobs = completion.logprobs  # None unless the request asked for them
                ready = []
                for i, token in enumerate(ids):
                    last = i == len(ids) - 1
                    finished = output.finished and last
                    breakdown = None
                    cached = 0
                    prompt_logprobs: PromptLogprobs = ()
                    if index == 0:
                        self._uncommit(rid)
                        waited = time.time() - submitted
                        if handoff is None:  # prefilled here, in chunks
                            breakdown = TTFTBreakdown(prefill_exec_s=waited)
                            cached = output.num_cached_tokens or 0
                            prompt_logprobs = _prompt_entries(output.prompt_logprobs)
                        else:
                            breakdown = TTFTBreakdown(
                                earlier.prefill_queue_s, earlier.prefill_exec_s, earlier.kv_transfer_s, waited
                            )
                            prompt_logprobs = handoff.prompt_logprobs
                    ready.append(
                        TokenEvent(
                            token,
                            request.output_offset + index,
                            finished,
                            self.node_id,
                            text=completion.text if last else "",
                            finish_reason=(completion.finish_reason or "length") if finished else None,
                            breakdown=breakdown,
                            logprobs=_entries(logprobs[i]) if logprobs else (),
                            stop_reason=completion.stop_reason if finished else None,
                            cached_tokens=cached,
                            prompt_logprobs=prompt_logprobs,
                        )
                    )
                    index += 1
                self._active[rid] += len(ids)
                if ready:
                    yield ready
        finally:
            if self._active.pop(rid, None) is not None:
                self._finishes.finished(time.monotonic())
            self._uncommit(rid)
            self.staging.discard(extra.get("kv_transfer_params"))  # left when the request ended before loading

    def _uncommit(self, rid: int) -> None:
        """A deflection's prefill is over (its first token, or its end): the next one starts from nothing."""
        if next(iter(self._committed), None) == rid:
            self._deflect_prefilled = 0
        self._committed.pop(rid, None)

    def state(self) -> NodeState:
        if self.role is Role.PREFILL:
            head_tokens = next(iter(self._queue.values()), 0)
            view = PrefillNodeView(
                self.node_id, tuple(self._queue.values()), min(self._prefilled_since_head, head_tokens)
            )
            return self.reporter.state(
                view, pinned_kv=self.kv.held, kv_usage=self._kv_usage, healthy=not self._unhealthy
            )
        kv_tokens = sum(self._active.values())
        # a committed deflection's hit, as the router planned it: its prompt beyond its schedule
        cached = tuple(self._active.get(rid, 0) - sum(schedule) for rid, schedule in self._committed.items())
        decode = DecodeNodeView(
            self.node_id,
            batch_size=len(self._active) - len(self._committed),
            kv_tokens=kv_tokens,
            free_kv_tokens=max(0, self.kv_capacity_tokens - kv_tokens),
            committed=tuple(self._committed.values()),
            head_prefilled_tokens=self._deflect_prefilled if self._committed else 0,
            committed_cached_tokens=cached if any(cached) else (),
            finished_per_s=self._finishes.per_s,
        )
        return self.reporter.state(
            decode,
            num_waiting=self._waiting,
            kv_recomputes=self.kv_recomputes,
            kv_usage=self._kv_usage,
            healthy=not self._unhealthy,
        )


def _entries(position: Mapping[int, Any]) -> tuple[TokenLogprob, ...]:
    """One position's logprobs (vLLM's ``{token id: Logprob}``, the sampled token's first) as ``TokenLogprob`` s."""
    return tuple(TokenLogprob(tid, lp.decoded_token or "", lp.logprob, lp.rank) for tid, lp in position.items())


def _prompt_entries(positions: Sequence[Mapping[int, Any] | None] | None) -> PromptLogprobs:
    """vLLM's prompt logprobs (None at the first position) as ``PromptLogprobs`` (``()`` where vLLM has None)."""
    return tuple(_entries(position) if position else () for position in positions or ())


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
