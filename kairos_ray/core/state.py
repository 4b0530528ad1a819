"""Snapshots of cluster state that policies decide on, and the decisions they return.

All are frozen, slotted dataclasses: a policy reads a ``ClusterView`` and
returns a ``Decision``; it never mutates state. ``apply_decision`` is the
router's ledger step: it returns the view as it will be once the decision is
dispatched, so a burst of requests sees its own earlier decisions at once
(Algorithm 1 is evaluated per queued request against the current state).

With prefix caching a node computes only the part of a prompt its cache does
not hold: queued prompts and committed schedules count uncached tokens, and
``queued_cached_tokens`` / ``committed_cached_tokens`` give the cached
context each one starts from (the first chunk's own prefix P in Eq. 4). Both
are empty when nothing cached is queued, so a cold view is what it always was.

A decode node also counts the hand-offs bound for it that are not decoding
yet (``incoming_requests``: in a prefill queue, prefilling, in KV transfer,
or waiting for a slot) and the KV they will reserve there
(``incoming_kv_tokens``: prompt and output), of which their prompts are
resident once they join (``incoming_prompt_tokens``, Eq. 4's K): they will
join its batch, so a router choosing where to send the next hand-off must
see them; of those, the ones whose KV has not arrived yet
(``incoming_transfers``) still send what the node lacks of their prompts
over its link (``incoming_transfer_tokens``). Nothing else counts them:
the decode node's Eq. 5 guard checks each chunk against the batch it runs
in, so Eq. 5 and 6 price B_n as it is now, and a deflection's KV room is
what is free now (a hand-off may wait in a prefill queue for minutes).

Each node may carry its own step-latency model (``model``: a fleet of mixed
GPUs, or a node's own refit); a policy prices it with that, and a node
without one with its pool's model (the policy's).

A decision may carry admission's verdict (``Admission``, ``core.admission``):
a shed request is answered at once and dispatched nowhere, so the ledger
steps (``apply_decision``, ``node_after``) leave every node as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import overload

from kairos_ray.core.latency import StepLatency


class Route(StrEnum):
    """Where a request's prefill runs."""

    PREFILL = "prefill"  # on a prefill node, KV then shipped to a decode node
    DEFLECT = "deflect"  # chunked, in place on a decode node (no KV transfer)


@dataclass(frozen=True, slots=True)
class PrefillNodeView:
    """A prefill node as the router sees it."""

    node_id: str
    queued_prompt_tokens: tuple[int, ...] = ()  # prompt tokens still to prefill per queued request, FIFO order
    head_prefilled_tokens: int = 0  # tokens of the head request prefilled here so far, beyond its cache hit
    queued_cached_tokens: tuple[int, ...] = ()  # per queued request, its prompt tokens the cache held; () if none
    model: StepLatency | None = None  # this node's step-latency model (Eq. 4); None: its pool's, the policy's

    def context_tokens(self, index: int) -> int:
        """Tokens of queued request ``index``'s prompt already in KV: its first chunk's own prefix."""
        cached = self.queued_cached_tokens[index] if index < len(self.queued_cached_tokens) else 0
        return cached + self.head_prefilled_tokens if index == 0 else cached

    @property
    def num_queued(self) -> int:
        return len(self.queued_prompt_tokens)


@dataclass(frozen=True, slots=True)
class DecodeNodeView:
    """A decode node as the router sees it."""

    node_id: str
    batch_size: int  # B_n: requests decoding now
    kv_tokens: int  # K_n: KV tokens resident now
    free_kv_tokens: int  # KV capacity not yet used, in tokens
    committed: tuple[tuple[int, ...], ...] = ()  # remaining chunk schedules of deflections in flight, run order
    head_prefilled_tokens: int = 0  # prompt tokens the first committed deflection has prefilled (its chunks' prefix)
    # per committed deflection, its prompt tokens this node's cache held (() if none); they join kv_tokens with
    # the deflection's first chunk, so K counts the head's once head_prefilled_tokens > 0
    committed_cached_tokens: tuple[int, ...] = ()
    incoming_requests: int = 0  # prefill-routed requests bound here, not decoding yet: they will join B_n
    incoming_kv_tokens: int = 0  # the KV they will reserve here when they join: prompt and output
    incoming_prompt_tokens: int = 0  # of that, their prompts: resident once they join (Eq. 4's K), output to come
    incoming_transfers: int = 0  # of them, those whose KV has not arrived here yet
    incoming_transfer_tokens: int = 0  # the KV those still send over this node's link: their prompts less its cache
    finished_per_s: float = 0.0  # requests finishing here per second, measured over its recent finishes (0: unknown)
    model: StepLatency | None = None  # this node's step-latency model (Eq. 4); None: its pool's, the policy's
    # ``committed_tokens`` once asked (-1: not yet): a policy asks it of every node several times per decision,
    # and a burst's ledger commits hundreds of schedules; ``replace`` makes a new view, which asks afresh
    _committed_tokens: int = field(default=-1, init=False, repr=False, compare=False)

    @property
    def committed_tokens(self) -> int:
        """Prompt tokens that committed deflections will still add to the KV cache."""
        if self._committed_tokens < 0:
            object.__setattr__(self, "_committed_tokens", sum(map(sum, self.committed)) if self.committed else 0)
        return self._committed_tokens

    @property
    def headroom_kv_tokens(self) -> int:
        """Free KV once committed deflections have been prefilled."""
        return self.free_kv_tokens - self.committed_tokens

    @property
    def with_bound(self) -> tuple[int, int]:
        """(B, K) once the hand-offs bound here have joined: their prompts resident (Eq. 4's K), outputs to come."""
        return self.batch_size + self.incoming_requests, self.kv_tokens + self.incoming_prompt_tokens


