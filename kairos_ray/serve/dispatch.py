"""One request's path through the pools, from the routing decision to its last token, over failures.

``RequestRun.start`` asks the router (``decision_timeout_s``; if it cannot
decide, plain disaggregation on any nodes, counted), then runs the route:

- ``deflect``: the chosen decode node prefills the prompt in place per the
  chunk schedule and streams;
- ``prefill``: the prefill node prefills and returns a ``KVHandoff``; the
  decode node receives the KV and streams; once its first token is here the
  prefill node is told to release the KV.

Failures (the failure model of ``docs/failures.md``):

- before the first token, a node that fails (its replica or engine died, its
  engine stalled, the hand-off broke) is avoided and the request re-decided
  on the others and run again, at most ``max_attempts`` tries in all; the
  whole wait for the first token is bounded by ``first_token_timeout_s``;
- after it, a decode node that fails, or sends no token for
  ``token_stall_timeout_s``, is left for another: the prompt plus the tokens
  already sent are prefilled there (deflected or handed off, as the router
  decides) and the stream goes on, at most ``max_migrations`` times, when
  the request's sampling carries over exactly (``migration_blocker``);
- what cannot be served ends with ``RequestFailed`` (503, or 504 past the
  first-token deadline) before the first token, ``StreamBroken`` after it;
- ``close`` cancels whatever is still in flight on the engines (which abort
  the request) and releases a hand-off's KV, whichever way the request ends.

What the engines did not time (routing, RPCs, queues in the serving path)
counts as waiting before the prefill starts, so the breakdown adds up to the
TTFT seen here.

Prefix identity: each decision request carries the prompt's chained block
hashes (``core.prefix.block_ids``, as vLLM's KV events name blocks) for each
block size the router's last reply named, hashed here rather than in the
single router replica. Prompts without token ids (text prompts to emulated
engines), salted ones (``cache_salt``, which vLLM hashes in as an extra
key) and those whose engines read no cache (prompt logprobs) carry none: the
router prices them cache-blind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray.serve.handle import DeploymentHandle

from kairos_ray.core import Admission, Route, block_ids
from kairos_ray.core.shards import shard_for
from kairos_ray.engines import without_prompt_logprobs
from kairos_ray.messages import DecisionRequest, EngineRequest, KVHandoff, RoutingReply, TokenEvent, TTFTBreakdown
from kairos_ray.serve.delivery import NodeGroups, apart
from kairos_ray.serve.metrics import IngressMetrics
from kairos_ray.serve.mux import RequestKey, StreamFailed, TokenMux
from kairos_ray.serve.router_link import RouterLink

if TYPE_CHECKING:
    from vllm import SamplingParams

logger = logging.getLogger("ray.serve")

PROMPTS_HASHED_KEPT = 8  # latest prompts whose block hashes a dispatcher keeps (a request's samples share them)


@dataclass(frozen=True, slots=True)
class RouteTaken:
    """The route a request took, as its response reports it (``x-kairos-*`` headers and the ``kairos`` field)."""

    request_id: int
    route: Route
    prefill_node: str | None  # where the prefill ran (None when deflected)
    decode_node: str  # the decode node that streams the tokens
    chunk_schedule: tuple[int, ...]  # deflected: X*; empty otherwise
    kv_transport: str  # how the KV travelled ("" when deflected)
    reason: str  # the router's reason, or why it fell back
    fallback: bool  # the router could not decide
    ttft_s: float  # at the ingress
    breakdown: TTFTBreakdown  # adds up to ttft_s
    attempts: int = 1  # tries it took to the first token
    cached_tokens: int = 0  # prompt tokens the prefilling node's prefix cache held (not computed)
    kv_bytes: int = 0  # bytes of KV the hand-off carried (0 when deflected or moved by another vLLM connector)


@dataclass(frozen=True, slots=True)
class ServingLimits:
    """The deadlines and retry bounds of a request (from the app's ``serving`` section)."""

    decision_timeout_s: float
    first_token_timeout_s: float
    token_stall_timeout_s: float
    max_attempts: int
    max_migrations: int


def migration_blocker(sampling: SamplingParams | None) -> str:
    """What keeps a request from continuing exactly on another decode node ("" when nothing does).

    A migration is a new request whose prompt is the original prompt plus the
    tokens already sent. Per-token rules carry over as they are (temperature,
    top-k/p, min-p, logit bias, allowed tokens, stop token ids, logprobs; the
    repetition penalty, which vLLM applies over prompt and output alike);
    ``max_tokens`` and ``min_tokens`` shrink by the tokens sent. What depends
    on the output's history cannot be handed over through vLLM's API, so such
    a request is not migrated: its stream ends with an error rather than go on
    differently from an undisturbed run.
    """
    if sampling is None:
        return ""
    blockers = (
        (sampling.seed is not None and sampling.temperature > 0, "a seed (its random generator would restart)"),
        (bool(sampling.presence_penalty or sampling.frequency_penalty), "presence/frequency penalties"),
        (bool(sampling.stop), "stop strings (held-back text and a match across the cut)"),
        (bool(sampling.bad_words), "bad words (a match across the cut)"),
        (sampling.structured_outputs is not None, "structured output (its grammar's state)"),
        (sampling.repetition_detection is not None, "repetition detection (its history)"),
    )
    return next((reason for blocked, reason in blockers if blocked), "")


class RequestFailed(Exception):
    """No first token: answer ``status`` (503: nodes failed; 504: past the deadline) with ``message``.

    ``detail`` says what failed (nodes, remote errors) for the log; clients see ``message`` only.
    """

    def __init__(self, status: int, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.detail = status, message, detail


class StreamBroken(Exception):
    """After the first token the request could not go on (migrations used up): end the stream with an error.

    Clients see ``message``; ``detail`` (what failed, remote errors) goes to the log.
    """

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.message, self.detail = message, detail


class Shed(RequestFailed):
    """Admission shed the request (``core.admission``): 429 at once, with when to come back (``retry_after_s``)."""

    def __init__(self, admission: Admission) -> None:
        self.retry_after_s = max(1, math.ceil(admission.retry_after_s))  # Retry-After takes whole seconds
        self.reason = admission.reason.value if admission.reason else ""
        super().__init__(
            429,
            f"the service cannot serve this request within its time-to-first-token objective now; "
            f"retry after {self.retry_after_s} s",
            f"{self.reason}: estimated TTFT {admission.ttft_estimate_s:.3f} s, admitted up to "
            f"{admission.threshold_s:.3f} s",
        )


class _NodeFailed(Exception):
    """A node failed this attempt; ``node`` (if known) is avoided from now on."""

    def __init__(self, node: str | None, cause: BaseException) -> None:
        super().__init__(f"{node or 'a node'}: {type(cause).__name__}: {cause}")
        self.node, self.cause = node, cause


class DecisionBatcher:
    """Asks the router for the decisions wanted in one event-loop tick in at most two calls
    (``RouterActor.decide_many``).

    It never waits to batch: the first decision a tick wants goes at once, and
    the others that tick wants go together at its end. A call not answered
    within ``timeout_s`` fails its callers (who have given up on it by then in
    any case).
    """

    def __init__(self, router: RouterLink, timeout_s: float) -> None:
        self.router = router
        self.timeout_s = timeout_s
        self._ticking = False  # a decision went this tick: the tick's others wait for its end
        self.waiting: list[tuple[DecisionRequest, asyncio.Future[RoutingReply]]] = []  # for this tick's end

    async def decide(self, request: DecisionRequest) -> RoutingReply:
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[RoutingReply] = loop.create_future()
        if self._ticking:
            self.waiting.append((request, reply))
        else:
            self._ticking = True
            loop.call_soon(self._tick_over)
            self._send([(request, reply)])
        return await reply

    def _tick_over(self) -> None:
        self._ticking = False
        wanted, self.waiting = self.waiting, []
        if wanted:
            self._send(wanted)

    def _send(self, wanted: list[tuple[DecisionRequest, asyncio.Future[RoutingReply]]]) -> None:
        answered = functools.partial(self._answer, wanted)
        self.router.decide_then([request for request, _ in wanted], answered, self.timeout_s)

    @staticmethod
    def _answer(
        wanted: list[tuple[DecisionRequest, asyncio.Future[RoutingReply]]],
        replies: list[RoutingReply] | None,
        failure: BaseException | None,
    ) -> None:
        for i, (_, reply) in enumerate(wanted):
            if reply.done():  # a caller whose deadline passed has gone
                continue
            if failure is not None:  # each caller gets the failure and falls back
                reply.set_exception(failure)
            else:
                assert replies is not None, "a call that did not fail has its replies"
                reply.set_result(replies[i])


SHARD_DOWN_S = 5.0  # a router shard that failed a decision is asked nothing for this long (its nodes go to others)


class RouterShards:
    """An ingress replica's router shards (``core.shards``): a ``DecisionBatcher`` per shard, the requests sent to
    the live shards in turn, each naming the shards it deems live.

    A shard that fails a decision (dead: its link fails at once; hung: the
    decision's deadline passes; new: it answers with a fallback, as a router
    does until every node has reported to it) is left out for ``SHARD_DOWN_S``: the next
    requests go to the others, which take over its decode nodes because the
    requests name it no more, and a request that has time left is asked
    again of another shard at once. After that it is asked again (Serve has
    replaced a dead one by then, or will). With one shard this is a batcher.
    """

    def __init__(
        self,
        routers: Sequence[DeploymentHandle[Any]],
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        left_out: Callable[[int], None] = lambda shard: None,
    ) -> None:
        """``left_out(shard)`` runs each time a shard is left out (the ingress counts it, per shard)."""
        if not routers:
            raise ValueError("an app has at least one router shard")
        self.batchers = [DecisionBatcher(RouterLink(router), timeout_s) for router in routers]
        self.clock, self.left_out = clock, left_out
        self._down_until = [0.0] * len(routers)  # monotonic time until which each shard is left out
        self._sequence = 0

    def prefetch(self) -> None:
        for batcher in self.batchers:
            batcher.router.prefetch()

    def live(self) -> tuple[int, ...]:
        """The shards asked now (every one, when all failed lately: one of them may be back)."""
        now = self.clock()
        up = tuple(shard for shard, until in enumerate(self._down_until) if until <= now)
        return up or tuple(range(len(self.batchers)))

    async def decide(self, request: DecisionRequest, timeout_s: float) -> RoutingReply:
        """The reply of the shard whose turn it is, within ``timeout_s``; of another live one if that shard fails
        (a shard with another after it gets half the time left). Raises what the last one failed with (a
        ``TimeoutError`` at the deadline) when none is left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        sharded = len(self.batchers) > 1
        live = self.live()
        shard = shard_for(self._sequence, live)
        self._sequence += 1
        while True:
            others = [s for s in live if s != shard]
            left = deadline - loop.time()
            try:
                async with asyncio.timeout(left / 2 if others else left):  # no task of its own, as wait_for makes
                    reply = await self.batchers[shard].decide(
                        dataclasses.replace(request, shards=live if sharded else ())
                    )
                if reply.fallback and others:  # a shard just started: not every node has reported to it yet
                    raise LookupError(f"router shard {shard} cannot decide yet: {reply.decision.reason}")
                return reply
            except Exception:  # dead (its link fails) or hung (its time passed); a caller that left is not one
                if sharded:  # one router has no other to leave its requests to
                    self._down_until[shard] = self.clock() + SHARD_DOWN_S
                    self.left_out(shard)
                if not others:
                    raise
                live, shard = tuple(others), others[0]

    def waiting(self) -> int:
        """Decisions waiting for their tick's batch, over the shards (all 0 once idle)."""
        return sum(len(batcher.waiting) for batcher in self.batchers)


class Dispatcher:
    """Runs requests over the router and the two pools (calls go to their node's group and name their node:
    ``serve.delivery``)."""

    def __init__(
        self,
        routers: Sequence[DeploymentHandle[Any]],
        prefill: NodeGroups,
        decode: NodeGroups,
        limits: ServingLimits,
        metrics: IngressMetrics,
        listener: str,
    ) -> None:
        self.prefill, self.decode = prefill, decode
        self.mux = TokenMux(decode, listener)  # tokens arrive over one subscription per decode node
        failovers = metrics.shard_failovers
        self.decisions = RouterShards(
            routers, limits.decision_timeout_s, left_out=lambda shard: failovers.inc(tags={"shard": str(shard)})
        )
        self.decisions.prefetch()  # the replica is starting: its first decision finds the handles and the lines
        self.limits = limits
        self.metrics = metrics
        self.block_tokens: tuple[int, ...] = ()  # block sizes of the nodes' prefix caches, as the router last said
        # id(prompt) -> (that prompt, block sizes, its hashes): the last few prompts hashed, so that a prompt's
        # samples and a request's retries hash it once (they share its token-id tuple)
        self._hashed: OrderedDict[int, tuple[tuple[int, ...], tuple[int, ...], dict[int, tuple[int, ...]]]] = (
            OrderedDict()
        )

    def run(self, request: EngineRequest) -> RequestRun:
        return RequestRun(self, request)

    def residue(self) -> dict[str, int]:
        """Per-request entries of the mux and the decision batcher (``messages.Residue``): all 0 once idle."""
        return {**self.mux.residue(), "decisions_waiting": self.decisions.waiting()}

    def block_ids(self, request: EngineRequest) -> dict[int, tuple[int, ...]]:
        """The prompt's block hashes per block size the nodes cache with (empty: no prefix identity); hashed
        once for the ``PROMPTS_HASHED_KEPT`` latest prompts (about 8 ms for 30,000 tokens in 16-token blocks)."""
        ids = request.prompt_token_ids
        if (
            not ids
            or request.cache_salt is not None
            or (request.sampling and request.sampling.skip_reading_prefix_cache)
        ):
            return {}
        kept = self._hashed.get(id(ids))
        if kept is not None and kept[0] is ids and kept[1] == self.block_tokens:
            self._hashed.move_to_end(id(ids))
            return kept[2]
        hashes = {size: block_ids(ids, size) for size in self.block_tokens}
        self._hashed[id(ids)] = (ids, self.block_tokens, hashes)
        self._hashed.move_to_end(id(ids))
        while len(self._hashed) > PROMPTS_HASHED_KEPT:
            self._hashed.popitem(last=False)
        return hashes

    async def decide(
        self, request: EngineRequest, avoid: tuple[str, ...], sheddable: bool = True, held_on: str = ""
    ) -> RoutingReply:
        """The router's reply for ``request`` on the nodes not in ``avoid`` (a fallback when it cannot answer);
        ``sheddable``: whether admission may shed it (only a request's first try); ``held_on``: a decode node
        known to hold the prompt's KV (``DecisionRequest.held_on``)."""
        wanted = DecisionRequest(
            request.request_id,
            request.prompt_tokens,
            request.max_tokens,
            avoid,
            self.block_ids(request),
            request.priority,
            sheddable,
            held_on,
        )
        asked = time.perf_counter()
        try:
            reply = await self.decisions.decide(wanted, self.limits.decision_timeout_s)
            self.metrics.router_calls.observe(time.perf_counter() - asked, tags={})
            if not reply.fallback:
                self.block_tokens = reply.block_tokens
        except Exception as exc:  # whatever keeps the router from answering: disaggregate, counted
            logger.warning("router could not decide (%s: %s); disaggregating", type(exc).__name__, exc)
            reply = RoutingReply.fallback_for(type(exc).__name__)
        if reply.fallback:  # the router's own fallbacks (a pool that has not reported yet) count too
            self.metrics.fallbacks.inc(tags={"route": Route.PREFILL.value, "reason": "fallback"})
        return reply


class RequestRun:
    """One request from its routing decision to its last token."""

    def __init__(self, dispatcher: Dispatcher, request: EngineRequest) -> None:
        self.dispatcher, self.request = dispatcher, request
        self.limits = dispatcher.limits
        self.route: RouteTaken | None = None
        self.attempts = 0
        self.migrations = 0
        self.sent: list[int] = []  # token ids the client has been sent
        self._avoid: list[str] = []  # nodes that failed this request
        self._calls: list[Any] = []  # remote calls of the current attempt, cancelled on close
        self._queue: asyncio.Queue[list[TokenEvent] | StreamFailed] | None = None  # its tokens (serve.mux)
        self._running: RequestKey | None = None  # the attempt running on ``_decode_node``, cancelled on close
        self._listening: RequestKey | None = None  # the attempt whose tokens the mux keeps for it, closed on close
        self._first: list[TokenEvent] | None = None  # a migration's first tokens, not yet given out
        self._done = False  # the last token has come
        self._decode_node: str | None = None
        self._held: KVHandoff | None = None  # a hand-off whose KV the prefill node still holds

    # ---- before the first token ----------------------------------------------------------------

    async def start(self, held_on: str = "") -> list[TokenEvent]:
        """Run the request to its first token (with whatever came with it), retrying on failed nodes; its first
        try tells the router that decode node ``held_on`` holds its prompt's KV, if one is known.

        Raises ``RequestFailed``.
        """
        limits = self.limits
        failure: _NodeFailed | None = None
        try:
            async with asyncio.timeout(limits.first_token_timeout_s):
                while self.attempts < limits.max_attempts:
                    try:
                        first = await self._attempt(self.request, held_on)
                        self.sent += [event.token_id for event in first]
                        return first
                    except _NodeFailed as failed:
                        failure = failed
                        self._abandon(failed)
                        self.dispatcher.metrics.retries.inc(tags={"stage": "before_first_token"})
        except TimeoutError:
            self.dispatcher.metrics.deadlines.inc(tags={"deadline": "first_token"})
            self.close()
            raise RequestFailed(
                504, f"no first token within {limits.first_token_timeout_s:g} s (first_token_timeout_s)"
            ) from None
        raise RequestFailed(503, f"the request failed on {self.attempts} tries", f"last: {failure}")

    async def _attempt(self, request: EngineRequest, held_on: str = "") -> list[TokenEvent]:
        """One try: decide, run the route, wait for the first tokens; raises ``_NodeFailed``. ``held_on`` goes
        to the router on the request's first try only (``Dispatcher.decide``)."""
        request = dataclasses.replace(request, attempt=self.attempts)
        self.attempts += 1
        first_try = self.attempts == 1
        reply = await self.dispatcher.decide(request, tuple(self._avoid), first_try, held_on if first_try else "")
        decision = reply.decision
        if decision.shed:  # nothing taken yet: answered at once
            assert decision.admission is not None
            raise Shed(decision.admission)
        avoid = tuple(self._avoid)
        pools = self.dispatcher
        handoff = None
        request = dataclasses.replace(request, decode_model=reply.decode_model)
        if decision.route is Route.DEFLECT:
            request = dataclasses.replace(request, chunk_schedule=decision.chunk_schedule)
        else:
            request = dataclasses.replace(
                request,
                kv_receiver=decision.decode_node or "",
                kv_receiver_cached_tokens=decision.receiver_cached_tokens,
            )
            call = apart(
                pools.prefill.of(decision.prefill_node).prefill.remote, request, node=decision.prefill_node, avoid=avoid
            )
            self._calls = [call]
            try:
                handoff = await call
            except (asyncio.CancelledError, TimeoutError):
                raise
            except Exception as exc:
                raise _NodeFailed(decision.prefill_node, exc) from exc
            self._held = handoff
        self._decode_node = decision.decode_node
        key = (request.request_id, request.attempt)
        mux = pools.mux
        mux.expect(key)
        self._running = self._listening = key
        start = pools.decode.of(decision.decode_node).start.remote
        call = apart(start, request, handoff, mux.listener, node=decision.decode_node, avoid=avoid)
        self._calls.append(call)
        try:
            node: str = await call
            self._decode_node = node
            self._queue = mux.open(key, node)
            first = await self._next()
        except (asyncio.CancelledError, TimeoutError):
            raise
        except Exception as exc:
            raise _NodeFailed(self._decode_node, exc) from exc
        self._release_kv()
        if self.route is None:  # the route the response reports: the first one that streamed
            self.route = self._taken(request, reply, handoff, first[0])
        return first

    def _taken(
        self, request: EngineRequest, reply: RoutingReply, handoff: KVHandoff | None, first: TokenEvent
    ) -> RouteTaken:
        decision = reply.decision
        ttft_s = time.time() - request.arrival_wall_s
        timed = first.breakdown or TTFTBreakdown()
        breakdown = dataclasses.replace(timed, prefill_queue_s=timed.prefill_queue_s + max(0.0, ttft_s - timed.total_s))
        self.dispatcher.metrics.ttft.observe(ttft_s, tags={"route": decision.route.value})
        return RouteTaken(
            request_id=request.request_id,
            route=decision.route,
            prefill_node=handoff.node_id if handoff else None,  # where it ran
            decode_node=first.node_id,
            chunk_schedule=decision.chunk_schedule,
            kv_transport=handoff.transport if handoff else "",
            reason=decision.reason,
            fallback=reply.fallback,
            ttft_s=ttft_s,
            breakdown=breakdown,
            attempts=self.attempts,
            cached_tokens=handoff.cached_tokens if handoff else first.cached_tokens,
            kv_bytes=handoff.kv_bytes if handoff else 0,
        )

    def _abandon(self, failed: _NodeFailed) -> None:
        """Give up the current attempt: cancel its calls, free its KV, avoid the node that failed."""
        logger.warning("request %s: %s; trying again elsewhere", self.request.request_id, failed)
        self.close()
        if failed.node is not None and failed.node not in self._avoid:
            self._avoid.append(failed.node)

    # ---- after the first token -------------------------------------------------------------------

    async def _next(self) -> list[TokenEvent]:
        """The next tokens of the running attempt; raises ``StreamFailed``."""
        assert self._queue is not None
        item = await self._queue.get()
        if isinstance(item, StreamFailed):
            raise item
        self._done = item[-1].finished
        return item

    async def rest(self) -> AsyncIterator[list[TokenEvent]]:
        """The tokens after the first ones, as they come; migrates on decode failure or stall.

        Raises ``StreamBroken``.
        """
        stall_s = self.limits.token_stall_timeout_s
        while True:
            ready, self._first = self._first, None
            if ready is None and self._done:
                self._running = None  # done on its node: nothing to cancel there
                return
            if ready is None:
                try:
                    async with asyncio.timeout(stall_s):  # a timer per wait, not a task per token
                        ready = await self._next()
                except asyncio.CancelledError:
                    raise
                except (StreamFailed, TimeoutError) as exc:
                    await self._migrate(f"no token for {stall_s:g} s" if isinstance(exc, TimeoutError) else str(exc))
                    continue
            self.sent += [event.token_id for event in ready]
            yield ready
            if ready[-1].finished:
                self._running = None  # done on its node: nothing to cancel there
                return

    async def _migrate(self, cause: str) -> None:
        """Continue on another decode node from the prompt plus the tokens sent; raises ``StreamBroken``."""
        failed = self._decode_node
        self.close()
        if failed is not None and failed not in self._avoid:
            self._avoid.append(failed)
        blocker = migration_blocker(self.request.sampling)
        if blocker:
            raise StreamBroken(f"its decode node failed; not migrated: {blocker}", cause)
        while self.migrations < self.limits.max_migrations:
            self.migrations += 1
            self.dispatcher.metrics.retries.inc(tags={"stage": "migration"})
            logger.warning(
                "request %s: decode node %s failed after %d tokens (%s); migrating",
                self.request.request_id, failed, len(self.sent), cause,
            )  # fmt: skip
            try:
                async with asyncio.timeout(self.limits.first_token_timeout_s):
                    first = await self._attempt(self._continuation())
            except (_NodeFailed, TimeoutError) as exc:
                self.close()
                failed, cause = getattr(exc, "node", None), type(exc).__name__
                if failed is not None and failed not in self._avoid:
                    self._avoid.append(failed)
                continue
            self._first = first
            return
        raise StreamBroken(f"its decode nodes failed, {self.migrations} migrations", cause)

    def _continuation(self) -> EngineRequest:
        """The request as a new prompt: the original prompt plus the tokens already sent, ``min_tokens`` shrunk,
        no prompt logprobs (the first run's were sent)."""
        original = self.request
        done = len(self.sent)
        ids = original.prompt_token_ids + tuple(self.sent) if original.prompt_token_ids else ()
        sampling = without_prompt_logprobs(original.sampling)
        if sampling is not None and sampling.min_tokens:
            sampling = sampling.clone()
            sampling.min_tokens = max(0, sampling.min_tokens - done)
        return dataclasses.replace(
            original,
            prompt_tokens=original.prompt_tokens + done,
            prompt_token_ids=ids,
            max_tokens=original.max_tokens - done,
            output_offset=original.output_offset + done,
            sampling=sampling,
        )

    # ---- however it ends -------------------------------------------------------------------------

    def _release_kv(self) -> None:
        """The decode node has the KV (or will never take it): the prefill node may free it."""
        if self._held is not None:
            node = self._held.node_id
            apart(self.dispatcher.prefill.of(node).release.remote, self.request.request_id, node=node)
            self._held = None

    def close(self) -> None:
        """Cancel what is in flight on the engines and release a held hand-off; idempotent."""
        for call in self._calls:
            call.cancel()
        self._calls = []
        if self._running is not None:
            request_id, attempt = self._running
            cancel = self.dispatcher.decode.of(self._decode_node).cancel.remote
            apart(cancel, request_id, attempt, node=self._decode_node)
            self._running = None
        if self._listening is not None:  # ended or not on its node, the mux forgets it here
            self.dispatcher.mux.close(self._listening)
            self._listening = None
        self._queue = None
        self._release_kv()
