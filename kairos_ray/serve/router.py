"""The central router: live cluster state plus the core policy.

``RouterState`` is plain Python (tested without Serve). Its view of the
cluster is built from two sources:

- the last ``NodeState`` each engine pushed (after a step, at most every few
  ms, and on a heartbeat when idle): each carries the core's snapshot of its
  node (FIFO of queued prompt tokens per prefill node; batch size, KV tokens,
  free KV and committed chunk schedules per decode node);
- its own ledger of decisions that no engine has acknowledged yet, applied on
  top with ``core.apply_decision``, so a burst sees its own earlier decisions at
  once. An engine acknowledges a request by listing its id in
  ``accepted_request_ids``; an entry older than ``pending_ttl_s`` is dropped in
  any case.

Nodes join by reporting (pools scale) and leave when they have not reported
for ``node_timeout_s`` (engines send a heartbeat every second when idle), or
at once when they report themselves unhealthy (their engine died or stalled).
A request that failed on some nodes is decided without them (``avoid``).

``Router`` is the Serve deployment around it (one replica), with metrics and
the online refit of the step-latency model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ray import serve

from kairos_ray.config import KairosConfig
from kairos_ray.core import ClusterView, Decision, DecodeNodeView, Policy, PrefillNodeView, apply_decision
from kairos_ray.messages import DecisionRequest, NodeState, RouterLive, RoutingReply
from kairos_ray.serve.metrics import RouterMetrics
from kairos_ray.serve.refit import OnlineRefit

logger = logging.getLogger("ray.serve")


class MissingState(RuntimeError):
    """Some node has not reported yet; the caller falls back to plain disaggregation."""


@dataclass(frozen=True, slots=True)
class _Pending:
    """A decision no engine has acknowledged yet."""

    prompt_tokens: int
    output_tokens: int
    decision: Decision
    decided_s: float  # monotonic


class RouterState:
    """The router's view: the nodes' last reports plus its ledger of decisions no engine has acknowledged.

    The view with the ledger applied is kept between decisions and updated by
    each decision (``apply_decision``: O(1) per decision); a report, a node
    that falls silent or a ledger entry that expires rebuilds it (O(ledger)).
    """

    def __init__(self, policy: Policy, pending_ttl_s: float = 2.0, node_timeout_s: float = 5.0) -> None:
        self.policy = policy
        self.pending_ttl_s, self.node_timeout_s = pending_ttl_s, node_timeout_s
        self.states: dict[str, NodeState] = {}  # node id -> its last report
        self.received: dict[str, float] = {}  # node id -> monotonic time of its last report
        self.pending: dict[int, _Pending] = {}  # request id -> its undelivered decision, oldest first
        self._view: ClusterView | None = None  # reports + ledger, while nothing changed but decisions

    def report(self, state: NodeState, now: float) -> None:
        """Take a node's report; a node that reports itself unhealthy leaves the view at once."""
        for rid in state.accepted_request_ids:
            self.pending.pop(rid, None)
        self._view = None
        if not state.healthy:
            self.states.pop(state.node_id, None)
            self.received.pop(state.node_id, None)
            return
        self.states[state.node_id] = state
        self.received[state.node_id] = now

    def forget_silent_nodes(self, now: float) -> None:
        for node in [n for n, seen in self.received.items() if now - seen > self.node_timeout_s]:
            del self.states[node], self.received[node]
            self._view = None

    def _expire(self, now: float) -> None:
        """Drop ledger entries no engine acknowledged within ``pending_ttl_s`` (oldest first)."""
        while self.pending:
            rid, oldest = next(iter(self.pending.items()))
            if now - oldest.decided_s <= self.pending_ttl_s:
                return
            del self.pending[rid]
            self._view = None

    def view(self, now: float, avoid: Collection[str] = ()) -> tuple[ClusterView, float]:
        """(view, staleness in seconds of the oldest report in it), without the nodes in ``avoid``."""
        self.forget_silent_nodes(now)
        self._expire(now)
        if self._view is None:
            views = [self.states[node].view for node in sorted(self.states)]
            view = ClusterView(
                tuple(v for v in views if isinstance(v, PrefillNodeView)),
                tuple(v for v in views if isinstance(v, DecodeNodeView)),
            )
            for pending in self.pending.values():
                view = apply_decision(view, pending.prompt_tokens, pending.decision, pending.output_tokens)
            self._view = view
        view = self._view
        if avoid:
            view = ClusterView(
                tuple(v for v in view.prefill if v.node_id not in avoid),
                tuple(v for v in view.decode if v.node_id not in avoid),
            )
        if not view.prefill or not view.decode:
            raise MissingState(f"{len(view.prefill)} prefill and {len(view.decode)} decode nodes have reported")
        return view, now - min(self.received.values())

    def decide(
        self, request_id: int, prompt_tokens: int, output_tokens: int, now: float, avoid: Collection[str] = ()
    ) -> tuple[Decision, float]:
        """(decision, staleness) on the nodes not in ``avoid``; raises ``MissingState`` while a pool has none."""
        view, staleness = self.view(now, avoid)
        decision = self.policy.decide(prompt_tokens, view)
        if self.pending.pop(request_id, None) is not None:  # a retry replaces its request's earlier entry
            self._view = None
        self.pending[request_id] = _Pending(prompt_tokens, output_tokens, decision, now)
        if self._view is not None:
            self._view = apply_decision(self._view, prompt_tokens, decision, output_tokens)
        return decision, staleness


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=4096,
    ray_actor_options={"num_cpus": 0},
    logging_config={"enable_access_log": False},  # a log line per report and decision would cost more than both
)
class Router:
    """One replica: every decision goes through it, so it sees every dispatch."""

    def __init__(self, kairos: dict[str, Any], refit_every_steps: int = 0) -> None:
        self.config = KairosConfig.model_validate(kairos)
        self.model = self.config.predictor.load()
        self.state = RouterState(self.config.build_policy(model=self.model))
        self.metrics = RouterMetrics()
        self.refit = OnlineRefit(refit_every_steps) if refit_every_steps else None

    async def decide(self, request: DecisionRequest) -> RoutingReply:
        """Decide on the live nodes but those the request avoids (they failed it)."""
        start = time.perf_counter()
        r = request
        decision, staleness = self.state.decide(
            r.request_id, r.prompt_tokens, r.output_tokens, time.monotonic(), r.avoid
        )
        decision_s = time.perf_counter() - start
        self.metrics.decided(decision, decision_s, staleness)
        return RoutingReply(decision, decision_s, staleness)

    async def decide_many(self, requests: list[DecisionRequest]) -> list[RoutingReply]:
        """Decide requests one after another, in order, each seeing the ones before in the ledger."""
        return [await self.decide(request) for request in requests]

    async def report(self, state: NodeState) -> None:
        self.state.report(state, time.monotonic())
        self.metrics.node(state)
        if self.refit is not None:
            self.refit.add(state.steps)
            if self.refit.due:
                self._refit()

    def _refit(self) -> None:
        """Adopt a model refit on the reported steps when it predicts them better (both pools' model)."""
        assert self.refit is not None
        result = self.refit.refit(self.model)
        self.metrics.prediction_error(result.current_mape)
        if result.model is not None:
            logger.info(
                "kairos refit: step-latency MAPE %.1f %% -> %.1f %% on %d reported steps",
                100 * result.current_mape, 100 * result.refit_mape, len(self.refit.samples),
            )  # fmt: skip
            self.model = result.model
            self.state.policy = self.config.build_policy(self.state.policy.spec, model=self.model)
            self.metrics.refits.inc()

    async def live(self) -> RouterLive:
        """Every live node's last report and the last minute's steps and decisions (``serve.live``)."""
        now = time.monotonic()
        self.state.forget_silent_nodes(now)
        states = {node: (state, self.state.received[node]) for node, state in self.state.states.items()}
        return self.metrics.window.live(self.state.policy.spec, states, now)

    async def snapshot(self) -> dict[str, NodeState]:
        """The last state of every live node (for tests and debugging)."""
        self.state.forget_silent_nodes(time.monotonic())
        return dict(self.state.states)
