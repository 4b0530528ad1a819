"""Ray metrics of the Kairos app (Prometheus names get Ray's ``ray_`` prefix, e.g. ``ray_kairos_decisions_total``).

| metric | kind | tags | what |
|---|---|---|---|
| kairos_decisions | counter | route, reason | routing decisions; reason: decode-faster, prefill-faster, |
|  |  |  | no-safe-decode-node or fallback; route shed: admission's reason |
| kairos_decision_latency_seconds | histogram | | time the router spends in the policy |
| kairos_view_staleness_seconds | histogram | | age of the oldest engine report behind a decision |
| kairos_ttft_seconds | histogram | route | time to first token, at the ingress |
| kairos_tbt_seconds | histogram | route | every gap between streamed tokens, at the ingress |
| kairos_router_call_seconds | histogram | | a decision as the ingress waits for it: asking the router to its reply |
| kairos_node_queue_depth | gauge | node | requests queued on a prefill node, waiting on a decode node |
| kairos_node_batch_size | gauge | node | decoding requests on a decode node |
| kairos_node_kv_tokens | gauge | node | resident KV tokens on a decode node |
| kairos_step_seconds | gauge | node, source | last step time: measured, or predicted by the step-latency model |
| kairos_rejected | counter | reason | requests refused (overload, bad-request, too-large, unauthorized) |
| kairos_shed | counter | reason, priority | requests admission shed (429): no-route-in-time, or priority |
| kairos_slo_attained | counter | route | requests that ended within the TTFT and TBT objectives: goodput is its rate |
| kairos_retries | counter | stage | before_first_token: a failed try run again elsewhere; migration: moved mid-stream |
| kairos_deadlines | counter | deadline | requests ended by a deadline (first_token) |
| kairos_kv_recomputes | gauge | node | decode node: hand-offs whose KV was lost or late, recomputed (cumulative) |
| kairos_predictor_mape | gauge | | live error of the step-latency model on recent reported steps (online refit on) |
| kairos_predictor_refits | counter | | refits the router adopted |

Both metric sets also feed the live view's windows (``serve.live``): the
router's decisions and reported steps; the ingress's TTFT, TBT, router calls,
fallbacks, rejections, shed requests and those within their objectives.
"""

from __future__ import annotations

import time

from ray.serve.metrics import Counter, Gauge, Histogram

from kairos_ray.core import Decision, PrefillNodeView, Route
from kairos_ray.messages import NodeState
from kairos_ray.metrics import SHED_ROUTE
from kairos_ray.serve.live import SHED_KEY, IngressWindow, RouterWindow, Window

LATENCY_BOUNDARIES = [1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05]
CALL_BOUNDARIES = [5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0, 5.0]  # up to the decision deadline
SECONDS_BOUNDARIES = [0.01, 0.02, 0.05, 0.07, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0]


def reason_kind(decision: Decision) -> str:
    if decision.shed:
        assert decision.admission is not None and decision.admission.reason is not None
        return decision.admission.reason.value
    if decision.route is Route.DEFLECT:
        return "decode-faster"
    return "no-safe-decode-node" if decision.ttft_decode_s is None else "prefill-faster"


class RouterMetrics:
    def __init__(self) -> None:
        self.decisions = Counter("kairos_decisions", "routing decisions", tag_keys=("route", "reason"))  # type: ignore[arg-type]
        self.latency = Histogram(
            "kairos_decision_latency_seconds", "time in the policy per decision", LATENCY_BOUNDARIES
        )
        self.staleness = Histogram(
            "kairos_view_staleness_seconds", "age of the oldest engine report behind a decision", SECONDS_BOUNDARIES
        )
        self.queue = Gauge("kairos_node_queue_depth", "queued requests per node", tag_keys=("node",))
        self.batch = Gauge("kairos_node_batch_size", "decoding requests per decode node", tag_keys=("node",))
        self.kv = Gauge("kairos_node_kv_tokens", "resident KV tokens per decode node", tag_keys=("node",))
        self.step = Gauge("kairos_step_seconds", "last step time per node", tag_keys=("node", "source"))  # type: ignore[arg-type]
        self.recomputes = Gauge(
            "kairos_kv_recomputes", "hand-offs recomputed on a decode node (KV lost or late)", tag_keys=("node",)
        )
        self.mape = Gauge("kairos_predictor_mape", "step-latency model error on recent reported steps")
        self.refits = Counter("kairos_predictor_refits", "step-latency refits adopted")
        self.window = RouterWindow()

    def decided(self, decision: Decision, decision_s: float, staleness_s: float) -> None:
        """One decision; a shed one counts as route ``shed`` with admission's reason, and sends nothing anywhere."""
        route = SHED_ROUTE if decision.shed else decision.route.value
        if not decision.shed:
            self.window.decided(time.monotonic(), decision)
        self.decisions.inc(tags={"route": route, "reason": reason_kind(decision)})
        self.latency.observe(decision_s)
        self.staleness.observe(staleness_s)

    def prediction_error(self, mape: float) -> None:
        self.mape.set(mape)

    def node(self, state: NodeState) -> None:
        self.window.reported(time.monotonic(), state)
        tags = {"node": state.node_id}
        view = state.view
        if isinstance(view, PrefillNodeView):
            self.queue.set(view.num_queued, tags=tags)
        else:
            self.queue.set(state.num_waiting + len(view.committed), tags=tags)
            self.batch.set(view.batch_size, tags=tags)
            self.kv.set(view.kv_tokens, tags=tags)
            self.recomputes.set(state.kv_recomputes, tags=tags)
        step = state.last_step
        if step is not None:
            self.step.set(step.measured_s, tags={**tags, "source": "measured"})
            self.step.set(step.predicted_s, tags={**tags, "source": "predicted"})