@dataclass(frozen=True, slots=True)
class ClusterView:
    """Everything a policy may look at for one decision."""

    prefill: tuple[PrefillNodeView, ...]
    decode: tuple[DecodeNodeView, ...]
    # node id -> (pool, position), built once asked; a view ``apply_decision`` derives shares it (same order)
    _positions: dict[str, tuple[int, int]] | None = field(default=None, init=False, repr=False, compare=False)

    def position(self, node_id: str | None) -> tuple[int, int] | None:
        """(0 for prefill or 1 for decode, index in that pool) of a node of this view, or None."""
        if node_id is None:
            return None
        if self._positions is None:
            positions = {node.node_id: (0, i) for i, node in enumerate(self.prefill)}
            positions.update((node.node_id, (1, i)) for i, node in enumerate(self.decode))
            object.__setattr__(self, "_positions", positions)
        assert self._positions is not None
        return self._positions.get(node_id)


class ShedReason(StrEnum):
    """Why admission shed a request (``Admission.reason``)."""

    NO_ROUTE_IN_TIME = "no-route-in-time"  # no route's estimated TTFT is within the objective (times the slack)
    PRIORITY = "priority"  # in time, but past the share of the objective its priority class may use


@dataclass(frozen=True, slots=True)
class Admission:
    """Admission's verdict on one request (``core.admission.judge``): what the answer to a shed request needs."""

    admitted: bool
    reason: ShedReason | None  # why it was shed; None when admitted
    ttft_estimate_s: float  # the estimated TTFT judged: the chosen route's, its KV wait included
    threshold_s: float  # the estimate its priority class is admitted up to (inf: a never-shed class)
    retry_after_s: float  # shed: estimated seconds until the work ahead has drained to threshold_s; 0 when admitted

    def overruled(self) -> Admission:
        """This verdict turned into an admission (a request that must not be shed: the retry of an admitted one)."""
        return replace(self, admitted=True, reason=None, retry_after_s=0.0)


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's answer for one request (Algorithm 1 output, plus the estimates behind it)."""

    route: Route
    prefill_node: str | None  # prefill node id for Route.PREFILL, else None
    decode_node: str | None  # decode node that streams the tokens (None only when the cluster has none)
    chunk_schedule: tuple[int, ...]  # X*: chunk sizes for Route.DEFLECT, empty otherwise
    # estimated TTFT on the best prefill node (Eq. 1), None without prefill nodes; with admission on carried on to
    # the first token: the KV's wait and transfer and a decode step (``core.admission.handoff_ttft_s``)
    ttft_prefill_s: float | None
    ttft_decode_s: float | None  # estimated TTFT on the chosen/best decode node (Eq. 6), None if none feasible
    reason: str  # short, human-readable
    cached_prompt_tokens: int = 0  # prompt tokens the prefilling node holds (priced as cached; 0 if cache-blind)
    receiver_cached_tokens: int = 0  # Route.PREFILL: prompt tokens the decode node holds (their KV need not travel)
    # Route.PREFILL under decode-side protection: estimated wait of its KV on the prefill node for a decode node
    # that can take it (``core.admission.kv_wait_s``); ttft_prefill_s includes it
    kv_wait_s: float = 0.0
    admission: Admission | None = None  # admission's verdict; None when admission is off

    @property
    def deflected(self) -> bool:
        return self.route is Route.DEFLECT

    @property
    def shed(self) -> bool:
        """Admission shed the request: it is answered at once and dispatched nowhere."""
        return self.admission is not None and not self.admission.admitted


def apply_decision(view: ClusterView, prompt_tokens: int, decision: Decision, output_tokens: int = 0) -> ClusterView:
    """The view after ``decision`` is dispatched, before any engine reports back.

    A prefill-routed request joins the tail of its prefill node's FIFO with
    the tokens its cache does not hold, and its decode node's incoming
    hand-offs, with the KV it will reserve there for its prompt and output
    when it joins the batch (the prompt's blocks that node holds included:
    held by no request, they leave its free list then); a deflected one
    commits its chunk schedule (the uncached suffix) to its decode node,
    behind the deflections already there, and reserves KV for its
    ``output_tokens`` there at once (its new prompt KV is the schedule
    itself), as a decode node does when it takes the request. The cached
    prefix (``decision.cached_prompt_tokens``) is charged nowhere on the
    node that computes the prompt: it is in that node's cache already, so
    charging it would count it twice. A hit on blocks no request holds takes them off the
    node's free list; the node's next report shows that. A shed decision changes nothing.
    """
    if decision.shed:
        return view
    decided = ((prompt_tokens, decision, output_tokens),)
    changed = []
    for node_id in {decision.prefill_node, decision.decode_node}:  # the only nodes a decision changes
        at = view.position(node_id)
        if at is not None:
            node = (view.prefill, view.decode)[at[0]][at[1]]
            changed.append(node_after(node, decided))
    after = with_nodes(view, changed)
    assert after is not None, "nodes of the view"
    return after


