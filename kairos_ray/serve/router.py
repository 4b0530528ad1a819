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
  any case. A prefill-routed request stays on its decode node's part of the
  ledger (``DecodeNodeView.incoming_requests``) until that node acknowledges
  it, once its KV has arrived: through its prefill and KV transfer no engine
  reports it there, yet it is bound for that node's batch. That part is
  dropped after ``handoff_ttl_s`` in any case.

Nodes join by reporting (pools scale) and leave when they have not reported
for ``node_timeout_s`` (engines send a heartbeat every second when idle), or
at once when they report themselves unhealthy (their engine died or stalled).
A request that failed on some nodes is decided without them (``avoid``).

Prefix caches: the router keeps a ``core.BlockCache`` per node, mirrored from
the deltas its reports carry (``PrefixDelta``: vLLM's KV events, or an
emulated node's cache), and dropped with the node. A decision reads each
node's hit for the request's block hashes (``DecisionRequest.block_ids``,
hashed by the ingress with the block sizes the router's replies name) into
``core.PrefixHits`` for the policy, which prices only each node's uncached
suffix. The ledger needs nothing more: ``apply_decision`` charges the
decision's uncached part only. A report lost in between (a gap in a node's
``seq``) drops that node's mirror until its next full delta.

``RouterActor`` holds it, with metrics and the online refit of the
step-latency model, behind plain Ray actor calls; the steps a node reports
are priced, for the metrics and the live view, with the model the router
prices that node with (``priced_by``), not with the profile its engine was
started with; ``Router`` is the Serve
deployment (one replica) that owns that actor, watches it and hands out its
handle (``serve.router_link``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray import serve

from kairos_ray.config import KairosConfig, resolve_profile
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
    StepLatencyModel,
    apply_decision,
    node_after,
    with_nodes,
)
from kairos_ray.core.shards import assign
from kairos_ray.heap import freeze_startup_heap
from kairos_ray.messages import (
    DecisionRequest,
    NodeId,
    NodeState,
    PrefixDelta,
    Residue,
    RouterLive,
    RoutingReply,
    WireAddress,
)
from kairos_ray.serve.metrics import RouterMetrics
from kairos_ray.serve.refit import NODE_EVERY, NodeScales, OnlineRefit
from kairos_ray.serve.types import LineOff, RouterOptions
from kairos_ray.serve.wire import WireServer

logger = logging.getLogger("ray.serve")

HEALTH_CHECK_PERIOD_S = 2.0  # Serve asks the router replica this often whether its actor answers
HEALTH_CHECK_TIMEOUT_S = 10.0
ACTOR_PING_TIMEOUT_S = 5.0  # an actor that does not answer a ping in time is hung: the replica reports unhealthy
LIVE_REFRESH_S = 1.0  # the live view (``GET /kairos/state``) is built at most this often


class MissingState(RuntimeError):
    """Some node has not reported yet; the caller falls back to plain disaggregation."""


@dataclass(frozen=True, slots=True)
class _Pending:
    """A decision no engine (or, for a prefill-routed one's hand-off, no decode node) has acknowledged yet."""

    prompt_tokens: int
    output_tokens: int
    decision: Decision
    decided_s: float  # monotonic


class RouterState:
    """The router's view: the nodes' last reports plus its ledger of decisions no engine has acknowledged.

    The view with the ledger applied is kept between decisions and updated by
    each decision (``apply_decision``: O(1) per decision). A report, an
    acknowledgement or an expired entry marks only its node for rebuilding:
    that node's report plus its own ledger entries (a decision touches the
    node it sends its request to, its prefill node or the decode node it is
    deflected to, and a prefill-routed one its decode node too). A node
    joining or leaving rebuilds the whole view.
    """

    def __init__(
        self,
        policy: Policy,
        pending_ttl_s: float = 2.0,
        node_timeout_s: float = 5.0,
        handoff_ttl_s: float = RouterOptions.handoff_ttl_s,
        shard: int = 0,
        shards: int = 1,
    ) -> None:
        """``shard`` of ``shards``: this router decides on the decode nodes it owns (``core.shards``); it keeps
        every node's report, so that it can take over a dead shard's at once."""
        self.policy = policy
        self.shard, self.shards = shard, tuple(range(shards))
        self._members = 0  # counts nodes joining and leaving: the owners below hold while it does not change
        self._owners: tuple[tuple[int, tuple[int, ...]], dict[str, int]] | None = None  # (members, live) -> owners
        self.pending_ttl_s, self.node_timeout_s, self.handoff_ttl_s = pending_ttl_s, node_timeout_s, handoff_ttl_s
        self.states: dict[str, NodeState] = {}  # node id -> its last report
        self.received: dict[str, float] = {}  # node id -> monotonic time of its last report
        self.pending: dict[int, _Pending] = {}  # request id -> its undelivered decision, oldest first
        self.handoffs: dict[int, _Pending] = {}  # request id -> its prefill-routed decision, until its decode node
        self._pending_at: dict[str, dict[int, _Pending]] = {}  # node id -> the ledger entries that touch it
        self._view: ClusterView | None = None  # reports + ledger, while nothing changed but decisions
        self._stale: set[str] = set()  # nodes whose part of ``_view`` must be rebuilt
        self.caches: dict[str, BlockCache] = {}  # node id -> mirror of its prefix cache
        self._next_seq: dict[str, int] = {}  # node id -> the ``PrefixDelta.seq`` its mirror expects next
        self.block_tokens: tuple[int, ...] = ()  # the mirrors' block sizes (the ingress hashes prompts with them)

    def report(self, state: NodeState, now: float) -> None:
        """Take a node's report; a node that reports itself unhealthy leaves the view at once."""
        node = state.node_id
        for rid in state.accepted_request_ids:
            self._drop(rid)
            handoff = self.handoffs.get(rid)
            if handoff is not None and handoff.decision.decode_node == node:
                self._drop_handoff(rid)
        self.expire(now)  # an idle router's ledger empties too, not only at its next decision
        if not state.healthy:
            self._leave(node)
            return
        if node not in self.states:
            self._view = None
            self._members += 1
        self.states[node] = state
        self.received[node] = now
        self._stale.add(node)
        if state.prefix is not None:
            self._mirror(node, state.prefix)

    def reprice(self, state: NodeState) -> None:
        """Take a node's last report again, priced with another model (``NodeState.view.model``): not a report,
        so its time and its acknowledgements stay as they were."""
        if state.node_id in self.states:
            self.states[state.node_id] = state
            self._stale.add(state.node_id)

    def _mirror(self, node: str, prefix: PrefixDelta) -> None:
        """Apply a node's prefix-cache delta; a lost one (a gap in ``seq``) drops the mirror until a full one."""
        cache = self.caches.get(node)
        if prefix.delta.full:
            if cache is None or cache.block_tokens != prefix.block_tokens:
                cache = self.caches[node] = BlockCache(prefix.block_tokens)
                self._sizes_changed()
        elif cache is None or self._next_seq.get(node) != prefix.seq:
            self._drop_cache(node)
            return
        cache.apply(prefix.delta)
        self._next_seq[node] = prefix.seq + 1

    def _drop_cache(self, node: str) -> None:
        self._next_seq.pop(node, None)
        if self.caches.pop(node, None) is not None:
            self._sizes_changed()

    def _sizes_changed(self) -> None:
        self.block_tokens = tuple(sorted({cache.block_tokens for cache in self.caches.values()}))

    def hits(
        self, block_ids: Mapping[int, tuple[int, ...]], prompt_tokens: int, held_on: str = ""
    ) -> PrefixHits | None:
        """Each node's cached prefix of a prompt with these block hashes (None: the prompt has no identity);
        ``held_on``'s is every block a hit may count (``DecisionRequest.held_on``: its cache holds them, reported or
        not)."""
        if not block_ids:
            return None
        tokens = {}
        for node, cache in self.caches.items():
            hashes = block_ids.get(cache.block_tokens)
            if hashes:
                if node == held_on:
                    tokens[node] = cache.usable_blocks(hashes, prompt_tokens) * cache.block_tokens
                else:
                    tokens[node] = cache.cached_tokens(hashes, prompt_tokens)
        return PrefixHits(tokens)

    def forget_silent_nodes(self, now: float) -> None:
        for node in [n for n, seen in self.received.items() if now - seen > self.node_timeout_s]:
            self._leave(node)

    def _leave(self, node: str) -> None:
        """A node leaves the view, with its prefix mirror and every ledger entry that names it (their requests
        are re-decided elsewhere)."""
        if self.states.pop(node, None) is not None:
            self._members += 1
        self.received.pop(node, None)
        self._drop_cache(node)
        for rid in list(self._pending_at.pop(node, {})):
            self._drop(rid)
            self._drop_handoff(rid)
        self._view = None

    def residue(self) -> dict[str, int]:
        """Ledger entries (``messages.Residue``): all 0 once every decision is acknowledged or expired."""
        return {
            "ledger": len(self.pending),
            "handoffs": len(self.handoffs),
            "ledger_by_node": sum(map(len, self._pending_at.values())),
        }

    def _drop(self, rid: int) -> None:
        """Take a request's entry off the ledger (acknowledged, expired or replaced by a retry)."""
        entry = self.pending.pop(rid, None)
        if entry is not None:
            self._unmark(rid, _sent_to(entry.decision))

    def _drop_handoff(self, rid: int) -> None:
        """Take a prefill-routed request off its decode node's part of the ledger."""
        entry = self.handoffs.pop(rid, None)
        if entry is not None:
            self._unmark(rid, _handed_to(entry.decision))

    def _unmark(self, rid: int, node: str) -> None:
        entries = self._pending_at.get(node)
        if entries is not None:
            entries.pop(rid, None)
            if not entries:
                del self._pending_at[node]
        self._stale.add(node)

    def _add(self, rid: int, entry: _Pending) -> None:
        self.pending[rid] = entry
        self._pending_at.setdefault(_sent_to(entry.decision), {})[rid] = entry
        if entry.decision.route is Route.PREFILL:
            self.handoffs[rid] = entry
            self._pending_at.setdefault(_handed_to(entry.decision), {})[rid] = entry

    def expire(self, now: float) -> None:
        """Drop ledger entries no engine acknowledged within ``pending_ttl_s``, and hand-offs no decode node
        acknowledged within ``handoff_ttl_s`` (oldest first)."""
        for entries, ttl_s, drop in (
            (self.pending, self.pending_ttl_s, self._drop),
            (self.handoffs, self.handoff_ttl_s, self._drop_handoff),
        ):
            while entries:
                rid, oldest = next(iter(entries.items()))
                if now - oldest.decided_s <= ttl_s:
                    break
                drop(rid)

    def _node_view(self, node: str) -> PrefillNodeView | DecodeNodeView:
        """A node's last report with its own ledger entries applied, oldest first."""
        entries = self._pending_at.get(node, {}).values()
        return node_after(self.states[node].view, ((e.prompt_tokens, e.decision, e.output_tokens) for e in entries))

    def _current(self) -> ClusterView:
        """The view with the ledger applied, rebuilding only the nodes that changed since the last decision
        (in place while no node joined: ``core.state.with_nodes``)."""
        if self._view is None:
            self._view, self._stale = ClusterView((), ()), set(self.states)
        if self._stale and len(self.states) == len(self._view.prefill) + len(self._view.decode):
            patched = with_nodes(self._view, [self._node_view(node) for node in self._stale if node in self.states])
            if patched is not None:
                self._view, self._stale = patched, set()
        if self._stale:
            views: dict[str, PrefillNodeView | DecodeNodeView] = {view.node_id: view for view in self._view.prefill}
            views.update((view.node_id, view) for view in self._view.decode)
            views.update((node, self._node_view(node)) for node in self._stale if node in self.states)
            ordered = [views[node] for node in sorted(self.states)]
            self._view = ClusterView(
                tuple(v for v in ordered if isinstance(v, PrefillNodeView)),
                tuple(v for v in ordered if isinstance(v, DecodeNodeView)),
            )
            self._stale = set()
        return self._view

    def view(self, now: float, avoid: Collection[str] = (), live: tuple[int, ...] = ()) -> tuple[ClusterView, float]:
        """(view, staleness in seconds of the oldest report in it), without the nodes in ``avoid``, and, with
        shards, with the decode nodes this shard owns while the shards ``live`` names (default: all) are (all of
        them when it owns none: a fleet of fewer decode nodes than shards)."""
        self.forget_silent_nodes(now)
        self.expire(now)
        view = self._current()
        if len(self.shards) > 1:
            owners, me = self._owned(view, live), self.shard
            own = tuple(v for v in view.decode if owners[v.node_id] == me)
            if own:  # fewer decode nodes than shards: one that owns none decides on them all
                view = ClusterView(view.prefill, own)
        if avoid:
            view = ClusterView(
                tuple(v for v in view.prefill if v.node_id not in avoid),
                tuple(v for v in view.decode if v.node_id not in avoid),
            )
        if not view.prefill or not view.decode:
            raise MissingState(f"{len(view.prefill)} prefill and {len(view.decode)} decode nodes have reported")
        return view, now - min(self.received.values())

    def _owned(self, view: ClusterView, live: tuple[int, ...]) -> dict[str, int]:
        """Each decode node's shard while the shards ``live`` names are (all, when it names none; this one, asked,
        is), dealt again only when a node joined or left or the live shards changed (``core.shards.assign``)."""
        key = (self._members, tuple(sorted({*(live or self.shards), self.shard})))
        if self._owners is None or self._owners[0] != key:
            self._owners = (key, assign((v.node_id for v in view.decode), key[1]))
        return self._owners[1]

    def decide(
        self,
        request_id: int,
        prompt_tokens: int,
        output_tokens: int,
        now: float,
        avoid: Collection[str] = (),
        block_ids: Mapping[int, tuple[int, ...]] | None = None,
        priority: int = 0,
        sheddable: bool = True,
        held_on: str = "",
        live: tuple[int, ...] = (),
    ) -> tuple[Decision, float]:
        """(decision, staleness) on the nodes not in ``avoid``; raises ``MissingState`` while a pool has none.

        ``block_ids``: the prompt's block hashes per block size, for the nodes' cached prefixes (``hits``; node
        ``held_on`` holds every block a hit may count);
        ``priority``: vLLM's, which admission sheds by; a request not ``sheddable`` (the retry of an admitted
        one) is admitted whatever admission says; ``live``: the shards the asker deems live (``view``). A shed
        request leaves the ledger as it was.
        """
        view, staleness = self.view(now, avoid, live)
        hits = self.hits(block_ids or {}, prompt_tokens, held_on)
        decision = self.policy.decide(prompt_tokens, view, hits, priority, output_tokens)
        if decision.shed and not sheddable:
            assert decision.admission is not None
            decision = replace(decision, admission=decision.admission.overruled())
        self._drop(request_id)  # a retry replaces its request's earlier entry
        self._drop_handoff(request_id)
        if decision.shed:
            return decision, staleness
        self._add(request_id, _Pending(prompt_tokens, output_tokens, decision, now))
        if not self._stale and self._view is not None:
            self._view = apply_decision(self._view, prompt_tokens, decision, output_tokens)
        else:
            self._stale.add(_sent_to(decision))
            if decision.route is Route.PREFILL:
                self._stale.add(_handed_to(decision))
        return decision, staleness


def priced_by(state: NodeState, model: StepLatency) -> NodeState:
    """``state`` with each reported step's ``predicted_s`` from ``model``: what the router's decisions assume."""
    if not state.steps:
        return state
    steps = tuple(
        replace(s, predicted_s=model.step_s(s.batch_size, s.kv_tokens, s.chunk_tokens, s.prefix_tokens))
        for s in state.steps
    )
    return replace(state, steps=steps)


def _group_of(state: NodeState) -> str:
    """The node group a report's node belongs to (``messages.NodeId.group_name``; its role for an id of another
    shape)."""
    try:
        return NodeId.parse(state.node_id).group_name
    except ValueError:
        return state.role.value


def _sent_to(decision: Decision) -> str:
    """The node a decision sends its request to: its prefill node, or the decode node it is deflected to."""
    node = decision.prefill_node if decision.route is Route.PREFILL else decision.decode_node
    assert node is not None, "a decision names the node it sends its request to"
    return node


def _handed_to(decision: Decision) -> str:
    """The decode node a prefill-routed decision hands its request to."""
    assert decision.decode_node is not None, "a decision names its decode node"
    return decision.decode_node


class RouterActor:
    """The router's state, metrics and online refit, behind plain Ray actor calls (one call at a time, in order).

    Ingress replicas and engines call it directly through a ``RouterLink``,
    over its TCP line (``serve.wire``: ``decide_many`` and ``report``), or as
    plain actor calls: both cost a fraction of a Serve handle call, and the
    router takes every decision and report of the cluster. ``wire`` makes it
    an async actor, so every method, and every call on the line, runs on the
    actor's one event loop; none but ``wire`` awaits, so each runs whole, one
    after another: the ledger needs no lock.
    """

    def __init__(self, config: KairosConfig, options: RouterOptions) -> None:
        self.config = config
        self.model = self.config.predictor.load()
        self.hardware = self.config.predictor.hardware()  # read once: every refit rebuilds the policy
        # node group name -> its own profile's model (``PoolConfig.profile``): its nodes are priced with it, scaled
        # to each node's steps, and left out of the refit of the predictor's model, which prices every other node
        self.group_models = {
            group: StepLatencyModel.load(resolve_profile(profile)) for group, profile in options.group_profiles
        }
        policy = self.config.build_policy(model=self.model, hardware=self.hardware)
        self.state = RouterState(
            policy, handoff_ttl_s=options.handoff_ttl_s, shard=options.shard, shards=options.shards
        )
        self.metrics = RouterMetrics()
        self.refit = OnlineRefit(options.refit_every_steps) if options.refit_every_steps else None
        every = options.refit_every_steps
        self.scales = NodeScales(min(every, NODE_EVERY)) if every else None  # each node's speed on the pool's model
        self.tcp_line = options.tcp_line
        self._server: WireServer | None = None
        self._wire: asyncio.Future[WireAddress] | None = None
        self._live: tuple[float, RouterLive] | None = None  # the last live view and when it was built
        if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:  # its own process only
            freeze_startup_heap("router", logger)

    async def wire(self) -> WireAddress:
        """The address of the actor's TCP line (``serve.wire``), opened on the node's IP at the first ask."""
        if not self.tcp_line:
            raise LineOff("the app's serving.router_tcp is false")
        if self._wire is None:
            self._server = WireServer({"decide_many": self.decide_many, "report": self.report})
            host = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
            self._wire = asyncio.ensure_future(self._server.open(host))
        return await asyncio.shield(self._wire)

    def ping(self) -> None:
        """Answers while the actor's thread is free (the ``Router`` replica's health check)."""

    def decide_many(self, requests: list[DecisionRequest]) -> list[RoutingReply]:
        """Decide requests in order, each seeing the ones before in the ledger, on the nodes each does not avoid.

        A request the router cannot decide yet (a pool has not reported) gets
        ``RoutingReply.fallback_for`` with the reason, as the ingress would.
        """
        replies = []
        for r in requests:
            start = time.perf_counter()
            try:
                decision, staleness = self.state.decide(
                    r.request_id,
                    r.prompt_tokens,
                    r.output_tokens,
                    time.monotonic(),
                    r.avoid,
                    r.block_ids,
                    r.priority,
                    r.sheddable,
                    r.held_on,
                    r.shards,
                )
            except MissingState as exc:
                replies.append(RoutingReply.fallback_for(str(exc)))
                continue
            decision_s = time.perf_counter() - start
            self.metrics.decided(decision, decision_s, staleness)
            decode_model = self._priced_with(decision.decode_node)
            block_tokens = self.state.block_tokens
            replies.append(
                RoutingReply(decision, decision_s, staleness, block_tokens=block_tokens, decode_model=decode_model)
            )
        return replies

    def _priced_with(self, node_id: str | None) -> StepLatencyModel | None:
        """The linear model the router prices ``node_id`` with (None: no such node, or a model of another kind)."""
        state = self.state.states.get(node_id) if node_id is not None else None
        model = self.state.policy.model_of(state.view) if state is not None else None
        return model if isinstance(model, StepLatencyModel) else None

    def report(self, state: NodeState) -> None:
        group = _group_of(state)
        own = self.group_models.get(group)
        if self.scales is not None and state.steps:
            self._calibrate(state, group, own or self.model)
        state = self._priced(state, group)
        self.state.report(state, time.monotonic())
        self.metrics.node(priced_by(state, self.state.policy.model_of(state.view)))
        if self.refit is not None and own is None:
            self.refit.add(state.steps)
            if self.refit.due:
                self._refit()

    def _priced(self, state: NodeState, group: str) -> NodeState:
        """``state`` of a node of ``group`` priced with the model the router prices the node with now: its group's
        profile or the pool's, scaled to the node by ``refit.NodeScales`` (the view's model None for the pool's own,
        the policy's)."""
        base = self.group_models.get(group) or self.model
        model: StepLatencyModel | None = (
            self.scales.model_for(state.node_id, group, base) if self.scales is not None else base
        )
        if model is self.model:
            model = None
        return state if state.view.model is model else replace(state, view=replace(state.view, model=model))

    def _reprice(self, states: Iterable[NodeState]) -> None:
        """Price these nodes' last reports with the models in use now, once a refit or a calibration changed them:
        a node that has not reported since would otherwise be ranked against its siblings with a scale fitted
        against another model."""
        for state in list(states):
            priced = self._priced(state, _group_of(state))
            if priced is not state:
                self.state.reprice(priced)

    def _calibrate(self, state: NodeState, group: str, base: StepLatencyModel) -> None:
        """Keep the node's steps for ``refit.NodeScales``, which scales its group's ``base`` to them; a scale
        adopted moves its group's too, which the group's nodes without their own are priced with."""
        assert self.scales is not None
        node, scales = state.node_id, self.scales
        regrouped: set[str] = set()  # groups whose median scale moved
        if len(scales) > len(self.state.states):
            for gone in set(scales.nodes()) - set(self.state.states):
                regrouped.add(scales.group_of(gone))
                scales.forget(gone)  # nodes that left the view
        result = scales.add(node, group, state.steps, base)
        if result is not None and result.model is not None:
            logger.info(
                "kairos calibration of %s: step-latency MAPE %.1f %% -> %.1f %% (x %.2f of its group's model)",
                node, 100 * result.current_mape, 100 * result.refit_mape, scales.scale[node],
            )  # fmt: skip
            regrouped.add(group)
        if regrouped:
            self._reprice(
                s for s in self.state.states.values() if s.node_id not in scales.scale and _group_of(s) in regrouped
            )

    def _refit(self) -> None:
        """Adopt a model refit on the reported steps when it predicts them better (both pools' model)."""
        assert self.refit is not None
        result = self.refit.refit(self.model)
        self.metrics.prediction_error(result.current_mape)
        if result.model is not None:
            logger.info(
                "kairos refit: step-latency MAPE %.1f %% -> %.1f %% on %d reported steps",
                100 * result.current_mape, 100 * result.refit_mape, self.refit.num_samples,
            )  # fmt: skip
            self.model = result.model
            if self.scales is not None:
                self.scales.reset()
            self.state.policy = self.config.build_policy(
                self.state.policy.spec, model=self.model, hardware=self.hardware
            )
            self._reprice(self.state.states.values())
            self.metrics.refits.inc()

    def live(self) -> RouterLive:
        """Every live node's last report and the last minute's steps and decisions (``serve.live``).

        Built at most every ``LIVE_REFRESH_S`` (callers in between get the last one): with full windows it
        costs the actor's one loop, which every decision waits for, far more than a decision does.
        """
        now = time.monotonic()
        if self._live is not None and now - self._live[0] < LIVE_REFRESH_S:
            return self._live[1]
        self.state.forget_silent_nodes(now)
        states = {node: (state, self.state.received[node]) for node, state in self.state.states.items()}
        live = self.metrics.window.live(self.state.policy.spec, states, now)
        self._live = (now, live)
        return live

    def prefix_hits(self, block_ids: dict[int, tuple[int, ...]], prompt_tokens: int) -> dict[str, int]:
        """Each node's cached prefix of such a prompt, as the router's mirrors hold it (for tests and debugging)."""
        hits = self.state.hits(block_ids, prompt_tokens)
        return dict(hits.tokens_by_node) if hits else {}

    def snapshot(self) -> dict[str, NodeState]:
        """The last state of every live node (for tests and debugging)."""
        self.state.forget_silent_nodes(time.monotonic())
        return dict(self.state.states)

    def use_policy(self, spec: str) -> str:
        """Decide with the policy ``spec`` names from now on, on the configured model and knobs (what the online
        refit and the nodes' calibrations adopted so far are dropped, and both start over); the spec before.

        For what-if runs on a live app, and for tests that share one app across policies: each starts from the
        same router, whatever ran before.
        """
        before = self.state.policy.spec
        self.model = self.config.predictor.load()
        if self.refit is not None:
            self.refit = OnlineRefit(self.refit.every)
        if self.scales is not None:
            self.scales = NodeScales(self.scales.every, self.scales.window)
        self.state.policy = self.config.build_policy(spec, model=self.model, hardware=self.hardware)
        self._reprice(self.state.states.values())
        return before

    def residue(self) -> Residue:
        """What the router keeps per request (``messages.Residue``); its ledger expires as it would at a decision."""
        now = time.monotonic()
        self.state.forget_silent_nodes(now)
        self.state.expire(now)
        shard = self.state.shard
        return Residue("router" if shard == 0 else f"router-{shard}", self.state.residue())


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=1024,
    ray_actor_options={"num_cpus": 0},
    health_check_period_s=HEALTH_CHECK_PERIOD_S,
    health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
    logging_config={"enable_access_log": False},
)
class Router:
    """The router's Serve deployment (one replica): it owns the ``RouterActor`` and hands out its handle.

    The actor is this replica's child, so it goes when the replica goes; when
    the actor dies or hangs, the health check fails and Serve replaces the
    replica, which starts a new one. Callers hold the actor's handle
    (``serve.router_link``) and ask for it again after a failed call. The
    methods below forward to the actor for tools and tests.
    """

    async def __init__(self, config: KairosConfig, options: RouterOptions) -> None:  # type: ignore[misc]
        """Serve awaits an async constructor: the replica is ready once its actor answers."""
        actor: Any = ray.remote(num_cpus=0, max_restarts=0)(RouterActor)  # an actor class, untyped by Ray
        self.actor = actor.options(name=f"kairos-router-{uuid.uuid4().hex[:8]}").remote(config, options)
        await self.actor.ping.remote()  # the replica is ready once its actor is (its process started, config loaded)

    async def handle(self) -> Any:
        """The ``RouterActor``'s handle."""
        return self.actor

    async def check_health(self) -> None:
        await asyncio.wait_for(self.actor.ping.remote(), ACTOR_PING_TIMEOUT_S)

    async def live(self) -> RouterLive:
        live: RouterLive = await self.actor.live.remote()
        return live

    async def prefix_hits(self, block_ids: dict[int, tuple[int, ...]], prompt_tokens: int) -> dict[str, int]:
        hits: dict[str, int] = await self.actor.prefix_hits.remote(block_ids, prompt_tokens)
        return hits

    async def snapshot(self) -> dict[str, NodeState]:
        states: dict[str, NodeState] = await self.actor.snapshot.remote()
        return states

    async def residue(self) -> Residue:
        residue: Residue = await self.actor.residue.remote()
        return residue

    async def use_policy(self, spec: str) -> str:
        before: str = await self.actor.use_policy.remote(spec)
        return before
