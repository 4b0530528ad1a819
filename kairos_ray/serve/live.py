"""The live view of a running app: what ``GET /kairos/state`` answers and ``kairos top`` shows.

Rolling windows of the last minute, each kept where its data is seen:

- the router's (``RouterWindow``, fed by ``serve.metrics.RouterMetrics``):
  every step the engines report (measured and predicted time) and every
  decision (which nodes a request was sent to, deflected or not);
- the ingress's (``IngressWindow``, fed by ``serve.metrics.IngressMetrics``):
  every TTFT and every gap between streamed tokens it measures, how long
  each routing decision took from asking the router to its reply, the
  fallbacks (the router could not decide), the rejections, the requests
  admission shed (by reason and priority) and those that ended within their
  objectives (goodput: how many a second). With several
  ingress replicas, these are the figures of the replica that answered.

``Router.live`` answers a ``messages.RouterLive`` (a ``NodeLive`` per node,
its last report plus the router's window); the ingress adds its
``ServiceLive`` and answers the ``LiveState`` as JSON. Time comes in as
arguments (monotonic seconds), as in ``core``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter, deque
from typing import Any, Generic, TypeVar

import numpy as np
from ray.serve.handle import DeploymentHandle

from kairos_ray.core import Decision, PrefillNodeView, Route
from kairos_ray.messages import LiveState, NodeLive, NodeState, RouterLive, ServiceLive, StepRecord

WINDOW_S = 60.0  # the live view's window
LIVE_TIMEOUT_S = 5.0  # the ingress waits this long for the router's part
MAX_SAMPLES = 100_000  # per window: beyond, the oldest samples go first (a busy minute of token gaps)

T = TypeVar("T")


class Window(Generic[T]):
    """Keyed samples of the last ``span_s`` seconds (at most ``max_samples``)."""

    def __init__(self, span_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES) -> None:
        self.span_s = span_s
        self._samples: deque[tuple[float, str, T]] = deque(maxlen=max_samples)

    def add(self, now: float, key: str, value: T) -> None:
        """Keep a sample, dropping those past the window: what it holds follows the rate of the last
        ``span_s``, whether or not anyone reads it (``max_samples`` caps a burst)."""
        self._samples.append((now, key, value))
        self._expire(now)

    def values(self, now: float, key: str | None = None) -> list[T]:
        """The samples of ``key`` (of every key: None) still in the window at ``now``."""
        self._expire(now)
        return [value for _, k, value in self._samples if key is None or k == key]

    def __len__(self) -> int:
        return len(self._samples)

    def _expire(self, now: float) -> None:
        while self._samples and now - self._samples[0][0] > self.span_s:
            self._samples.popleft()

    def keys(self, now: float) -> Counter[str]:
        """How many samples of each key are in the window."""
        self.values(now)
        return Counter(k for _, k, _ in self._samples)


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


DEFLECTED, HANDED_OFF, PREFILLED = "deflect", "handoff", "prefill"
SHED_KEY = "/"  # joins a shed request's reason and priority in the ingress's window


class RouterWindow:
    """What the router saw in the last minute: steps per node, and where its decisions sent requests."""

    def __init__(self, span_s: float = WINDOW_S) -> None:
        self.steps: Window[StepRecord] = Window(span_s)  # node id -> reported steps
        self.routed: Window[str] = Window(span_s)  # node id -> DEFLECTED, HANDED_OFF or PREFILLED per request

    def decided(self, now: float, decision: Decision) -> None:
        if decision.route is Route.DEFLECT:
            self.routed.add(now, decision.decode_node or "", DEFLECTED)
            return
        if decision.prefill_node:
            self.routed.add(now, decision.prefill_node, PREFILLED)
        if decision.decode_node:
            self.routed.add(now, decision.decode_node, HANDED_OFF)

    def reported(self, now: float, state: NodeState) -> None:
        for step in state.steps:
            self.steps.add(now, state.node_id, step)

    def live(self, policy: str, states: dict[str, tuple[NodeState, float]], now: float) -> RouterLive:
        """The router's live view; ``states``: node id -> (last report, monotonic time it came)."""
        nodes = tuple(self._node(state, now - at, now) for _, (state, at) in sorted(states.items()))
        return RouterLive(policy, self.steps.span_s, nodes)

    def _node(self, state: NodeState, age_s: float, now: float) -> NodeLive:
        node, view = state.node_id, state.view
        steps = self.steps.values(now, node)
        routed = self.routed.values(now, node)
        measured = sum(s.measured_s for s in steps) / len(steps) if steps else 0.0
        predicted = sum(s.predicted_s for s in steps) / len(steps) if steps else 0.0
        error = sum(abs(s.predicted_s - s.measured_s) / s.measured_s for s in steps) / len(steps) if steps else 0.0
        if isinstance(view, PrefillNodeView):
            queued_tokens = sum(view.queued_prompt_tokens) - view.head_prefilled_tokens
            queue = (view.num_queued, queued_tokens, 0, 0, 0, 0)
        else:
            queue = (state.num_waiting, 0, view.batch_size, view.kv_tokens, view.free_kv_tokens, len(view.committed))
        queued, queued_tokens, batch_size, kv_tokens, free_kv_tokens, committed = queue
        return NodeLive(
            node_id=node,
            role=state.role,
            ray_node_id=state.ray_node_id,
            report_age_s=age_s,
            queued_requests=queued,
            queued_prompt_tokens=queued_tokens,
            batch_size=batch_size,
            kv_tokens=kv_tokens,
            free_kv_tokens=free_kv_tokens,
            kv_usage=state.kv_usage,
            committed_deflections=committed,
            num_steps=len(steps),
            step_measured_s=measured,
            step_predicted_s=predicted,
            step_error=error,
            num_routed=len(routed),
            num_deflected=routed.count(DEFLECTED),
        )


