"""An engine that runs the simulator's node model in wall-clock time.

Each step asks the node model (``kairos_ray.nodes``) what to compute, sleeps
for what the profile's ground truth says an A100 would take (times noise,
times ``time_scale``), then applies the step and streams the tokens it made.
Tokens are deterministic (a function of the request id and the position).
A prefill node's KV payload is a byte array of ``prompt_tokens *
kv_bytes_per_token / kv_scale`` bytes put into the Ray object store; the
decode node fetches it before the request may join its batch, so the
transport is real even though the numbers are not.

Every step (at most every ``report_interval_s``) and on a heartbeat, the
engine calls ``on_state`` with its state for the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import ray

from kairos_ray.core import Guard, StepLatency
from kairos_ray.emulation import ClusterHardware, StepNoise
from kairos_ray.engines import EngineRequest, KVHandoff, TokenEvent
from kairos_ray.engines.node_state import KVPins, StateReporter
from kairos_ray.nodes import DecodeNode, Job, PrefillNode

VOCAB = 1000


def token_id(request_id: int, index: int) -> int:
    """The deterministic token an emulated engine emits at ``index`` of request ``request_id``."""
    return (request_id * 7919 + index * 104729) % VOCAB


class EmulatedEngine:
    """A prefill or decode node (``role``) with emulated step timing."""

    def __init__(
        self,
        node_id: str,
        role: str,
        truth: StepLatency,
        predictor: StepLatency,
        hardware: ClusterHardware,
        prefill_chunk_tokens: int,
        guard: Guard | None = None,
        time_scale: float = 1.0,
        kv_scale: int = 1000,
        seed: int = 0,
        report_interval_s: float = 0.02,
        on_state: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        self.node_id, self.role = node_id, role
        self.truth, self.predictor, self.hw = truth, predictor, hardware
        self.time_scale, self.kv_scale = time_scale, kv_scale
        self.reporter = StateReporter(self.state, on_state, report_interval_s)
        self.prefill_node = PrefillNode(node_id, prefill_chunk_tokens)
        self.decode_node = DecodeNode(
            node_id, hardware.kv_capacity_tokens, hardware.max_batch_size, guard, record_durations=False
        )
        self._noise = StepNoise(seed, hardware.noise_cv)
        self._done: dict[int, asyncio.Future[Job]] = {}  # prefill: rid -> future resolved when prefilled
        self._streams: dict[int, asyncio.Queue[TokenEvent]] = {}  # decode: rid -> its tokens
        self._emitted: dict[int, int] = {}  # decode: rid -> tokens emitted so far
        self._active: dict[int, Job] = {}  # decode: jobs in the batch
        self._timings: dict[int, dict[str, float]] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._pins = KVPins()  # prefill: KV payloads handed off, until the decode node has them
        self._last_step_s = 0.0
        self._predicted_step_s = 0.0
        self._step_features: tuple[int, int, int] | None = None  # (B, K, chi) of the last step

    # ---- the step loop ----------------------------------------------------------------

    def start(self) -> None:
        """Start the step loop (and its heartbeat reports); call from the event loop."""
        self._ensure_loop()

    def _ensure_loop(self) -> asyncio.Event:
        if self._wake is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())
        return self._wake

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            step_s = self._begin()
            if step_s is None:
                self.reporter.report(force=True)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=1.0)  # heartbeat
                continue
            start = time.monotonic()
            await asyncio.sleep(step_s * self.time_scale)
            self._last_step_s = (time.monotonic() - start) / self.time_scale
            self._end(step_s)
            self.reporter.report()

    def _begin(self) -> float | None:
        """Start the next step; its emulated duration, or None when idle."""
        now = time.monotonic()
        if self.role == "prefill":
            step = self.prefill_node.begin_step(now)
            if step is None:
                return None
            self._step_features = (0, *step)
            self._predicted_step_s = self.predictor.step_s(0, *step, step[0])
            return self.truth.step_s(0, *step, step[0]) * self._noise.next()
        dstep = self.decode_node.begin_step(now)
        for job in self.decode_node.joined:
            self._active[job.request_id] = job
        if dstep is None:
            return None
        self._step_features = dstep
        self._predicted_step_s = self.predictor.step_s(*dstep, self.decode_node.prefix_tokens)
        return self.truth.step_s(*dstep, self.decode_node.prefix_tokens) * self._noise.next()

    def _end(self, step_s: float) -> None:
        now = time.monotonic()
        if self.role == "prefill":
            done = self.prefill_node.end_step(now)
            if done is not None:
                self._done.pop(done.request_id).set_result(done)
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

    def _emit(self, job: Job) -> None:
        index = self._emitted.get(job.request_id, 0)
        finished = index + 1 >= job.output_tokens
        timings = self._timings.pop(job.request_id, {}) if index == 0 else {}
        if index == 0:
            if job.schedule:  # deflected: prefilled here, in chunks
                timings["prefill_queue_s"] = job.prefill_start_s - job.arrival_s
                timings["prefill_exec_s"] = job.first_token_s - job.prefill_start_s
            else:
                timings["decode_queue_s"] = job.first_token_s - job.kv_ready_s
        stream = self._streams.get(job.request_id)
        if stream is not None:  # None: the client went away; the job still runs its course
            token = token_id(job.request_id, index)
            event = TokenEvent(
                token, index, finished, timings, self.node_id, f" tok{token}", "length" if finished else None
            )
            stream.put_nowait(event)
        if finished:
            self._emitted.pop(job.request_id, None)
        else:
            self._emitted[job.request_id] = index + 1

    # ---- the protocol -----------------------------------------------------------------------

    async def prefill(self, request: EngineRequest) -> KVHandoff:
        if self.role != "prefill":
            raise RuntimeError(f"{self.node_id} is a {self.role} node")
        wake = self._ensure_loop()
        job = Job(request.request_id, time.monotonic(), request.prompt_tokens, request.max_tokens)
        self._done[job.request_id] = asyncio.get_running_loop().create_future()
        queued_at = job.arrival_s
        self.prefill_node.queue.append(job)
        self.reporter.accepted.append(job.request_id)
        wake.set()
        await self._done[job.request_id]
        kv_bytes = max(1, math.ceil(request.prompt_tokens * self.hw.kv_bytes_per_token / self.kv_scale))
        kv = ray.put(np.zeros(kv_bytes, dtype=np.uint8))
        self._pins.pin(job.request_id, kv)
        return KVHandoff(
            kv=kv,
            kv_bytes=kv_bytes,
            node_id=self.node_id,
            prefill_queue_s=job.prefill_start_s - queued_at,
            prefill_exec_s=job.prefill_end_s - job.prefill_start_s,
            prefill_end_wall_s=time.time(),
        )

    def release(self, request_id: int) -> None:
        """The decode node has the KV of ``request_id``: free it here."""
        self._pins.release(request_id)

    async def generate(self, request: EngineRequest, handoff: KVHandoff | None) -> AsyncIterator[TokenEvent]:
        if self.role != "decode":
            raise RuntimeError(f"{self.node_id} is a {self.role} node")
        wake = self._ensure_loop()
        job = Job(request.request_id, time.monotonic(), request.prompt_tokens, request.max_tokens)
        stream: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._streams[job.request_id] = stream
        try:
            if handoff is None:
                if not request.chunk_schedule or sum(request.chunk_schedule) != request.prompt_tokens:
                    raise ValueError(
                        f"a deflected request needs a chunk schedule summing to its {request.prompt_tokens} "
                        f"prompt tokens, got {request.chunk_schedule}"
                    )
                job.schedule = request.chunk_schedule
                self.decode_node.deflect(job)
            else:
                payload = await handoff.kv  # through the object store
                if payload.nbytes != handoff.kv_bytes:
                    raise RuntimeError(f"KV payload of {payload.nbytes} bytes, expected {handoff.kv_bytes}")
                self._timings[job.request_id] = {
                    "prefill_queue_s": handoff.prefill_queue_s,
                    "prefill_exec_s": handoff.prefill_exec_s,
                    "kv_transfer_s": max(0.0, time.time() - handoff.prefill_end_wall_s),
                }
                self.decode_node.transferred(job, time.monotonic())
            self.reporter.accepted.append(job.request_id)
            wake.set()
            while True:
                event = await stream.get()
                yield event
                if event.finished:
                    return
        finally:
            self._streams.pop(job.request_id, None)

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "node_id": self.node_id,
            "role": self.role,
            "wall_s": time.time(),
            "measured_step_s": self._last_step_s,
            "predicted_step_s": self._predicted_step_s,
            "step_features": self._step_features,
        }
        if self.role == "prefill":
            view = self.prefill_node.view()
            state.update(
                queued=list(view.queued_prompt_tokens),
                head_prefilled=view.head_prefilled_tokens,
                pinned_kv=len(self._pins),
            )
        else:
            dview = self.decode_node.view()
            state.update(
                batch_size=dview.batch_size,
                kv_tokens=dview.kv_tokens,
                free_kv_tokens=dview.free_kv_tokens,
                committed=[list(c) for c in dview.committed],
                waiting=len(self.decode_node.waiting),
            )
        return state