class _Windowed:
    """A Ray metric whose every observation also goes to a live-view window, keyed by one of its tags."""

    def __init__(self, window: Window[float], key_tag: str) -> None:
        self.window, self.key_tag = window, key_tag

    def _add(self, value: float, tags: dict[str, str]) -> None:
        self.window.add(time.monotonic(), tags.get(self.key_tag, ""), value)


class _WindowedHistogram(_Windowed):
    def __init__(self, metric: Histogram, window: Window[float], key_tag: str) -> None:
        super().__init__(window, key_tag)
        self.metric = metric

    def observe(self, value: float, tags: dict[str, str]) -> None:
        self.metric.observe(value, tags=tags)
        self._add(value, tags)


class _WindowedCounter(_Windowed):
    def __init__(self, metric: Counter, window: Window[float], key_tag: str) -> None:
        super().__init__(window, key_tag)
        self.metric = metric

    def inc(self, tags: dict[str, str]) -> None:
        self.metric.inc(tags=tags)
        self._add(1.0, tags)


class IngressMetrics:
    def __init__(self) -> None:
        self.window = IngressWindow()
        self.ttft = _WindowedHistogram(
            Histogram("kairos_ttft_seconds", "time to first token", SECONDS_BOUNDARIES, tag_keys=("route",)),
            self.window.ttft,
            "route",
        )
        self.tbt = _WindowedHistogram(
            Histogram("kairos_tbt_seconds", "gaps between streamed tokens", SECONDS_BOUNDARIES, tag_keys=("route",)),
            self.window.tbt,
            "route",
        )
        self.router_calls = _WindowedHistogram(
            Histogram("kairos_router_call_seconds", "a decision from asking the router to its reply", CALL_BOUNDARIES),
            self.window.router_calls,
            "",
        )
        self.fallbacks = _WindowedCounter(
            Counter("kairos_decisions", "routing decisions", tag_keys=("route", "reason")),  # type: ignore[arg-type]
            self.window.fallbacks,
            "route",
        )
        self.rejected = _WindowedCounter(
            Counter("kairos_rejected", "requests refused", tag_keys=("reason",)), self.window.rejections, "reason"
        )
        self._shed = Counter("kairos_shed", "requests shed by admission (429)", tag_keys=("reason", "priority"))  # type: ignore[arg-type]
        self.attained = _WindowedCounter(
            Counter("kairos_slo_attained", "requests within their TTFT and TBT objectives", tag_keys=("route",)),
            self.window.attained,
            "route",
        )
        self.retries = Counter("kairos_retries", "requests re-run after a node failed", tag_keys=("stage",))
        self.deadlines = Counter("kairos_deadlines", "requests ended by a deadline", tag_keys=("deadline",))
        self.shard_failovers = Counter(
            "kairos_router_shard_failovers", "router shards left out after failing a decision", tag_keys=("shard",)
        )

    def shed(self, reason: str, priority: int) -> None:
        """A request admission shed, by its reason and priority class."""
        self._shed.inc(tags={"reason": reason, "priority": str(priority)})
        self.window.shed.add(time.monotonic(), f"{reason}{SHED_KEY}{priority}", 1.0)
