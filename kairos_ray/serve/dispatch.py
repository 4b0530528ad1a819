"""One request's path through the pools, from the routing decision to its first token.

``Dispatcher.start`` asks the router (``decision_timeout_s``; if it cannot
decide, plain disaggregation on any nodes, counted), then runs the route:

- ``deflect``: the chosen decode node prefills the prompt in place per the
  chunk schedule and streams;
- ``prefill``: the prefill node prefills and returns a ``KVHandoff``; the
  decode node receives the KV and streams; once its first token is there the
  prefill node is told to release the KV.

It returns a ``Started``: the ``RouteTaken`` (what the response reports) with
the first token and the stream of the rest. What the engines did not time
(routing, RPCs, queues in the serving path) counts as waiting before the
prefill starts, so the breakdown adds up to the TTFT seen here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray.serve.handle import DeploymentHandle

from kairos_ray.core import Route
from kairos_ray.messages import EngineRequest, RoutingReply, TokenEvent, TTFTBreakdown
from kairos_ray.serve.metrics import IngressMetrics

logger = logging.getLogger("ray.serve")


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


@dataclass(frozen=True, slots=True)
class Started:
    """A request whose first token is here."""

    route: RouteTaken
    first: TokenEvent
    rest: AsyncIterator[TokenEvent]


class Dispatcher:
    """Runs requests over the router and the two pools (calls name their node: ``serve.delivery``)."""

    def __init__(
        self,
        router: DeploymentHandle,
        prefill: DeploymentHandle,
        decode: DeploymentHandle,
        decision_timeout_s: float,
        metrics: IngressMetrics,
    ) -> None:
        self.router, self.prefill, self.decode = router, prefill, decode
        self.decision_timeout_s = decision_timeout_s
        self.metrics = metrics

    async def _decide(self, request: EngineRequest) -> RoutingReply:
        try:
            reply: RoutingReply = await asyncio.wait_for(
                self.router.decide.remote(request.request_id, request.prompt_tokens, request.max_tokens),
                self.decision_timeout_s,
            )
            return reply
        except Exception as exc:  # whatever keeps the router from answering: disaggregate, counted
            self.metrics.fallbacks.inc(tags={"route": Route.PREFILL.value, "reason": "fallback"})
            logger.warning("router could not decide (%s: %s); disaggregating", type(exc).__name__, exc)
            return RoutingReply.fallback_for(type(exc).__name__)

    async def start(self, request: EngineRequest) -> Started:
        """Route the request and wait for its first token."""
        reply = await self._decide(request)
        decision = reply.decision
        decode = self.decode.options(stream=True)
        prefill_node, kv_transport = None, ""
        if decision.route is Route.DEFLECT:
            request = dataclasses.replace(request, chunk_schedule=decision.chunk_schedule)
            stream = decode.generate.remote(request, None, node=decision.decode_node)
        else:
            request = dataclasses.replace(request, kv_receiver=decision.decode_node or "")
            handoff = await self.prefill.prefill.remote(request, node=decision.prefill_node)
            prefill_node, kv_transport = handoff.node_id, handoff.transport  # where it ran
            stream = decode.generate.remote(request, handoff, node=decision.decode_node)
        rest = stream.__aiter__()
        first: TokenEvent = await rest.__anext__()
        if prefill_node is not None:  # the decode node has the KV: free it on the prefill node
            self.prefill.release.remote(request.request_id, node=prefill_node)
        ttft_s = time.time() - request.arrival_wall_s
        timed = first.breakdown or TTFTBreakdown()
        breakdown = dataclasses.replace(timed, prefill_queue_s=timed.prefill_queue_s + max(0.0, ttft_s - timed.total_s))
        self.metrics.ttft.observe(ttft_s, tags={"route": decision.route.value})
        route = RouteTaken(
            request_id=request.request_id,
            route=decision.route,
            prefill_node=prefill_node,
            decode_node=first.node_id,
            chunk_schedule=decision.chunk_schedule,
            kv_transport=kv_transport,
            reason=decision.reason,
            fallback=reply.fallback,
            ttft_s=ttft_s,
            breakdown=breakdown,
        )
        return Started(route, first, rest)
