"""An engine that runs the simulator's node model in wall-clock time.

Each step asks the node model (``kairos_ray.nodes``) what to compute, sleeps
for what the emulated hardware's ground truth (``kairos_ray.emulation``)
says an A100 would take (times noise, times ``time_scale``), then applies the
step and streams the tokens it made. Tokens are deterministic (a function of
the request id and the position). A prefill node's KV payload is ``prompt
tokens * kv_bytes_per_token / kv_scale`` bytes handed over by the KV
transport (``kairos_ray.kv``, the Ray object store), less the leading tokens
the router says the decode node's cache holds (``kv_receiver_cached_tokens``);
the decode node receives it before the request may join its batch, so the
transport is real even though the numbers are not. If the KV is lost, or the
decode node no longer holds the tokens that were not sent, it recomputes the
prompt in place, in ``prefill_chunk_tokens`` chunks.

Every step (at most every ``report_interval_s``) and on a heartbeat, the
engine reports its state to the router.

Prefix caching: each node keeps a ``BlockCache`` of ``BLOCK_TOKENS``-token
blocks, as the node model does in the simulator (``kairos_ray.nodes``), for
requests whose prompt came as token ids: a job's blocks are its prompt's
and its deterministic answer's, so a conversation's next turn (the last
prompt, the answer's token ids, a new message) hits the blocks of the node
that served the last one. A deflection takes its hit on its node (its
schedule cut to the uncached suffix), a prefill on its prefill node, and the
reports carry the cache's changes to the router (``engines.reporting``).

What the emulated engine ignores of a request: its ``SamplingParams`` (the ingress parses and checks the request as for
vLLM engines, ``serve.tokens``): it emits exactly ``max_tokens`` tokens
(never an end of sequence, a stop string or stop token), with no logprobs (of its tokens or the prompt's),
whatever the temperature, seed, penalties or structured output asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
import os
import time
import zlib
from collections.abc import AsyncIterator
from typing import Self

from kairos_ray.core import JournaledBlockCache, Policy, StepLatency, StepLatencyModel, block_ids
from kairos_ray.emulation import ClusterHardware, GroundTruth, StepNoise
from kairos_ray.engines import EngineUnhealthy, NodeSpec, check_schedule
from kairos_ray.engines.reporting import StateReporter
from kairos_ray.kv import KVLost, KVTransport, build_transport
from kairos_ray.messages import EngineRequest, KVHandoff, NodeState, Role, TokenEvent, TTFTBreakdown
from kairos_ray.nodes import DecodeNode, Job, PrefillNode

VOCAB = 1000
HEARTBEAT_S = 1.0
BLOCK_TOKENS = 16  # the prefix cache's block size: vLLM's on the GPUs these engines emulate


def token_id(request_id: int, index: int) -> int:
    """The deterministic token an emulated engine emits at ``index`` of request ``request_id``."""
    return (request_id * 7919 + index * 104729) % VOCAB


class EmulatedEngine:
    """A prefill or decode node (``role``) with emulated step timing."""

    def __init__(
        self,
        node_id: str,
        role: Role,
        truth: StepLatency,
        predictor: StepLatency,
        hardware: ClusterHardware,
        prefill_chunk_tokens: int,
        reporter: StateReporter,
        transport: KVTransport,
        policy: Policy | None = None,
        time_scale: float = 1.0,
        kv_scale: int = 1000,
        seed: int = 0,
    ) -> None:
        self.node_id, self.role = node_id, Role(role)
        self.truth, self.predictor, self.hw = truth, predictor, hardware
        self.time_scale, self.kv_scale = time_scale, kv_scale
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.reporter = reporter
        reporter.snapshot = self.state
        self.kv = transport
        self.cache = reporter.cache = JournaledBlockCache(BLOCK_TOKENS)
        self.prefill_node = PrefillNode(node_id, prefill_chunk_tokens, self.cache, hardware.kv_capacity_tokens)
        self.decode_node = DecodeNode(
            node_id,
            hardware.kv_capacity_tokens,
            hardware.max_batch_size,
            policy.chunk_guard() if policy else None,
            record_durations=False,
            cache=self.cache,
            join_guard=policy.join_guard() if policy else None,
        )
        self.policy = policy  # its run-time guards: the pool's model until a request names the router's (_follow)
        self._guard_model: StepLatencyModel | None = None
        self.kv_recomputes = 0  # hand-offs whose KV was lost: recomputed here
        self._noise = StepNoise(seed, hardware.noise_cv)
        # Jobs are keyed by a node-local id: a retried or migrated request may come back to this node.
        self._job_ids = itertools.count()
        self._requests: dict[int, EngineRequest] = {}  # decode: job id -> its request (token ids, offset)
        self._done: dict[int, asyncio.Future[Job]] = {}  # prefill: job id -> resolved when prefilled
        self._streams: dict[int, asyncio.Queue[TokenEvent]] = {}  # decode: job id -> its tokens
        self._emitted: dict[int, int] = {}  # decode: job id -> tokens emitted so far
        self._active: dict[int, Job] = {}  # decode: jobs in the batch
        self._breakdowns: dict[int, TTFTBreakdown] = {}  # decode, disaggregated: what the prefill node timed
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._step: tuple[int, int, int] = (0, 0, 0)  # (B, K, chi) of the step in flight
        self._prefix = 0  # the own prefix of the chunk in that step (Eq. 4)

    @classmethod
    def from_spec(cls, spec: NodeSpec) -> Self:
        model = StepLatencyModel.load(spec.profile)
        hardware = ClusterHardware.from_profile(spec.profile)
        options = spec.options
        return cls(
            spec.node_id,
            spec.role,
            GroundTruth(model, hardware),
            model,
            hardware,
            spec.prefill_chunk_tokens,
            StateReporter(spec.ray_node_id, model, spec.on_state, options.report_interval_s, options.report_refresh_s),
            build_transport(spec.node_id, "", options.kv_timeout_s, secret=spec.app_secret),
            policy=spec.policy,
            time_scale=options.time_scale,
            kv_scale=options.kv_scale,
            seed=options.seed + zlib.crc32(spec.node_id.encode()),
        )

    # ---- life cycle -----------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def engine_pids(self) -> list[int]:
        return [os.getpid()]  # the step loop runs in this process

    def residue(self) -> dict[str, int]:
        prefill, decode = self.prefill_node, self.decode_node
        return {
            "requests": len(self._requests),
            "prefills": len(self._done),
            "streams": len(self._streams),
            "emitted": len(self._emitted),
            "batch": len(self._active),
            "breakdowns": len(self._breakdowns),
            "prefill_queue": len(prefill.queue),
            "decoding": decode.running,
            "deflections": len(decode.deflections),
            "waiting": len(decode.waiting),
            "finishing": len(decode.finishing),
            "incoming": decode.num_incoming,
            "reserved_kv_tokens": decode.reserved_tokens,
            "kv_held": self.kv.held,
        }

    def check_health(self) -> None:
        """Raises ``EngineUnhealthy`` once the step loop has died (an emulated engine cannot stall on its own)."""
        if self._task is not None and self._task.done():
            cause = None if self._task.cancelled() else self._task.exception()
            raise EngineUnhealthy(f"{self.node_id}: the step loop ended ({cause!r})")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.kv.close()

    # ---- the step loop ----------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            step_s = self._begin()
            if step_s is None:
                self.reporter.report(force=True)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=HEARTBEAT_S)
                continue
            start = time.monotonic()
            await asyncio.sleep(step_s * self.time_scale)
            self.reporter.stepped(*self._step, (time.monotonic() - start) / self.time_scale, self._prefix)
            self._end(step_s)
            self.reporter.report()

    def _begin(self) -> float | None:
        """Start the next step; its emulated duration, or None when idle."""
        now = time.monotonic()
        if self.role is Role.PREFILL:
            step = self.prefill_node.begin_step(now)
            if step is None:
                return None
            self._step = (0, *step)
            self._prefix = step[0]  # the head prompt's own prefix: what it has prefilled
        else:
            dstep = self.decode_node.begin_step(now)
            for job in self.decode_node.joined:
                self._active[job.request_id] = job
            if dstep is None:
                return None
            self._step = dstep
            self._prefix = self.decode_node.prefix_tokens  # the deflected chunk's own prefix
        return self.truth.step_s(*self._step, self._prefix) * self._noise.next()

    def _end(self, step_s: float) -> None:
        now = time.monotonic()
        if self.role is Role.PREFILL:
            done = self.prefill_node.end_step(now)
            if done is not None:
                future = self._done.pop(done.request_id, None)
                if future is not None and not future.done():
                    future.set_result(done)
            return
        in_batch = list(self._active.values())
        node = self.decode_node
        node.end_step(now, step_s)
        for job in in_batch:
            self._emit(job)
        for job in node.joined:  # deflected jobs whose last chunk just ran: their first token
            self._emit(job)
            self._active[job.request_id] = job
        for job in node.finished:
            if job.request_id not in self._active:  # a deflected job with a single output token
                self._emit(job)
            self._active.pop(job.request_id, None)
        for job in [j for j in self._active.values() if j.cancelled]:  # dropped by the node model
            self._forget(job.request_id)

    def _forget(self, job_id: int) -> None:
        self._active.pop(job_id, None)
        self._emitted.pop(job_id, None)
        self._breakdowns.pop(job_id, None)
        self._requests.pop(job_id, None)

    def _follow(self, model: StepLatencyModel | None) -> None:
        """Check chunks and joins from now on with ``model``, the one the router priced this node with for the
        request (its calibration of the node; each request carries the latest), as a vLLM node does per request."""
        if model is None or self.policy is None or model == self._guard_model:
            return
        self._guard_model = model
        self.decode_node.guard = self.policy.chunk_guard(model)
        self.decode_node.join_guard = self.policy.join_guard(model)

    def _job(self, request: EngineRequest, answer: bool) -> Job:
        """A job for ``request``, with its blocks' hashes when its prompt came as token ids (its answer's too on a
        decode node: they stay cached for the next turn)."""
        job = Job(next(self._job_ids), time.monotonic(), request.prompt_tokens, request.max_tokens)
        if request.prompt_token_ids and request.cache_salt is None:
            tokens = request.prompt_token_ids
            if answer:
                start = request.output_offset
                tokens += tuple(token_id(request.request_id, i) for i in range(start, start + request.max_tokens))
            job.block_hashes = block_ids(tokens, BLOCK_TOKENS)
        return job

    def _emit(self, job: Job) -> None:
        rid = job.request_id
        request = self._requests.get(rid)
        if request is None:  # its request ended
            return
        index = self._emitted.get(rid, 0)
        finished = index + 1 >= job.output_tokens
        breakdown = None
        if index == 0:
            if job.schedule:  # prefilled here, in chunks
                earlier = self._breakdowns.pop(rid, TTFTBreakdown())
                breakdown = TTFTBreakdown(
                    prefill_queue_s=earlier.prefill_queue_s + job.prefill_start_s - job.arrival_s,
                    prefill_exec_s=earlier.prefill_exec_s + job.first_token_s - job.prefill_start_s,
                    kv_transfer_s=earlier.kv_transfer_s,
                )
            else:
                earlier = self._breakdowns.pop(rid, TTFTBreakdown())
                breakdown = TTFTBreakdown(
                    earlier.prefill_queue_s,
                    earlier.prefill_exec_s,
                    earlier.kv_transfer_s,
                    decode_queue_s=job.first_token_s - job.kv_ready_s,
                )
        stream = self._streams.get(rid)
        if stream is not None:
            position = request.output_offset + index
            token = token_id(request.request_id, position)
            reason = "length" if finished else None
            cached = job.cached_tokens if index == 0 and job.schedule else 0
            event = TokenEvent(token, position, finished, self.node_id, f" tok{token}", reason, breakdown)
            stream.put_nowait(dataclasses.replace(event, cached_tokens=cached) if cached else event)
        if finished:
            self._forget(rid)
        else:
            self._emitted[rid] = index + 1

    # ---- the protocol -----------------------------------------------------------------------

    async def prefill(self, request: EngineRequest) -> KVHandoff:
        if self.role is not Role.PREFILL:
            raise RuntimeError(f"{self.node_id} is a {self.role} node")
        job = self._job(request, answer=False)
        done = self._done[job.request_id] = asyncio.get_running_loop().create_future()
        self.prefill_node.enqueue(job)
        self.reporter.accepted(request.request_id)
        self._wake.set()
        try:
            await done
        except asyncio.CancelledError:  # the client went away: drop its prefill
            self._done.pop(job.request_id, None)
            self.prefill_node.cancel(job)
            raise
        skipped = min(request.kv_receiver_cached_tokens, request.prompt_tokens)  # the receiver holds them
        sent = request.prompt_tokens - skipped
        kv_bytes = max(1, math.ceil(sent * self.hw.kv_bytes_per_token / self.kv_scale))
        kv, transport = await self.kv.hand_off(request.request_id, {0: bytes(kv_bytes)}, request.kv_receiver)
        return KVHandoff(
            kv=kv,
            kv_bytes=kv_bytes,
            node_id=self.node_id,
            prefill_queue_s=job.prefill_start_s - job.arrival_s,
            prefill_exec_s=job.prefill_end_s - job.prefill_start_s,
            prefill_end_wall_s=time.time(),
            transport=transport,
            cached_tokens=job.cached_tokens,
            skipped_tokens=skipped,
        )

    def release(self, request_id: int) -> None:
        self.kv.release(request_id)

    async def _received(self, handoff: KVHandoff, job: Job) -> bool:
        """Whether the hand-off's KV arrived whole, and this node holds the tokens it left out (else the prompt
        is recomputed here); a partial hand-off's job takes its held blocks (``DecodeNode.expect``)."""
        try:
            payload = await self.kv.receive(handoff.kv)
        except KVLost:
            self.kv_recomputes += 1
            return False
        if sum(len(b) for b in payload.values()) != handoff.kv_bytes:
            return False
        if handoff.skipped_tokens:
            if self.cache.cached_tokens(job.block_hashes, job.prompt_tokens) < handoff.skipped_tokens:
                self.kv_recomputes += 1  # evicted since the router's decision
                return False
            self.decode_node.expect(job)
        return True

    async def generate(self, request: EngineRequest, handoff: KVHandoff | None) -> AsyncIterator[list[TokenEvent]]:
        if self.role is not Role.DECODE:
            raise RuntimeError(f"{self.node_id} is a {self.role} node")
        job = self._job(request, answer=True)
        stream: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._streams[job.request_id] = stream
        self._requests[job.request_id] = request
        finished = False
        try:
            self._follow(request.decode_model)
            if handoff is None:
                check_schedule(request)
                job.schedule = request.chunk_schedule
                self.decode_node.deflect(job)
            else:
                received = await self._received(handoff, job)
                self._breakdowns[job.request_id] = TTFTBreakdown(
                    handoff.prefill_queue_s,
                    handoff.prefill_exec_s,
                    kv_transfer_s=max(0.0, time.time() - handoff.prefill_end_wall_s),
                )
                if received:
                    self.decode_node.assign(job)  # the router's ledger counted it until now
                    self.decode_node.transferred(job, time.monotonic())
                else:  # recompute the prompt in place
                    full, rest = divmod(request.prompt_tokens, self.prefill_chunk_tokens)
                    job.schedule = (self.prefill_chunk_tokens,) * full + ((rest,) if rest else ())
                    self.decode_node.deflect(job)
            self.reporter.accepted(request.request_id)
            self._wake.set()
            while not finished:
                ready = [await stream.get()]
                while not stream.empty():  # coalesce what is already there, never wait for more
                    ready.append(stream.get_nowait())
                finished = ready[-1].finished
                yield ready
        finally:
            self._streams.pop(job.request_id, None)
            if not finished:  # the client went away, or the request failed: the node drops the job
                self.decode_node.cancel(job)
                self._breakdowns.pop(job.request_id, None)
                if job.request_id not in self._active:
                    self._requests.pop(job.request_id, None)

    def state(self) -> NodeState:
        healthy = self._task is None or not self._task.done()
        if self.role is Role.PREFILL:
            return self.reporter.state(self.prefill_node.view(), pinned_kv=self.kv.held, healthy=healthy)
        view = self.decode_node.view()  # its finishing rate per wall second: the router counts emulated ones
        view = dataclasses.replace(view, finished_per_s=view.finished_per_s * self.time_scale)
        capacity = self.hw.kv_capacity_tokens
        return self.reporter.state(
            view,
            num_waiting=len(self.decode_node.waiting),
            kv_recomputes=self.kv_recomputes,
            kv_usage=(capacity - view.free_kv_tokens) / capacity,
            healthy=healthy,
        )
