"""Prefill and decode node models, shared by the simulator (virtual time) and the emulated engines (wall clock).

Both drivers call the same two state machines, step by step:
``begin_step(now)`` says what the next step computes (or that the node is
idle), the driver lets the step's time pass (a heap event, or a sleep), then
``end_step(now)`` applies its effects.

- ``PrefillNode``: FIFO queue; each step prefills up to the chunk size of the
  head job, its cached context growing; ``end_step`` returns the job whose
  prompt is done.
- ``DecodeNode``: continuous batching. A transferred job joins the batch at the
  next step start when a slot (``max_batch_size``) and KV room for its prompt
  and output are free, and yields its first token at the end of that step.
  Deflected jobs run their chunk schedules one after another, one chunk per
  step injected into the decode batch; the last chunk yields the first token
  and the job joins the batch. Every running job emits one token per step, so
  its TBT gaps are the durations of the node's steps it was in. An optional
  ``guard`` re-checks each planned chunk against the batch of the moment
  (``core.sweep.largest_safe_chunk``). A job bound for the node (``assign``:
  from the router's decision in the simulator, from its KV's arrival in an
  engine) counts in its view as incoming until it joins the batch. An
  optional ``join_guard`` (admission's decode-side protection,
  ``core.admission.join_guard``) lets a waiting hand-off join only while the
  step with it stays within beta * tau; the node's view reports how fast it
  finishes requests (``DecodeNodeView.finished_per_s``), the rate admission's
  estimate of a hand-off's KV wait drains at.

A step's time is the driver's to price (Eq. 4): a prefill node's chunk
attends over the head job's prefilled context (the first element of
``begin_step``'s answer, its prefix and the node's KV at once); a decode
node's chunk over its own job's earlier chunks, ``DecodeNode.prefix_tokens``.

Prefix caching: a node given a ``BlockCache`` (``core.prefix``) keeps the
blocks of the jobs that carry ``block_hashes``, as vLLM's prefix cache does,
within its KV capacity. A job takes its hit when it is queued or committed
(``PrefillNode.enqueue``, ``DecodeNode.deflect``) and its prompt is computed
from there: only the uncached suffix, each chunk priced from the context
already in KV. A deflected job's schedule is cut to that suffix (a cache-blind
policy planned the whole prompt; the engine runs its leading chunks). A
finished prefill leaves its prompt's blocks cached on the prefill node; a
decode node keeps a finished job's prompt and generated blocks. Before a
hand-off, ``DecodeNode.expect`` takes the blocks the decode node already
holds, so only the missing ones travel. Jobs without hashes (every trace
without prefix identity) touch no cache.

Per step the decode node does O(1) work plus O(log B) per job that joins or
finishes (plus O(blocks) for a job with prefix identity); it keeps no
per-token state, which is what lets the simulator replay long traces quickly.
Drivers that stream tokens keep their own set of running jobs from ``joined``
and ``finished``.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from kairos_ray.core import (
    BlockCache,
    BlockHash,
    Decision,
    DecodeNodeView,
    Guard,
    JoinGuard,
    PrefillNodeView,
    StepLatency,
)

FINISH_WINDOW = 32
"""Finishes a decode node measures its finishing rate over: a few seconds of a busy node, so it follows bursts."""


@dataclass(slots=True)
class FinishRate:
    """Requests a decode node finishes per second, over its last ``FINISH_WINDOW`` finishes (0 until two):
    ``DecodeNodeView.finished_per_s``, the rate admission's estimate of a hand-off's KV wait drains at."""

    times: deque[float] = field(default_factory=lambda: deque(maxlen=FINISH_WINDOW))

    def finished(self, now: float) -> None:
        self.times.append(now)

    @property
    def per_s(self) -> float:
        times = self.times
        span_s = times[-1] - times[0] if times else 0.0
        return (len(times) - 1) / span_s if span_s > 0 else 0.0


@dataclass(slots=True, eq=False)
class Job:
    """One request as the nodes see it; times are the driver's clock, in seconds."""

    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int  # tokens to generate, the first included
    priority: int = 0  # vLLM's request priority, lower is more important: admission sheds the least important first
    decision: Decision | None = None
    prefill_node: int = -1
    decode_node: int = -1
    schedule: tuple[int, ...] = ()  # chunk schedule when deflected
    next_chunk: int = 0  # index into schedule
    prefilled_tokens: int = 0  # prompt tokens its schedule's chunks have prefilled so far (deflected)
    prefill_start_s: float = math.nan
    prefill_end_s: float = math.nan
    kv_ready_s: float = math.nan
    first_token_s: float = math.nan
    finish_s: float = math.nan
    join_step: int = 0  # first decode-node step in which it emits a decode token
    last_step: int = 0  # decode-node step of its last token
    cancelled: bool = False  # its client went away: the node drops it at the end of the step in flight
    block_hashes: tuple[BlockHash, ...] = ()  # chained hashes of its full blocks: prompt, then generated tokens
    cached_tokens: int = 0  # prompt tokens the cache of the node that prefills it held (its first chunk's prefix)
    handoff_cached_tokens: int = 0  # prefill route: prompt tokens its decode node held, so not transferred
    pinned_blocks: int = 0  # leading block_hashes it holds in the cache of the node it is on