def with_nodes(view: ClusterView, nodes: Iterable[PrefillNodeView | DecodeNodeView]) -> ClusterView | None:
    """``view`` with these nodes' views in the places of the nodes of the same ids (None if one is not in it):
    O(changed nodes) where rebuilding the view is O(fleet), and unchanged nodes stay the same objects, which a
    policy's index (``core.index``) takes as unchanged."""
    pools: list[list[PrefillNodeView | DecodeNodeView]] | None = None
    for node in nodes:
        at = view.position(node.node_id)
        if at is None or isinstance(node, DecodeNodeView) != (at[0] == 1):
            return None
        if pools is None:
            pools = [list(view.prefill), list(view.decode)]
        pools[at[0]][at[1]] = node
    if pools is None:
        return view
    after = ClusterView(tuple(pools[0]), tuple(pools[1]))  # type: ignore[arg-type]
    object.__setattr__(after, "_positions", view._positions)
    return after


@overload
def node_after(node: PrefillNodeView, decided: Iterable[tuple[int, Decision, int]]) -> PrefillNodeView: ...
@overload
def node_after(node: DecodeNodeView, decided: Iterable[tuple[int, Decision, int]]) -> DecodeNodeView: ...
@overload
def node_after(
    node: PrefillNodeView | DecodeNodeView, decided: Iterable[tuple[int, Decision, int]]
) -> PrefillNodeView | DecodeNodeView: ...
def node_after(
    node: PrefillNodeView | DecodeNodeView, decided: Iterable[tuple[int, Decision, int]]
) -> PrefillNodeView | DecodeNodeView:
    """``node`` after the decisions ``decided`` (prompt tokens, decision, output tokens), in order.

    Each decision changes the node as ``apply_decision`` says; all of them
    in one pass, O(decisions), where applying them one by one would copy the
    node's queue (or committed schedules) once per decision. The router
    rebuilds a node from its last report and its ledger entries with it;
    ``apply_decision`` applies one decision to every node of a view.
    """
    if isinstance(node, PrefillNodeView):
        queued: list[int] = []
        cached: list[int] = []
        for prompt_tokens, decision, _ in decided:
            if decision.route is Route.PREFILL and decision.prefill_node == node.node_id and not decision.shed:
                queued.append(prompt_tokens - decision.cached_prompt_tokens)
                cached.append(decision.cached_prompt_tokens)
        if not queued:
            return node
        return replace(
            node,
            queued_prompt_tokens=(*node.queued_prompt_tokens, *queued),
            queued_cached_tokens=_extended(node.queued_cached_tokens, node.num_queued, cached),
        )
    committed: list[tuple[int, ...]] = []
    committed_cached: list[int] = []
    incoming = incoming_kv = incoming_prompt = transfer = reserved = 0
    for prompt_tokens, decision, output_tokens in decided:
        if decision.decode_node != node.node_id or decision.shed:
            continue
        if decision.route is Route.PREFILL:
            incoming += 1
            incoming_kv += prompt_tokens + output_tokens
            incoming_prompt += prompt_tokens
            transfer += prompt_tokens - decision.receiver_cached_tokens
        else:
            committed.append(decision.chunk_schedule)
            committed_cached.append(decision.cached_prompt_tokens)
            reserved += output_tokens
    if not (incoming or committed):
        return node
    return replace(
        node,
        committed=(*node.committed, *committed),
        committed_cached_tokens=(
            _extended(node.committed_cached_tokens, len(node.committed), committed_cached)
            if committed
            else node.committed_cached_tokens
        ),
        free_kv_tokens=node.free_kv_tokens - reserved,
        incoming_requests=node.incoming_requests + incoming,
        incoming_kv_tokens=node.incoming_kv_tokens + incoming_kv,
        incoming_prompt_tokens=node.incoming_prompt_tokens + incoming_prompt,
        incoming_transfers=node.incoming_transfers + incoming,
        incoming_transfer_tokens=node.incoming_transfer_tokens + transfer,
    )


def _extended(cached: tuple[int, ...], length: int, values: Sequence[int]) -> tuple[int, ...]:
    """``cached`` (aligned with a queue of ``length``, () meaning all 0) with ``values`` for new tail entries."""
    if not cached and not any(values):
        return ()
    return (*cached, *(0,) * (length - len(cached)), *values)
