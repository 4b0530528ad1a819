"""Discrete-event simulator of a disaggregated cluster, driven by the core's own policies.

Virtual time only. Events live in one heap as ``(time_s, kind, seq, payload)``;
the loop is heappop -> handle -> push the events it causes. Events at the same
instant are handled in ``Kind`` order, then in the order they were created:

1. ``PREFILL_STEP_END`` and 2. ``DECODE_STEP_END``: finished steps release
   their tokens, KV and batch slots first,
3. ``KV_ARRIVAL``: KV that lands joins the decode queue,
4. ``REQUEST_ARRIVAL``: a request arriving at that instant is decided on the
   state after all of the above, as a router would see it.

Nodes:

- Prefill node: FIFO queue; each step prefills up to ``prefill_chunk_tokens``
  of the head request (the head's cached context growing), priced by the
  ground truth at B = 0. When a prompt is done, its KV goes to the chosen
  decode node over that node's link.
- KV link: one per decode node, FIFO: a transfer takes ``setup + bytes /
  bandwidth`` and waits for the transfers to the same node ahead of it, so
  bursts build transfer queues.
- Decode node: continuous batching. A transferred request joins the batch at
  the next step start when a slot (``max_batch_size``) and KV room for its
  prompt and output are free, and yields its first token at the end of that
  step. Deflected requests run their chunk schedules one after another, one
  chunk per step injected into the decode batch; the last chunk yields the
  first token and the request joins the batch. With a ``guard``, the node
  re-checks each planned chunk against the batch it has when the chunk runs
  (``core.sweep.largest_safe_chunk``): the batch may have grown since the
  router planned. Every running request emits
  one token per step, so its TBT gaps are the durations of the node's steps
  it was in.

The view a policy sees is the simulator's exact state, but step times come from
``GroundTruth`` times noise, not from the predictor the policy uses.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from kairos_ray.core import ClusterView, Decision, DecodeNodeView, Policy, PrefillNodeView, Route, StepLatency
from kairos_ray.metrics import RequestRecord
from kairos_ray.sim.hardware import ClusterHardware
from kairos_ray.workloads import Workload


class Kind(IntEnum):
    """Event kinds; at equal times, lower values are handled first."""

    PREFILL_STEP_END = 0
    DECODE_STEP_END = 1
    KV_ARRIVAL = 2
    REQUEST_ARRIVAL = 3


class _Noise:
    """Multiplicative log-normal step noise with mean 1, drawn in blocks for speed."""

    BLOCK = 1 << 14

    def __init__(self, rng: np.random.Generator, cv: float) -> None:
        self.rng = rng
        self.sigma = math.sqrt(math.log1p(cv * cv))
        self.values: list[float] = []

    def next(self) -> float:
        if not self.values:
            draws = self.rng.standard_normal(self.BLOCK) * self.sigma - self.sigma * self.sigma / 2
            self.values = np.exp(draws).tolist()
        return self.values.pop()


@dataclass(slots=True, eq=False)
class SimRequest:
    rid: int
    arrival_s: float
    prompt: int
    output: int
    decision: Decision | None = None
    prefill_node: int = -1
    decode_node: int = -1
    schedule: tuple[int, ...] = ()  # chunk schedule when deflected
    next_chunk: int = 0  # index into schedule
    prefill_start_s: float = math.nan
    prefill_end_s: float = math.nan
    kv_ready_s: float = math.nan
    first_token_s: float = math.nan
    finish_s: float = math.nan
    join_step: int = 0  # first decode-node step in which it emits a token
    last_step: int = 0  # decode-node step of its last token


@dataclass(eq=False)
class _PrefillNode:
    node_id: str
    queue: deque[SimRequest] = field(default_factory=deque)
    done_tokens: int = 0  # of the head request
    chunk: int = 0  # tokens of the step in flight
    busy: bool = False
    busy_s: float = 0.0


@dataclass(eq=False)
class _DecodeNode:
    node_id: str
    running: int = 0
    kv_tokens: int = 0
    reserved_tokens: int = 0  # prompt + output of every admitted or deflected request not yet finished
    step: int = 0  # index of the next step to end
    chunk: int = 0  # deflected tokens in the step in flight
    busy: bool = False
    busy_s: float = 0.0
    link_free_s: float = 0.0
    finishing: list[tuple[int, int, SimRequest]] = field(default_factory=list)  # heap of (last_step, rid, req)
    deflections: deque[SimRequest] = field(default_factory=deque)
    waiting: deque[SimRequest] = field(default_factory=deque)
    fresh: list[SimRequest] = field(default_factory=list)  # joined at this step's start: first token at its end
    durations: list[float] = field(default_factory=list)  # every step's duration, index = step


@dataclass
class SimResult:
    records: list[RequestRecord]
    requests: list[SimRequest]
    prefill_util: float  # busy share of the prefill pool over the run
    decode_util: float
    events: int
    makespan_s: float


class ClusterSim:
    """One run of one policy over one workload."""

    def __init__(
        self,
        policy: Policy,
        truth: StepLatency,
        hardware: ClusterHardware,
        num_prefill: int,
        num_decode: int,
        prefill_chunk_tokens: int,
        seed: int = 0,
        guard: Callable[[int, int, int], int] | None = None,
    ) -> None:
        if num_prefill < 1 or num_decode < 1:
            raise ValueError(f"need at least 1 prefill and 1 decode node, got {num_prefill}P{num_decode}D")
        self.policy = policy
        self.truth = truth
        self.hw = hardware
        self.chunk_tokens = prefill_chunk_tokens
        self.guard = guard  # (B, K, planned chunk) -> chunk to run now; see core.sweep.largest_safe_chunk
        self.prefill = [_PrefillNode(f"prefill-{i}") for i in range(num_prefill)]
        self.decode = [_DecodeNode(f"decode-{i}") for i in range(num_decode)]
        self._index = {n.node_id: i for i, n in enumerate(self.prefill)} | {
            n.node_id: i for i, n in enumerate(self.decode)
        }
        self.noise = _Noise(np.random.default_rng(seed), hardware.noise_cv)
        self.now = 0.0
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0

    def _push(self, time_s: float, kind: Kind, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time_s, kind, self._seq, payload))

    # ---- the view a policy decides on ------------------------------------------------------

    def view(self) -> ClusterView:
        """The cluster as the router would see it now (exact state)."""
        prefill = []
        for node in self.prefill:
            queued = [r.prompt for r in node.queue]
            if queued:
                queued[0] -= node.done_tokens
            prefill.append(PrefillNodeView(node.node_id, tuple(queued), head_prefilled_tokens=node.done_tokens))
        decode = []
        for dnode in self.decode:
            committed = tuple(r.schedule[r.next_chunk :] for r in dnode.deflections)
            pending = sum(map(sum, committed))
            decode.append(
                DecodeNodeView(
                    dnode.node_id,
                    batch_size=dnode.running,
                    kv_tokens=dnode.kv_tokens,
                    # headroom = free - pending = capacity - reservations (see DecodeNodeView)
                    free_kv_tokens=self.hw.kv_capacity_tokens - dnode.reserved_tokens + pending,
                    committed=committed,
                )
            )
        return ClusterView(tuple(prefill), tuple(decode))

    # ---- event handlers -------------------------------------------------------------------

    def _arrive(self, req: SimRequest) -> None:
        decision = self.policy.decide(req.prompt, self.view())
        req.decision = decision
        if decision.decode_node is None:
            raise RuntimeError("policy named no decode node")
        req.decode_node = self._index[decision.decode_node]
        decode = self.decode[req.decode_node]
        if decision.route is Route.DEFLECT:
            req.schedule = decision.chunk_schedule
            decode.reserved_tokens += req.prompt + req.output
            decode.deflections.append(req)
            if not decode.busy:
                self._start_decode_step(decode)
            return
        assert decision.prefill_node is not None
        req.prefill_node = self._index[decision.prefill_node]
        prefill = self.prefill[req.prefill_node]
        prefill.queue.append(req)
        if not prefill.busy:
            self._start_prefill_step(prefill)

    def _start_prefill_step(self, node: _PrefillNode) -> None:
        if not node.queue:
            node.busy = False
            return
        head = node.queue[0]
        if node.done_tokens == 0:
            head.prefill_start_s = self.now
        node.chunk = min(self.chunk_tokens, head.prompt - node.done_tokens)
        duration = self.truth.step_s(0, node.done_tokens, node.chunk) * self.noise.next()
        node.busy = True
        node.busy_s += duration
        self._push(self.now + duration, Kind.PREFILL_STEP_END, node)

    def _end_prefill_step(self, node: _PrefillNode) -> None:
        node.done_tokens += node.chunk
        head = node.queue[0]
        if node.done_tokens == head.prompt:
            node.queue.popleft()
            node.done_tokens = 0
            head.prefill_end_s = self.now
            link = self.decode[head.decode_node]
            start = max(self.now, link.link_free_s)
            link.link_free_s = start + self.hw.transfer_s(head.prompt)
            self._push(link.link_free_s, Kind.KV_ARRIVAL, head)
        self._start_prefill_step(node)

    def _kv_arrives(self, req: SimRequest) -> None:
        req.kv_ready_s = self.now
        node = self.decode[req.decode_node]
        node.waiting.append(req)
        if not node.busy:
            self._start_decode_step(node)

    def _start_decode_step(self, node: _DecodeNode) -> None:
        hw = self.hw
        step = node.step
        while node.waiting and node.running < hw.max_batch_size:
            req = node.waiting[0]
            need = req.prompt + req.output
            if node.reserved_tokens + need > hw.kv_capacity_tokens and node.running:
                break  # wait for KV to free up (an idle node always takes it: nothing else will free KV)
            node.waiting.popleft()
            node.reserved_tokens += need
            node.running += 1
            node.kv_tokens += req.prompt
            req.join_step = step
            req.last_step = step + req.output - 1
            heapq.heappush(node.finishing, (req.last_step, req.rid, req))
            node.fresh.append(req)
        node.chunk = 0
        if node.deflections:
            head = node.deflections[0]
            if head.next_chunk == 0:
                head.prefill_start_s = self.now
            planned = head.schedule[head.next_chunk]
            node.chunk = planned if self.guard is None else self.guard(node.running, node.kv_tokens, planned)
            if 0 < node.chunk < planned:
                i = head.next_chunk
                head.schedule = (*head.schedule[:i], node.chunk, planned - node.chunk, *head.schedule[i + 1 :])
        if not node.running and not node.chunk:
            node.busy = False
            return
        duration = self.truth.step_s(node.running, node.kv_tokens, node.chunk) * self.noise.next()
        node.durations.append(duration)
        node.busy = True
        node.busy_s += duration
        self._push(self.now + duration, Kind.DECODE_STEP_END, node)

    def _end_decode_step(self, node: _DecodeNode) -> None:
        now, step = self.now, node.step
        node.kv_tokens += node.running  # every running request wrote one token
        for req in node.fresh:
            req.first_token_s = now
        node.fresh.clear()
        if node.deflections and node.chunk:
            head = node.deflections[0]
            head.next_chunk += 1
            node.kv_tokens += node.chunk
            if head.next_chunk == len(head.schedule):
                node.deflections.popleft()
                head.prefill_end_s = head.first_token_s = now
                head.join_step = step + 1
                head.last_step = step + head.output - 1
                if head.output > 1:
                    node.running += 1
                    heapq.heappush(node.finishing, (head.last_step, head.rid, head))
                else:
                    self._finish(node, head)
        finishing = node.finishing
        while finishing and finishing[0][0] == step:
            self._finish(node, heapq.heappop(finishing)[2])
            node.running -= 1
        node.step += 1
        self._start_decode_step(node)

    def _finish(self, node: _DecodeNode, req: SimRequest) -> None:
        req.finish_s = self.now
        node.kv_tokens -= req.prompt + max(0, req.last_step - req.join_step + 1)
        node.reserved_tokens -= req.prompt + req.output

    # ---- the run --------------------------------------------------------------------------

    def run(self, workload: Workload, progress: Callable[[int], None] | None = None) -> SimResult:
        """Simulate every request of ``workload`` to its last token."""
        requests = [
            SimRequest(i, r.arrival_s, r.prompt_tokens, r.output_tokens) for i, r in enumerate(workload.requests)
        ]
        self._events = [(r.arrival_s, Kind.REQUEST_ARRIVAL, i, r) for i, r in enumerate(requests)]
        heapq.heapify(self._events)
        self._seq = len(requests)
        handlers: dict[int, Callable[[object], None]] = {
            Kind.PREFILL_STEP_END: self._end_prefill_step,  # type: ignore[dict-item]
            Kind.DECODE_STEP_END: self._end_decode_step,  # type: ignore[dict-item]
            Kind.KV_ARRIVAL: self._kv_arrives,  # type: ignore[dict-item]
            Kind.REQUEST_ARRIVAL: self._arrive,  # type: ignore[dict-item]
        }
        events = 0
        heap = self._events
        pop = heapq.heappop
        while heap:
            time_s, kind, _, payload = pop(heap)
            self.now = time_s
            handlers[kind](payload)
            events += 1
            if progress is not None and kind == Kind.REQUEST_ARRIVAL:
                progress(1)
        makespan = self.now
        busy_prefill = sum(n.busy_s for n in self.prefill) / (len(self.prefill) * makespan) if makespan else 0.0
        busy_decode = sum(n.busy_s for n in self.decode) / (len(self.decode) * makespan) if makespan else 0.0
        return SimResult(self._records(requests), requests, busy_prefill, busy_decode, events, makespan)

    def _records(self, requests: Sequence[SimRequest]) -> list[RequestRecord]:
        durations = [np.asarray(n.durations) for n in self.decode]
        records = []
        for r in requests:
            decision = r.decision
            assert decision is not None
            deflected = decision.route is Route.DEFLECT
            if deflected:
                queue_s, exec_s, kv_s, dq_s = (
                    r.prefill_start_s - r.arrival_s,
                    r.first_token_s - r.prefill_start_s,
                    0.0,
                    0.0,
                )
            else:
                queue_s = r.prefill_start_s - r.arrival_s
                exec_s = r.prefill_end_s - r.prefill_start_s
                kv_s = r.kv_ready_s - r.prefill_end_s
                dq_s = r.first_token_s - r.kv_ready_s
            first_gap = r.join_step if deflected else r.join_step + 1
            records.append(
                RequestRecord(
                    request_id=r.rid,
                    arrival_s=r.arrival_s,
                    prompt_tokens=r.prompt,
                    output_tokens=r.output,
                    route=decision.route.value,
                    prefill_node=self.prefill[r.prefill_node].node_id if r.prefill_node >= 0 else "",
                    decode_node=self.decode[r.decode_node].node_id,
                    ttft_s=r.first_token_s - r.arrival_s,
                    prefill_queue_s=queue_s,
                    prefill_exec_s=exec_s,
                    kv_transfer_s=kv_s,
                    decode_queue_s=dq_s,
                    finish_s=r.finish_s,
                    tbt_gaps_s=durations[r.decode_node][first_gap : r.last_step + 1],
                )
            )
        return records
