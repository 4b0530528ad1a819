"""Discrete-event simulator of a disaggregated cluster, driven by the core's own policies.

Virtual time only. Events live in one heap as ``(time_s, kind, seq, payload)``;
the loop is heappop -> handle -> push the events it causes. Events at the same
instant are handled in ``Kind`` order, then in the order they were created:

1. ``PREFILL_STEP_END`` and 2. ``DECODE_STEP_END``: finished steps release
   their tokens, KV and batch slots first,
3. ``KV_ARRIVAL``: KV that lands joins the decode queue,
4. ``REQUEST_ARRIVAL``: a request arriving at that instant is decided on the
   state after all of the above, as a router would see it.

Nodes are the state machines of ``kairos_ray.nodes`` (shared with the
emulated engines); prefill steps are priced by the ground truth at B = 0,
every chunk attending over its own request's prefix (a decode node's
deflected chunks too: ``DecodeNode.prefix_tokens``). When
a prompt is done on a prefill node, its KV goes to the chosen decode node over
that node's link: one link per decode node, FIFO, a transfer taking ``setup +
bytes / bandwidth`` after the transfers to the same node ahead of it, so
bursts build transfer queues.

The view a policy sees is the simulator's exact state, a hand-off counted on its
decode node from its decision on (``DecodeNode.assign``: through its prefill and
KV transfer, as the router's ledger counts it), but step times come from
``GroundTruth`` times noise, not from the predictor the policy uses. Decode
nodes re-check each planned chunk when it runs with the policy's own guard
(``Policy.chunk_guard``: Eq. 5 at run time, for the TBT-aware policies; the
static baselines check no TBT, in planning or at run time, as in the paper).

Prefix caching, when the workload has prefix identity: every node keeps a
``BlockCache`` of its KV capacity in the workload's block size, under every
policy (vLLM caches prefixes whatever routes the requests). A request is
decided with the hits each node's cache holds for it (``PrefixHits``; a
cache-blind policy ignores them), computed where it lands from its hit on,
and a hand-off carries only the blocks its decode node lacks
(``DecodeNode.expect``). Without prefix identity nothing of this runs.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from kairos_ray.core import BlockCache, ClusterView, Policy, PrefixHits, Route, StepLatency
from kairos_ray.emulation import ClusterHardware, StepNoise
from kairos_ray.metrics import RequestRecord
from kairos_ray.nodes import DecodeNode, Job, PrefillNode
from kairos_ray.workloads import Workload


class Kind(IntEnum):
    """Event kinds; at equal times, lower values are handled first."""

    PREFILL_STEP_END = 0
    DECODE_STEP_END = 1
    KV_ARRIVAL = 2
    REQUEST_ARRIVAL = 3


@dataclass
class SimResult:
    records: list[RequestRecord]
    requests: list[Job]
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
    ) -> None:
        if num_prefill < 1 or num_decode < 1:
            raise ValueError(f"need at least 1 prefill and 1 decode node, got {num_prefill}P{num_decode}D")
        self.policy = policy
        self.truth = truth
        self.hw = hardware
        self.prefill = [
            PrefillNode(f"prefill-{i}", prefill_chunk_tokens, kv_capacity_tokens=hardware.kv_capacity_tokens)
            for i in range(num_prefill)
        ]
        self.decode = [
            DecodeNode(f"decode-{i}", hardware.kv_capacity_tokens, hardware.max_batch_size, policy.chunk_guard())
            for i in range(num_decode)
        ]
        self._index = {n.node_id: i for i, n in enumerate(self.prefill)} | {
            n.node_id: i for i, n in enumerate(self.decode)
        }
        self._link_free_s = [0.0] * num_decode  # when each decode node's KV link is next free
        self.noise = StepNoise(seed, hardware.noise_cv)
        self.now = 0.0
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._caches: list[tuple[str, BlockCache]] = []  # every node's prefix cache, once a workload has identity

    def _push(self, time_s: float, kind: Kind, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time_s, kind, self._seq, payload))

    # ---- the view a policy decides on ------------------------------------------------------

    def view(self) -> ClusterView:
        """The cluster as the router would see it now (exact state)."""
        return ClusterView(tuple(n.view() for n in self.prefill), tuple(n.view() for n in self.decode))

    def hits(self, job: Job) -> PrefixHits | None:
        """What each node's cache holds of the job's prompt; None without prefix identity."""
        if not job.block_hashes:
            return None
        hashes, prompt = job.block_hashes, job.prompt_tokens
        return PrefixHits({node_id: cache.cached_tokens(hashes, prompt) for node_id, cache in self._caches})

    # ---- event handlers -------------------------------------------------------------------

    def _arrive(self, job: Job) -> None:
        decision = self.policy.decide(job.prompt_tokens, self.view(), self.hits(job))
        job.decision = decision
        if decision.decode_node is None:
            raise RuntimeError("policy named no decode node")
        job.decode_node = self._index[decision.decode_node]
        if decision.route is Route.DEFLECT:
            job.schedule = decision.chunk_schedule
            decode = self.decode[job.decode_node]
            decode.deflect(job)
            if not decode.busy:
                self._start_decode_step(decode)
            return
        assert decision.prefill_node is not None
        self.decode[job.decode_node].assign(job)  # bound for it from the decision on, as in the router's ledger
        job.prefill_node = self._index[decision.prefill_node]
        prefill = self.prefill[job.prefill_node]
        prefill.enqueue(job)
        if not prefill.busy:
            self._start_prefill_step(prefill)

    def _start_prefill_step(self, node: PrefillNode) -> None:
        step = node.begin_step(self.now)
        if step is None:
            return
        context, chunk = step  # the head's prefilled context: the node's KV and the chunk's own prefix
        duration = self.truth.step_s(0, context, chunk, context) * self.noise.next()
        node.busy_s += duration
        self._push(self.now + duration, Kind.PREFILL_STEP_END, node)

    def _end_prefill_step(self, node: PrefillNode) -> None:
        done = node.end_step(self.now)
        if done is not None:
            tokens = self.decode[done.decode_node].expect(done)
            start = max(self.now, self._link_free_s[done.decode_node])
            self._link_free_s[done.decode_node] = arrival = start + self.hw.transfer_s(tokens)
            self._push(arrival, Kind.KV_ARRIVAL, done)
        self._start_prefill_step(node)

    def _kv_arrives(self, job: Job) -> None:
        node = self.decode[job.decode_node]
        node.transferred(job, self.now)
        if not node.busy:
            self._start_decode_step(node)

    def _start_decode_step(self, node: DecodeNode) -> None:
        step = node.begin_step(self.now)
        if step is None:
            return
        duration = self.truth.step_s(*step, node.prefix_tokens) * self.noise.next()
        self._push(self.now + duration, Kind.DECODE_STEP_END, (node, duration))

    def _end_decode_step(self, event: tuple[DecodeNode, float]) -> None:
        node, duration = event
        node.end_step(self.now, duration)
        self._start_decode_step(node)

    # ---- the run --------------------------------------------------------------------------

    def run(self, workload: Workload, progress: Callable[[int], None] | None = None) -> SimResult:
        """Simulate every request of ``workload`` to its last token."""
        if workload.has_prefix_identity:
            nodes: list[PrefillNode | DecodeNode] = [*self.prefill, *self.decode]
            for node in nodes:
                node.cache = BlockCache(workload.block_tokens)
                self._caches.append((node.node_id, node.cache))
        requests = [
            Job(i, r.arrival_s, r.prompt_tokens, r.output_tokens, block_hashes=r.block_hashes)
            for i, r in enumerate(workload.requests)
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

    def _records(self, requests: Sequence[Job]) -> list[RequestRecord]:
        durations = [np.asarray(n.durations) for n in self.decode]
        kv_bytes = self.hw.kv_bytes_per_token
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
                    request_id=r.request_id,
                    arrival_s=r.arrival_s,
                    prompt_tokens=r.prompt_tokens,
                    output_tokens=r.output_tokens,
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
                    cached_tokens=r.cached_tokens,
                    kv_transfer_bytes=0 if deflected else (r.prompt_tokens - r.handoff_cached_tokens) * kv_bytes,
                )
            )
        return records
