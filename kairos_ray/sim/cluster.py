"""Discrete-event simulator of a disaggregated cluster, driven by the core's own policies.

Virtual time only. Events live in one heap as ``(time_s, kind, seq, payload)``;
the loop is heappop -> handle -> push the events it causes. Events at the same
instant are handled in ``Kind`` order, then in the order they were created:

1. ``PREFILL_STEP_END`` and 2. ``DECODE_STEP_END``: finished steps release
   their tokens, KV and batch slots first,
3. ``KV_ARRIVAL``: KV that lands joins the decode queue,
4. ``KV_WAIT_END``: a KV that has waited ``kv_wait_max_s`` on its prefill node
   goes to its decode node (unless a finished step above has freed room for it),
5. ``REQUEST_ARRIVAL``: a request arriving at that instant is decided on the
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

Admission (``PolicyParams.admission``, ``core.admission``), when on: a
request the policy sheds is recorded as shed and dispatched nowhere. A
finished prefill's KV goes to its decode node once that node can take it
within beta * tau (``core.admission.handoff_fits``, counting the hand-offs
already sent there and not yet in its batch); until then it waits on its
prefill node, first come first served among those bound for that node, until
a decode step there that finishes requests frees room, or for
``kv_wait_max_s`` at most, after which it goes anyway, and the node's
``join_guard`` still lets it join only within the budget. The wait counts in
the record's ``kv_transfer_s``. Every ``probe_every``-th shed request is
also admitted, as decided, in a copy of the simulation taken at its arrival,
run until that request has finished (``SimResult.probes``): whether a shed
request would have met its objective, had it been admitted.

Router shards (``router_shards`` above 1, ``core.shards``): each shard owns
the decode nodes ``assign`` deals it and decides with a policy (and
index) of its own on the prefill nodes and its decode nodes; requests go to
the shards in turn. Each decision is also taken over the whole fleet on the
same state, and ``SimResult.kept_from_better`` is the share of requests a
node of another shard would have served sooner.
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import TypeVar

import numpy as np

from kairos_ray.core import (
    BlockCache,
    ClusterView,
    Decision,
    DecodeNodeView,
    Policy,
    PrefillNodeView,
    PrefixHits,
    Route,
    StepLatency,
    handoff_fits,
)
from kairos_ray.core.shards import assign, kept_from_better, shard_for
from kairos_ray.emulation import ClusterHardware, StepNoise
from kairos_ray.metrics import RequestRecord
from kairos_ray.nodes import DecodeNode, Job, PrefillNode
from kairos_ray.workloads import Workload

V = TypeVar("V", PrefillNodeView, DecodeNodeView)


def _kept(last: V, now: V) -> V:
    """``last`` when it equals ``now``: the same object for a node that has not changed."""
    return last if last == now else now


class Kind(IntEnum):
    """Event kinds; at equal times, lower values are handled first."""

    PREFILL_STEP_END = 0
    DECODE_STEP_END = 1
    KV_ARRIVAL = 2
    KV_WAIT_END = 3
    REQUEST_ARRIVAL = 4


@dataclass
class SimResult:
    records: list[RequestRecord]
    requests: list[Job]
    prefill_util: float  # busy share of the prefill pool over the run
    decode_util: float
    events: int
    makespan_s: float
    probes: dict[int, RequestRecord] = field(default_factory=dict)  # shed request id -> its record, admitted
    # router shards: the share of decisions a node of another shard would have served sooner (None: one router)
    kept_from_better: float | None = None


@dataclass(frozen=True)
class NodeGroup:
    """``count`` nodes of one kind: what their steps take (``truth``, before noise), their limits and KV link
    (``hardware``), and the step-latency model their views show the policy (``model``; None: their pool's, the
    policy's own)."""

    count: int
    truth: StepLatency
    hardware: ClusterHardware
    model: StepLatency | None = None


class _Shards:
    """Router shards deciding in the simulator (``core.shards``): each owns its decode nodes and keeps a policy,
    and with it an index, of its own; every decision is also taken over the whole fleet, to count how often a
    node of another shard would have served the request sooner."""

    def __init__(self, policy: Policy, decode_ids: Sequence[str], count: int) -> None:
        numbers = range(count)
        owners = assign(decode_ids, numbers)
        nodes = [[i for i, node in enumerate(decode_ids) if owners[node] == shard] for shard in numbers]
        self.serving = [shard for shard in numbers if nodes[shard]]  # those owning a node: requests go to them
        self.nodes = nodes
        self.policies = [copy.deepcopy(policy) for _ in numbers]  # each its own index over its own nodes
        self.decided = self.kept = 0

    def decide(self, fleet: Policy, job: Job, view: ClusterView, hits: PrefixHits | None) -> Decision:
        """The decision of the shard ``job`` asks, on the prefill nodes and that shard's decode nodes."""
        shard = shard_for(job.request_id, self.serving)
        own = ClusterView(view.prefill, tuple(view.decode[i] for i in self.nodes[shard]))
        args = (job.priority, job.output_tokens)
        decision = self.policies[shard].decide(job.prompt_tokens, own, hits, *args)
        self.decided += 1
        self.kept += kept_from_better(decision, fleet.decide(job.prompt_tokens, view, hits, *args))
        return decision

    @property
    def kept_share(self) -> float:
        return self.kept / self.decided if self.decided else 0.0


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
        probe_every: int = 0,
        prefill_groups: Sequence[NodeGroup] = (),
        decode_groups: Sequence[NodeGroup] = (),
        router_shards: int = 1,
    ) -> None:
        """``num_prefill`` and ``num_decode`` nodes of ``truth`` and ``hardware``, or, given groups, a mixed
        fleet: each pool its groups' nodes in order (``hardware`` still gives the step noise). With
        ``router_shards`` above 1, decisions are taken by that many router shards (``core.shards``)."""
        prefill_groups = prefill_groups or (NodeGroup(num_prefill, truth, hardware),)
        decode_groups = decode_groups or (NodeGroup(num_decode, truth, hardware),)
        num_prefill, num_decode = sum(g.count for g in prefill_groups), sum(g.count for g in decode_groups)
        if num_prefill < 1 or num_decode < 1:
            raise ValueError(f"need at least 1 prefill and 1 decode node, got {num_prefill}P{num_decode}D")
        self.policy = policy
        self.hw = hardware
        prefill_of = [g for g in prefill_groups for _ in range(g.count)]
        self._decode_of = [g for g in decode_groups for _ in range(g.count)]
        self._prefill_truth = [g.truth for g in prefill_of]
        self.prefill = [
            PrefillNode(
                f"prefill-{i}", prefill_chunk_tokens, kv_capacity_tokens=g.hardware.kv_capacity_tokens, model=g.model
            )
            for i, g in enumerate(prefill_of)
        ]
        self.decode = [
            DecodeNode(
                f"decode-{i}",
                g.hardware.kv_capacity_tokens,
                g.hardware.max_batch_size,
                policy.chunk_guard(g.model),
                join_guard=policy.join_guard(g.model),
                model=g.model,
            )
            for i, g in enumerate(self._decode_of)
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
        self._protect = policy.params.admission.on  # decode-side protection: KV waits for a node that can take it
        # per decode node, the prefilled jobs whose KV waits on its prefill node for it, first come first served
        self._kv_waiting: list[dict[int, Job]] = [{} for _ in range(num_decode)]
        self._sent = [0] * num_decode  # per decode node: hand-offs whose KV was sent there, not in its batch yet
        self._sent_kv_tokens = [0] * num_decode  # the KV they will reserve there: prompt and output
        self._sent_prompt_tokens = [0] * num_decode  # of that, their prompts
        self.probe_every = probe_every
        self._num_shed = 0
        self.probes: dict[int, RequestRecord] = {}
        self._last_view: ClusterView | None = None
        self._shards = _Shards(policy, [n.node_id for n in self.decode], router_shards) if router_shards > 1 else None

    def _push(self, time_s: float, kind: Kind, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time_s, kind, self._seq, payload))

    # ---- the view a policy decides on ------------------------------------------------------

    def view(self) -> ClusterView:
        """The cluster as the router would see it now (exact state).

        A node whose view has not changed since the last decision keeps its view object, as a router keeps a
        node's last report: the policy's index (``core.index``) then updates only the nodes that changed.
        """
        last = self._last_view
        prefill = tuple(map(_kept, last.prefill, (n.view() for n in self.prefill))) if last else None
        decode = tuple(map(_kept, last.decode, (n.view() for n in self.decode))) if last else None
        if prefill is None or decode is None:
            prefill, decode = tuple(n.view() for n in self.prefill), tuple(n.view() for n in self.decode)
        self._last_view = ClusterView(prefill, decode)
        return self._last_view

    def hits(self, job: Job) -> PrefixHits | None:
        """What each node's cache holds of the job's prompt; None without prefix identity."""
        if not job.block_hashes:
            return None
        hashes, prompt = job.block_hashes, job.prompt_tokens
        return PrefixHits({node_id: cache.cached_tokens(hashes, prompt) for node_id, cache in self._caches})

    # ---- event handlers -------------------------------------------------------------------

    def _arrive(self, job: Job) -> None:
        view, hits = self.view(), self.hits(job)
        if self._shards is None:
            decision = self.policy.decide(job.prompt_tokens, view, hits, job.priority, job.output_tokens)
        else:
            decision = self._shards.decide(self.policy, job, view, hits)
        job.decision = decision
        if decision.shed:
            self._num_shed += 1
            if self.probe_every and (self._num_shed - 1) % self.probe_every == 0:
                self._probe(job)
            return
        self._dispatch(job)

    def _dispatch(self, job: Job) -> None:
        """Send an admitted job where its decision says."""
        decision = job.decision
        assert decision is not None
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
        truth = self._prefill_truth[self._index[node.node_id]]
        duration = truth.step_s(0, context, chunk, context) * self.noise.next()
        node.busy_s += duration
        self._push(self.now + duration, Kind.PREFILL_STEP_END, node)

    def _end_prefill_step(self, node: PrefillNode) -> None:
        done = node.end_step(self.now)
        if done is not None:
            if self._protect:
                self._hand_off(done)
            else:
                self._send_kv(done)
        self._start_prefill_step(node)

    def _send_kv(self, job: Job) -> None:
        """The job's KV leaves its prefill node for its decode node, over that node's link."""
        tokens = self.decode[job.decode_node].expect(job)
        start = max(self.now, self._link_free_s[job.decode_node])
        link = self._decode_of[job.decode_node].hardware
        self._link_free_s[job.decode_node] = arrival = start + link.transfer_s(tokens)
        self._push(arrival, Kind.KV_ARRIVAL, job)

    # ---- decode-side protection: a KV waits on its prefill node for a decode node that can take it ----

    def _hand_off(self, job: Job) -> None:
        """Send a prefilled job's KV to its decode node if it can take it now, else let it wait (behind those
        waiting for that node)."""
        waiting = self._kv_waiting[job.decode_node]
        if waiting or not self._takes(job):
            waiting[job.request_id] = job
            self._push(self.now + self.policy.params.admission.kv_wait_max_s, Kind.KV_WAIT_END, job)
            return
        self._send(job)

    def _takes(self, job: Job) -> bool:
        """Whether the job's decode node can take its KV now: ``handoff_fits``, the hand-offs sent there and not in
        its batch yet counted; an idle node with none sent there always can (no batch to protect, no finish to come).
        """
        i = job.decode_node
        node = self.decode[i]
        if not (node.running or node.deflections or self._sent[i]):
            return True
        view = replace(
            node.view(),
            incoming_requests=self._sent[i],
            incoming_kv_tokens=self._sent_kv_tokens[i],
            incoming_prompt_tokens=self._sent_prompt_tokens[i],
        )
        cache = node.cache
        held = cache.cached_tokens(job.block_hashes, job.prompt_tokens) if cache and job.block_hashes else 0
        model, budget_s = self.policy.model_of(view), self.policy.params.tbt_budget_s
        return handoff_fits(model, view, job.prompt_tokens, budget_s, held, True, job.output_tokens)

    def _send(self, job: Job) -> None:
        self._count_sent(job.decode_node, job, 1)
        self._send_kv(job)

    def _count_sent(self, i: int, job: Job, sign: int) -> None:
        """Count ``job`` as sent to decode node ``i`` (1) or in its batch now (-1)."""
        self._sent[i] += sign
        self._sent_kv_tokens[i] += sign * (job.prompt_tokens + job.output_tokens)
        self._sent_prompt_tokens[i] += sign * job.prompt_tokens

    def _release_waiting(self, i: int) -> None:
        """Send the KV waiting for decode node ``i``, first come first served, while it can take the first."""
        waiting = self._kv_waiting[i]
        while waiting:
            job = next(iter(waiting.values()))
            if not self._takes(job):
                return
            del waiting[job.request_id]
            self._send(job)

    def _kv_wait_ends(self, job: Job) -> None:
        """A KV that waited ``kv_wait_max_s`` goes to its decode node, to wait in its queue instead."""
        if self._kv_waiting[job.decode_node].pop(job.request_id, None) is not None:
            self._send(job)

    def _kv_arrives(self, job: Job) -> None:
        node = self.decode[job.decode_node]
        node.transferred(job, self.now)
        if not node.busy:
            self._start_decode_step(node)

    def _start_decode_step(self, node: DecodeNode) -> None:
        step = node.begin_step(self.now)
        if self._protect and node.joined:
            i = self._index[node.node_id]
            for job in node.joined:
                self._count_sent(i, job, -1)
        if step is None:
            return
        truth = self._decode_of[self._index[node.node_id]].truth
        duration = truth.step_s(*step, node.prefix_tokens) * self.noise.next()
        self._push(self.now + duration, Kind.DECODE_STEP_END, (node, duration))

    def _end_decode_step(self, event: tuple[DecodeNode, float]) -> None:
        node, duration = event
        node.end_step(self.now, duration)
        if node.finished and self._protect:
            self._release_waiting(self._index[node.node_id])
        self._start_decode_step(node)

    # ---- what a shed request would have met ------------------------------------------------

    def _probe(self, job: Job) -> None:
        """Admit the shed ``job`` as decided in a copy of the simulation, run it to the job's last token, keep
        its record (``probes``): the ground truth of whether shedding it cost a request that met its objective."""
        branch, twin = copy.deepcopy((self, job))  # the job is in no queue yet: copied along, as the same job
        assert twin.decision is not None and twin.decision.admission is not None
        twin.decision = replace(twin.decision, admission=twin.decision.admission.overruled())
        branch.probe_every = 0
        branch._dispatch(twin)
        branch._loop(None, until=twin)
        self.probes[job.request_id] = branch._records([twin])[0]

    # ---- the run --------------------------------------------------------------------------

    def run(self, workload: Workload, progress: Callable[[int], None] | None = None) -> SimResult:
        """Simulate every request of ``workload`` to its last token."""
        if workload.has_prefix_identity:
            nodes: list[PrefillNode | DecodeNode] = [*self.prefill, *self.decode]
            for node in nodes:
                node.cache = BlockCache(workload.block_tokens)
                self._caches.append((node.node_id, node.cache))
        requests = [
            Job(i, r.arrival_s, r.prompt_tokens, r.output_tokens, r.priority, block_hashes=r.block_hashes)
            for i, r in enumerate(workload.requests)
        ]
        self._events = [(r.arrival_s, Kind.REQUEST_ARRIVAL, i, r) for i, r in enumerate(requests)]
        heapq.heapify(self._events)
        self._seq = len(requests)
        events = self._loop(progress)
        makespan = self.now
        busy_prefill = sum(n.busy_s for n in self.prefill) / (len(self.prefill) * makespan) if makespan else 0.0
        busy_decode = sum(n.busy_s for n in self.decode) / (len(self.decode) * makespan) if makespan else 0.0
        kept = self._shards.kept_share if self._shards is not None else None
        records = self._records(requests)
        return SimResult(records, requests, busy_prefill, busy_decode, events, makespan, self.probes, kept)

    def _loop(self, progress: Callable[[int], None] | None, until: Job | None = None) -> int:
        """Handle events until none is left, or ``until`` has finished; returns how many were handled."""
        handlers: dict[int, Callable[[object], None]] = {
            Kind.PREFILL_STEP_END: self._end_prefill_step,  # type: ignore[dict-item]
            Kind.DECODE_STEP_END: self._end_decode_step,  # type: ignore[dict-item]
            Kind.KV_ARRIVAL: self._kv_arrives,  # type: ignore[dict-item]
            Kind.KV_WAIT_END: self._kv_wait_ends,  # type: ignore[dict-item]
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
            if until is not None and until.finish_s == until.finish_s:  # not NaN: it has finished
                break
        return events

    def _records(self, requests: Sequence[Job]) -> list[RequestRecord]:
        durations = [np.asarray(n.durations) for n in self.decode]
        kv_bytes = [g.hardware.kv_bytes_per_token for g in self._decode_of]
        records = []
        for r in requests:
            decision = r.decision
            assert decision is not None
            if decision.shed:
                records.append(shed_record(r))
                continue
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
                    kv_transfer_bytes=(
                        0 if deflected else (r.prompt_tokens - r.handoff_cached_tokens) * kv_bytes[r.decode_node]
                    ),
                    priority=r.priority,
                )
            )
        return records


def shed_record(job: Job) -> RequestRecord:
    """The record of a request admission shed (``RequestRecord.of_shed``)."""
    assert job.decision is not None and job.decision.admission is not None
    reason = job.decision.admission.reason
    return RequestRecord.of_shed(
        job.request_id,
        job.arrival_s,
        job.prompt_tokens,
        job.output_tokens,
        job.priority,
        reason.value if reason else "",
    )
