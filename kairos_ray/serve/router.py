"""The central router: live cluster state plus the core policy.

``RouterState`` is plain Python (tested without Serve). Its view of the
cluster is built from two sources:

- the last state each engine pushed (after a step, at most every few ms, and
  on a heartbeat when idle): FIFO of queued prompt tokens per prefill node;
  batch size, KV tokens, free KV and committed chunk schedules per decode node;
- its own ledger of decisions that no engine has acknowledged yet, applied on
  top with ``core.apply_decision``, so a burst sees its own earlier decisions at
  once. An engine acknowledges a request by listing its id in ``accepted``; an
  entry older than ``pending_ttl_s`` is dropped in any case.

Nodes join by reporting (pools scale) and leave when they have not reported
for ``node_timeout_s`` (engines send a heartbeat every second when idle).

``Router`` is the Serve deployment around it (one replica), with metrics.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Any

from ray import serve

from kairos_ray.config import KairosConfig
from kairos_ray.core import (
    ClusterView,
    Decision,
    DecodeNodeView,
    Policy,
    PrefillNodeView,
    apply_decision,
)
from kairos_ray.serve.metrics import RouterMetrics
from kairos_ray.serve.refit import OnlineRefit

logger = logging.getLogger("ray.serve")


class MissingState(RuntimeError):
    """Some node has not reported yet; the caller falls back to plain disaggregation."""


def node_view(state: dict[str, Any]) -> PrefillNodeView | DecodeNodeView:
    """The core's snapshot of one node from the state it pushed."""
    if state["role"] == "prefill":
        return PrefillNodeView(state["node_id"], tuple(state["queued"]), state["head_prefilled"])
    return DecodeNodeView(
        state["node_id"],
        batch_size=state["batch_size"],
        kv_tokens=state["kv_tokens"],
        free_kv_tokens=state["free_kv_tokens"],
        committed=tuple(tuple(c) for c in state["committed"]),
    )


class RouterState:
    def __init__(self, policy: Policy, pending_ttl_s: float = 2.0, node_timeout_s: float = 5.0) -> None:
        self.policy = policy
        self.pending_ttl_s, self.node_timeout_s = pending_ttl_s, node_timeout_s
        self.views: dict[str, PrefillNodeView | DecodeNodeView] = {}
        self.received: dict[str, float] = {}  # node id -> monotonic time of its last report
        self.states: dict[str, dict[str, Any]] = {}
        self.pending: dict[int, tuple[int, Decision, float]] = {}  # rid -> (prompt tokens, decision, when)

    def report(self, state: dict[str, Any], now: float) -> None:
        node = state["node_id"]
        if state.get("role") not in ("prefill", "decode"):
            raise ValueError(f"report from {node!r} with unknown role {state.get('role')!r}")
        self.views[node] = node_view(state)
        self.states[node] = state
        self.received[node] = now
        for rid in state.get("accepted", ()):
            self.pending.pop(rid, None)

    def forget_silent_nodes(self, now: float) -> None:
        for node in [n for n, seen in self.received.items() if now - seen > self.node_timeout_s]:
            del self.views[node], self.states[node], self.received[node]

    def view(self, now: float) -> tuple[ClusterView, float]:
        """(view, staleness in seconds of the oldest report in it)."""
        self.forget_silent_nodes(now)
        prefill = tuple(v for _, v in sorted(self.views.items()) if isinstance(v, PrefillNodeView))
        decode = tuple(v for _, v in sorted(self.views.items()) if isinstance(v, DecodeNodeView))
        if not prefill or not decode:
            raise MissingState(f"{len(prefill)} prefill and {len(decode)} decode nodes have reported")
        view = ClusterView(prefill, decode)
        for rid, (prompt, decision, when) in list(self.pending.items()):
            if now - when > self.pending_ttl_s:
                del self.pending[rid]
            else:
                view = apply_decision(view, prompt, decision)
        return view, now - min(self.received.values())

    def decide(self, request_id: int, prompt_tokens: int, now: float) -> tuple[Decision, float]:
        """(decision, staleness); raises ``MissingState`` before every node has reported."""
        view, staleness = self.view(now)
        decision = self.policy.decide(prompt_tokens, view)
        self.pending[request_id] = (prompt_tokens, decision, now)
        return decision, staleness


@serve.deployment(num_replicas=1, max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0})
class Router:
    """One replica: every decision goes through it, so it sees every dispatch."""

    def __init__(self, kairos: dict[str, Any], refit_every_steps: int = 0) -> None:
        self.config = KairosConfig.model_validate(kairos)
        self.model = self.config.predictor.load()
        self.state = RouterState(self.config.build_policy())
        self.metrics = RouterMetrics()
        self.refit = OnlineRefit(refit_every_steps) if refit_every_steps else None

    async def decide(self, request_id: int, prompt_tokens: int) -> dict[str, Any]:
        start = time.perf_counter()
        decision, staleness = self.state.decide(request_id, prompt_tokens, time.monotonic())
        decision_s = time.perf_counter() - start
        self.metrics.decided(decision, decision_s, staleness)
        return {**asdict(decision), "route": decision.route.value, "decision_s": decision_s, "staleness_s": staleness}

    async def report(self, state: dict[str, Any]) -> None:
        self.state.report(state, time.monotonic())
        self.metrics.node(state)
        if self.refit is not None:
            self.refit.add(state)
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

    async def snapshot(self) -> dict[str, Any]:
        """Last state of every live node and the ledger size (for tests and debugging)."""
        self.state.forget_silent_nodes(time.monotonic())
        return {"nodes": self.state.states, "pending": len(self.state.pending)}