class IngressWindow:
    """What an ingress replica saw in the last minute: TTFT and TBT by route, router calls, fallbacks, rejections."""

    def __init__(self, span_s: float = WINDOW_S) -> None:
        self.span_s = span_s
        self.ttft: Window[float] = Window(span_s)  # route -> TTFT
        self.tbt: Window[float] = Window(span_s)  # route -> gap between two streamed tokens
        self.router_calls: Window[float] = Window(span_s)  # "" -> a decision's time from asking to the reply
        self.fallbacks: Window[float] = Window(span_s)  # route -> 1 per request the router could not decide
        self.rejections: Window[float] = Window(span_s)  # reason -> 1 per refused request
        self.shed: Window[float] = Window(span_s)  # "reason/priority" -> 1 per request admission shed
        self.attained: Window[float] = Window(span_s)  # route -> 1 per request within its objectives

    def live(self, now: float) -> ServiceLive:
        ttft, calls = self.ttft.values(now), self.router_calls.values(now)
        by_reason: Counter[str] = Counter()
        by_priority: Counter[str] = Counter()
        for key, count in self.shed.keys(now).items():
            reason, _, priority = key.partition(SHED_KEY)
            by_reason[reason] += count
            by_priority[priority] += count
        return ServiceLive(
            window_s=self.span_s,
            num_requests=len(ttft),
            num_deflected=len(self.ttft.values(now, Route.DEFLECT.value)),
            p95_ttft_s=percentile(ttft, 95),
            p95_tbt_s=percentile(self.tbt.values(now), 95),
            num_fallbacks=len(self.fallbacks.values(now)),
            rejections=dict(self.rejections.keys(now)),
            p50_router_call_s=percentile(calls, 50),
            p99_router_call_s=percentile(calls, 99),
            shed=dict(by_reason),
            shed_by_priority=dict(by_priority),
            goodput_rps=len(self.attained.values(now)) / self.span_s,
        )


async def live_state(router: DeploymentHandle[Any], window: IngressWindow) -> dict[str, Any]:
    """The ``LiveState`` as JSON: the router's part (``Router.live``, within ``LIVE_TIMEOUT_S``) and ``window``'s."""
    part: RouterLive = await asyncio.wait_for(router.live.remote(), LIVE_TIMEOUT_S)
    return dataclasses.asdict(LiveState(time.time(), part, window.live(time.monotonic())))