def covering(schedule: tuple[int, ...], tokens: int) -> tuple[int, ...]:
    """The chunks that compute ``tokens``: the schedule's leading ones, the last cut to fit, the rest dropped;
    a schedule short of ``tokens`` gets the remainder as one more chunk.

    A node with a prefix cache computes only the uncached suffix of a deflected prompt, step by step as planned.
    """
    if sum(schedule) == tokens:
        return schedule
    chunks: list[int] = []
    for chunk in schedule:
        if tokens <= 0:
            break
        chunks.append(min(chunk, tokens))
        tokens -= chunk
    if tokens > 0:
        chunks.append(tokens)
    return tuple(chunks)


def _take_hit(cache: BlockCache, job: Job) -> int:
    """Pin the job's cached prompt blocks in ``cache``; returns the prompt tokens they hold."""
    cached = cache.cached_tokens(job.block_hashes, job.prompt_tokens)
    job.pinned_blocks = cached // cache.block_tokens
    cache.pin(job.block_hashes[: job.pinned_blocks])
    return cached


def _hold_through(cache: BlockCache, job: Job, tokens: int) -> None:
    """The job's blocks up to ``tokens`` are computed: pin the ones it does not hold yet."""
    blocks = min(len(job.block_hashes), tokens // cache.block_tokens)
    if blocks > job.pinned_blocks:
        cache.pin(job.block_hashes[job.pinned_blocks : blocks])
        job.pinned_blocks = blocks


def _release(cache: BlockCache | None, job: Job) -> None:
    """The job lets go of every block it holds in ``cache`` (they stay cached, free, tail first)."""
    if cache is not None and job.pinned_blocks:
        cache.unpin(job.block_hashes[: job.pinned_blocks])
        job.pinned_blocks = 0


@dataclass(eq=False)
class PrefillNode:
    node_id: str
    chunk_tokens: int
    cache: BlockCache | None = None  # prefix cache of the node's KV (None: no prefix caching)
    kv_capacity_tokens: int = 0  # what the cache may fill, held blocks included
    queue: deque[Job] = field(default_factory=deque)
    done_tokens: int = 0  # of the head job, beyond its cache hit
    chunk: int = 0  # tokens of the step in flight
    busy: bool = False
    busy_s: float = 0.0
    num_cached: int = 0  # queued jobs with a cache hit (the view lists hits only when some are)
    model: StepLatency | None = None  # its own step-latency model, shown in its view (None: its pool's)

    def view(self) -> PrefillNodeView:
        queued = [j.prompt_tokens - j.cached_tokens for j in self.queue]
        if queued:
            queued[0] -= self.done_tokens
        cached = tuple(j.cached_tokens for j in self.queue) if self.num_cached else ()
        return PrefillNodeView(self.node_id, tuple(queued), self.done_tokens, cached, self.model)

    def enqueue(self, job: Job) -> None:
        """Queue a job at the tail; with a cache, it takes its hit now (the blocks stay until its prefill ends)."""
        if self.cache is not None and job.block_hashes:
            job.cached_tokens = _take_hit(self.cache, job)
            self.num_cached += job.cached_tokens > 0
        self.queue.append(job)

    def begin_step(self, now: float) -> tuple[int, int] | None:
        """(context in KV, chunk tokens) of the next step, or None (idle)."""
        if not self.queue:
            self.busy = False
            return None
        head = self.queue[0]
        if self.done_tokens == 0:
            head.prefill_start_s = now
        context = head.cached_tokens + self.done_tokens
        self.chunk = min(self.chunk_tokens, head.prompt_tokens - context)
        self.busy = True
        return context, self.chunk

    def cancel(self, job: Job) -> None:
        """Drop a queued job; the head, if a step of it is in flight, once that step ends."""
        if self.busy and self.queue and self.queue[0] is job:
            job.cancelled = True
        elif job in self.queue:
            self.queue.remove(job)
            self._leave(job)

    def end_step(self, now: float) -> Job | None:
        """Apply the step; returns the job whose prompt it finished, if any (not a cancelled one)."""
        self.done_tokens += self.chunk
        head = self.queue[0]
        if head.cancelled:
            self.queue.popleft()
            self.done_tokens = 0
            self._leave(head)
            return None
        if head.cached_tokens + self.done_tokens < head.prompt_tokens:
            return None
        self.queue.popleft()
        self.done_tokens = 0
        head.prefill_end_s = now
        if self.cache is not None and head.block_hashes:
            _hold_through(self.cache, head, head.prompt_tokens)
        self._leave(head)
        return head

    def _leave(self, job: Job) -> None:
        """A job leaves the queue: its blocks stay cached, free, within the node's KV."""
        self.num_cached -= job.cached_tokens > 0
        cache = self.cache
        if cache is not None and job.pinned_blocks:
            _release(cache, job)
            held = len(cache) - cache.free_blocks
            cache.trim(self.kv_capacity_tokens // cache.block_tokens - held)


@dataclass(eq=False)
class DecodeNode:
    node_id: str
    kv_capacity_tokens: int
    max_batch_size: int
    guard: Guard | None = None
    record_durations: bool = True  # the simulator needs every step's duration for TBT; a server does not
    cache: BlockCache | None = None  # prefix cache of the node's KV (None: no prefix caching)
    join_guard: JoinGuard | None = None  # admission on: a hand-off joins only while the step with it fits beta * tau
    model: StepLatency | None = None  # its own step-latency model, shown in its view (None: its pool's)
    running: int = 0
    kv_tokens: int = 0
    reserved_tokens: int = 0  # prompt + output of every admitted or deflected job not yet finished
    step: int = 0  # index of the next step to end
    chunk: int = 0  # deflected tokens in the step in flight
    prefix_tokens: int = 0  # their own prefix: the deflected job's tokens prefilled before this step (0: no chunk)
    busy: bool = False
    busy_s: float = 0.0
    finishing: list[tuple[int, int, Job]] = field(default_factory=list)  # heap of (last_step, request_id, job)
    cancelling: int = 0  # jobs cancelled while in the step in flight or the batch, dropped when it ends
    deflections: deque[Job] = field(default_factory=deque)
    waiting: deque[Job] = field(default_factory=deque)
    joined: list[Job] = field(default_factory=list)  # joined the batch in the last begin_step/end_step
    finished: list[Job] = field(default_factory=list)  # finished in the last end_step
    durations: list[float] = field(default_factory=list)  # every step's duration, index = step
    num_cached: int = 0  # committed deflections with a cache hit (the view lists hits only when some are)
    num_incoming: int = 0  # assigned jobs not in the batch yet (on their way or in ``waiting``)
    incoming_kv_tokens: int = 0  # the KV they will reserve when they join: prompt and output
    incoming_prompt_tokens: int = 0  # of that, their prompts (resident once they join)
    incoming_transfers: int = 0  # assigned jobs whose KV has not arrived yet
    incoming_transfer_tokens: int = 0  # the KV they send over the link: prompts less what their decisions saw held
    finish_rate: FinishRate = field(default_factory=FinishRate)

    @property
    def used_kv_tokens(self) -> int:
        """KV the node's jobs take: their reservations, blocks two of them hold counted once."""
        if self.cache is None:
            return self.reserved_tokens
        return self.reserved_tokens - self.cache.shared_blocks * self.cache.block_tokens

    def view(self) -> DecodeNodeView:
        committed = tuple(j.schedule[j.next_chunk :] for j in self.deflections)
        pending = sum(map(sum, committed))
        return DecodeNodeView(
            self.node_id,
            batch_size=self.running,
            kv_tokens=self.kv_tokens,
            # headroom = free - pending = capacity - reservations (see DecodeNodeView)
            free_kv_tokens=self.kv_capacity_tokens - self.used_kv_tokens + pending,
            committed=committed,
            head_prefilled_tokens=self.deflections[0].prefilled_tokens if self.deflections else 0,
            committed_cached_tokens=tuple(j.cached_tokens for j in self.deflections) if self.num_cached else (),
            incoming_requests=self.num_incoming,
            incoming_kv_tokens=self.incoming_kv_tokens,
            incoming_prompt_tokens=self.incoming_prompt_tokens,
            incoming_transfers=self.incoming_transfers,
            incoming_transfer_tokens=self.incoming_transfer_tokens,
            finished_per_s=self.finish_rate.per_s,
            model=self.model,
        )

    def deflect(self, job: Job) -> None:
        """Commit a deflected job; it runs after the deflections already here.

        With a cache, the job takes its hit now; its schedule is cut to the uncached suffix, or, planned for a hit
        the node no longer holds, gets the rest as one more chunk.
        """
        if self.cache is not None and job.block_hashes:
            job.cached_tokens = _take_hit(self.cache, job)
            self.num_cached += job.cached_tokens > 0
        job.schedule = covering(job.schedule, job.prompt_tokens - job.cached_tokens)  # also a hit it no longer has
        self.reserved_tokens += job.prompt_tokens + job.output_tokens
        self.deflections.append(job)
        self._fit_cache()

    def expect(self, job: Job) -> int:
        """A prefill node is about to send the job's KV here: take the blocks this node holds already
        (they need not travel, as vLLM's NIXL connector pulls only the blocks a decode node lacks);
        returns the prompt tokens that must travel."""
        if self.cache is not None and job.block_hashes:
            job.handoff_cached_tokens = _take_hit(self.cache, job)
        return job.prompt_tokens - job.handoff_cached_tokens

    def assign(self, job: Job) -> None:
        """A disaggregated job is bound for this node: it counts as incoming until it joins the batch, and as a
        transfer on the node's link until its KV arrives."""
        self._count_incoming(job, 1)
        self._count_transfer(job, 1)

    def transferred(self, job: Job, now: float) -> None:
        """An assigned job's KV has arrived; it joins the batch at a step start."""
        job.kv_ready_s = now
        self._count_transfer(job, -1)
        self.waiting.append(job)

    def _count_transfer(self, job: Job, sign: int) -> None:
        held = job.decision.receiver_cached_tokens if job.decision is not None else 0
        self.incoming_transfers += sign
        self.incoming_transfer_tokens += sign * (job.prompt_tokens - held)

    def _count_incoming(self, job: Job, sign: int) -> None:
        self.num_incoming += sign
        self.incoming_kv_tokens += sign * (job.prompt_tokens + job.output_tokens)
        self.incoming_prompt_tokens += sign * job.prompt_tokens

    def cancel(self, job: Job) -> None:
        """Drop a job: at once while it waits, at the end of the step in flight once it prefills or decodes."""
        if job in self.waiting:
            self.waiting.remove(job)
            self._count_incoming(job, -1)
            _release(self.cache, job)
        elif job in self.deflections and not (self.busy and self.deflections[0] is job):
            self.deflections.remove(job)
            self._drop_deflection(job)
        elif not job.cancelled and job.finish_s != job.finish_s:  # not finished yet (finish_s is NaN)
            job.cancelled = True
            self.cancelling += 1

    def _drop_cancelled(self) -> None:
        """End-of-step: remove cancelled jobs from the deflection head and the batch, freeing their KV."""
        self.cancelling = 0
        if self.deflections and self.deflections[0].cancelled:
            self._drop_deflection(self.deflections.popleft())
        dropped = [entry for entry in self.finishing if entry[2].cancelled]
        if not dropped:
            return
        self.finishing = [entry for entry in self.finishing if not entry[2].cancelled]
        heapq.heapify(self.finishing)
        for _, _, job in dropped:
            self.running -= 1
            self.kv_tokens -= job.prompt_tokens + max(0, self.step - job.join_step)
            self.reserved_tokens -= job.prompt_tokens + job.output_tokens
            _release(self.cache, job)
        self._fit_cache()

    def _drop_deflection(self, job: Job) -> None:
        """A deflected job leaves before its prefill ended: its KV so far (its hit once a chunk ran) and its
        reservation go."""
        self.kv_tokens -= job.prefilled_tokens + (job.cached_tokens if job.prefilled_tokens else 0)
        self.reserved_tokens -= job.prompt_tokens + job.output_tokens
        self.num_cached -= job.cached_tokens > 0
        _release(self.cache, job)
        self._fit_cache()

    def _fit_cache(self) -> None:
        """Evict free cached blocks beyond the KV the node's jobs leave."""
        cache = self.cache
        if cache is not None and cache.free_blocks:
            cache.trim((self.kv_capacity_tokens - self.used_kv_tokens) // cache.block_tokens)

    def begin_step(self, now: float) -> tuple[int, int, int] | None:
        """Admit waiting jobs; (B, K, chunk) of the next step, or None (idle); sets ``prefix_tokens``."""
        step = self.step
        joined = self.joined
        joined.clear()
        while self.waiting and self.running < self.max_batch_size:
            job = self.waiting[0]
            need = job.prompt_tokens + job.output_tokens
            if self.used_kv_tokens + need > self.kv_capacity_tokens and self.running:
                break  # wait for KV to free up (an idle node always takes it: nothing else will free KV)
            if self.join_guard is not None and self.running and not self._may_join(job):
                break  # wait for the batch to shrink: its steps would overrun beta * tau
            self.waiting.popleft()
            self._count_incoming(job, -1)
            self.reserved_tokens += need
            self.running += 1
            self.kv_tokens += job.prompt_tokens
            if self.cache is not None and job.block_hashes:
                _hold_through(self.cache, job, job.prompt_tokens)  # the prompt's KV has arrived
                self._fit_cache()
            job.join_step = step
            job.last_step = step + job.output_tokens - 1
            heapq.heappush(self.finishing, (job.last_step, job.request_id, job))
            joined.append(job)
        self.chunk = self.prefix_tokens = 0
        if self.deflections:
            head = self.deflections[0]
            if head.next_chunk == 0:
                head.prefill_start_s = now
            planned = head.schedule[head.next_chunk]
            prefix = head.cached_tokens + head.prefilled_tokens
            # its cached prefix joins the resident KV with its first chunk
            kv_tokens = self.kv_tokens if head.prefilled_tokens else self.kv_tokens + head.cached_tokens
            self.chunk = planned if self.guard is None else self.guard(self.running, kv_tokens, planned, prefix)
            self.prefix_tokens = prefix if self.chunk else 0
            if 0 < self.chunk < planned:
                i = head.next_chunk
                head.schedule = (*head.schedule[:i], self.chunk, planned - self.chunk, *head.schedule[i + 1 :])
            if self.chunk:
                self.busy = True
                return self.running, kv_tokens, self.chunk
        if not self.running:
            self.busy = False
            return None
        self.busy = True
        return self.running, self.kv_tokens, self.chunk

    def _may_join(self, job: Job) -> bool:
        """``join_guard`` on the step the job would join: the batch, and the chunk the head deflection plans next."""
        assert self.join_guard is not None
        chunk = prefix = extra = 0
        if self.deflections:
            head = self.deflections[0]
            chunk, prefix = head.schedule[head.next_chunk], head.cached_tokens + head.prefilled_tokens
            extra = 0 if head.prefilled_tokens else head.cached_tokens  # its cached prefix joins with its first chunk
        return self.join_guard(self.running, self.kv_tokens + extra, job.prompt_tokens, chunk, prefix)

    def end_step(self, now: float, duration_s: float) -> None:
        """Apply the step: tokens for every running job, the chunk's KV; fills ``joined`` and ``finished``."""
        step = self.step
        if self.record_durations:
            self.durations.append(duration_s)
        self.busy_s += duration_s
        self.kv_tokens += self.running  # every running job wrote one token
        for job in self.joined:  # joined at this step's start: its first token
            job.first_token_s = now
        joined = self.joined
        joined.clear()
        finished = self.finished
        finished.clear()
        if self.deflections and self.chunk:
            head = self.deflections[0]
            if not head.prefilled_tokens:
                self.kv_tokens += head.cached_tokens
            head.next_chunk += 1
            head.prefilled_tokens += self.chunk
            self.kv_tokens += self.chunk
            if head.next_chunk == len(head.schedule):
                self.deflections.popleft()
                if self.cache is not None and head.block_hashes:
                    self.num_cached -= head.cached_tokens > 0
                    _hold_through(self.cache, head, head.prompt_tokens)
                head.prefill_end_s = head.first_token_s = now
                head.join_step = step + 1
                head.last_step = step + head.output_tokens - 1
                if head.output_tokens > 1:
                    self.running += 1
                    heapq.heappush(self.finishing, (head.last_step, head.request_id, head))
                    joined.append(head)
                else:
                    self._finish(head, now)
        heap = self.finishing
        while heap and heap[0][0] == step:
            self._finish(heapq.heappop(heap)[2], now)
            self.running -= 1
        self.step += 1
        if self.cancelling:
            self._drop_cancelled()

    def _finish(self, job: Job, now: float) -> None:
        job.finish_s = now
        self.finish_rate.finished(now)
        self.kv_tokens -= job.prompt_tokens + max(0, job.last_step - job.join_step + 1)
        self.reserved_tokens -= job.prompt_tokens + job.output_tokens
        self.finished.append(job)
        if self.cache is not None and job.block_hashes:
            # the KV of all its tokens but the last generated one stays cached: its prompt and its answer
            _hold_through(self.cache, job, job.prompt_tokens + job.output_tokens - 1)
            _release(self.cache, job)
            self._fit_cache()
