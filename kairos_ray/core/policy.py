"""Routing policies behind one interface, ``decide(prompt_tokens, view, hits, priority, output_tokens) -> Decision``.

- ``kairos``: Algorithm 1. Estimate TTFT on the best prefill node (Eq. 1-2);
  for every decode node with KV room, build the LargestSafe schedule (Eq. 5)
  behind the deflections already committed there and price it (Eq. 6); take
  the fastest feasible node n*, and deflect only when it beats the prefill path
  by the margin alpha: alpha * TTFT_dec(n*) < TTFT_pf.
- ``oracle``: Algorithm 1 deciding with the noise-free ground truth rather
  than the fitted predictor (the paper's Oracle row): the caller passes the
  ground truth as the model, which only an emulator has.
- ``pd``: plain disaggregation, never deflects.
- ``sq:<theta>``: deflects when the shortest prefill queue holds >= theta requests.
- ``sl:<tokens>``: deflects prompts of at most that many tokens.

The static ``sq`` and ``sl`` policies check no TBT budget (the paper's Table 4
baselines): they deflect with fixed chunks of ``static_chunk_tokens`` to the
decode node that would finish the prefill first, among those with KV room.

Every policy sends a prefill-routed request to the prefill node with the
least estimated TTFT and names the decode node its KV reaches first, among
those with KV room for it and a decode step inside beta * tau with it.

With admission on (``PolicyParams.admission``, ``core.admission``) every
policy also protects the decode side and prices each route to its first
token. A deflection is planned (Eq. 5, 6) for the batch it will run beside,
the hand-offs bound to the node included (they are ahead of it in line for
that batch), and needs that batch's decode step to stay within beta * tau
once the request has joined it. A prefill-routed request goes to the decode
node where its estimated first token comes first, its KV's wait for that
node, the transfer and a decode step included (``Decision.kv_wait_s``,
``ttft_prefill_s``). ``kairos`` deflects whenever only the decode path is in
time, whatever alpha says. The decision then carries admission's verdict
(``Decision.admission``).
``make_policy`` maps spec strings (``"kairos"``, ``"sq:4"``...) to policies so
the simulator, the Serve router and the CLI share them. A policy says whether
decode nodes re-check each planned chunk when it runs (``guards_chunks``, Eq.
5 at run time) and hands out that check (``chunk_guard``), built from the
model it decides with.

Prefix-aware (``PolicyParams.prefix_aware``, or a spec ending in ``+prefix``;
``+blind`` turns it off): given ``PrefixHits``, the leading prompt tokens each
node's cache holds (``core.prefix``), every estimate prices only a node's
uncached suffix from the cached context (Eq. 1-2 on prefill nodes; Eq. 5's
schedule and Eq. 6 on decode nodes), a deflection needs KV room for that
suffix only, ``sl`` compares its threshold with the smallest suffix on a
decode node, and a prefill-routed request's transfer counts only what its
decode node does not hold (those blocks count as KV room there too). alpha
and beta are unchanged. A cache-blind policy ignores ``hits``: it prices the
whole prompt everywhere. Either way, given ``hits``, a prefill-routed
decision names the prompt tokens its decode node holds
(``Decision.receiver_cached_tokens``): the hand-off leaves their KV out, as
the simulator's does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Protocol

import kairos_ray.core.index as index_module
from kairos_ray.core.admission import (
    AdmissionParams,
    JoinGuard,
    handoff_fits,
    handoff_ttft_s,
    join_guard,
    joined_step_fits,
    judge,
    kv_wait_s,
)
from kairos_ray.core.estimate import (
    PREFILL_ESTIMATORS,
    PREFILL_PARTS,
    PrefillEstimatorName,
    QueueWalks,
    runs_s,
)
from kairos_ray.core.index import (
    SAFETY,
    DecodeIndex,
    Floor,
    PrefillIndex,
    bounded,
    deflection_bound_s,
    link_tokens,
    planned_beside,
)
from kairos_ray.core.latency import StepLatency, StepLatencyModel
from kairos_ray.core.prefix import PrefixHits
from kairos_ray.core.state import ClusterView, Decision, DecodeNodeView, PrefillNodeView, Route
from kairos_ray.core.sweep import Runs, expand, largest_safe_chunk, largest_safe_runs


@dataclass(frozen=True, slots=True)
class PolicyParams:
    """Knobs shared by all policies (validated at the edge by ``kairos_ray.config``)."""

    prefill_chunk_tokens: int = 2048  # chi_p, the prefill nodes' chunk size
    chunk_candidates: tuple[int, ...] = (2048, 1024, 512, 256, 128, 64)  # chi_1 > ... > chi_C
    tbt_slo_s: float = 0.07  # tau
    alpha: float = 1.2  # deflection margin, >= 1
    beta: float = 0.9  # TBT safety factor: steps must fit beta * tau
    prefill_estimator: PrefillEstimatorName = "exact"  # key of PREFILL_ESTIMATORS
    static_chunk_tokens: int = 512  # fixed chunk of the sq/sl baselines
    prefix_aware: bool = True  # price only each node's uncached suffix, given PrefixHits (module docstring)
    handoff_setup_tokens: int = 0  # a KV transfer's fixed cost, in tokens its link could carry meanwhile
    handoff_tokens_per_s: float = 0.0  # KV tokens a decode node's link carries per second (0: transfers unpriced)
    admission: AdmissionParams = field(default_factory=AdmissionParams)  # shed what no route serves in time
    prune: bool = True  # price only the nodes that can still win (``core.index``): the same decisions, sooner

    @property
    def tbt_budget_s(self) -> float:
        return self.beta * self.tbt_slo_s


Guard = Callable[[int, int, int, int], int]
"""(B, K, planned chunk, its own prefix) -> chunk to run this step (0: none): Eq. 5 checked when the chunk runs."""


def chunk_guard(model: StepLatency, params: PolicyParams) -> Guard:
    """The decode node's run-time check of a planned chunk (Eq. 5 at run time; ``sweep.largest_safe_chunk``)."""

    def guard(batch_size: int, kv_tokens: int, planned: int, prefix_tokens: int) -> int:
        return largest_safe_chunk(
            model, batch_size, kv_tokens, planned, params.chunk_candidates, params.tbt_budget_s, prefix_tokens
        )

    return guard


class Policy(Protocol):
    """A routing policy: pure, deterministic, never mutates the view."""

    spec: str
    params: PolicyParams
    prefill_model: StepLatency  # the step-latency model it prices prefill nodes with (Eq. 1-2) ...
    decode_model: StepLatency  # ... and decode nodes (Eq. 4-6), where a node's view carries none of its own
    guards_chunks: bool  # decode nodes re-check each planned chunk when it runs (Eq. 5 at run time)
    decides_with_ground_truth: bool  # the caller must pass the emulator's ground truth as the model

    def decide(
        self,
        prompt_tokens: int,
        view: ClusterView,
        hits: PrefixHits | None = None,
        priority: int = 0,
        output_tokens: int = 0,
    ) -> Decision:
        """Route one request of ``prompt_tokens`` tokens given the current view and, if known, its prefix hits;
        with admission on, admit or shed it by its ``priority`` (vLLM's: lower is more important). Where it
        decodes it reserves KV for ``output_tokens`` too (the simulator's known lengths, the live app's
        ``max_tokens``): only nodes with room for both take it."""
        ...

    def chunk_guard(self, model: StepLatency | None = None) -> Guard | None:
        """The run-time chunk check decode nodes apply under this policy, or None (``guards_chunks`` false);
        ``model``: the node's own step-latency model (default: the pool's, ``decode_model``)."""
        ...

    def join_guard(self, model: StepLatency | None = None) -> JoinGuard | None:
        """The check a decode node applies before a hand-off joins its batch, or None (admission off); ``model``
        as for ``chunk_guard``."""
        ...

    def model_of(self, node: PrefillNodeView | DecodeNodeView) -> StepLatency:
        """The model it prices ``node`` with: the node's own, else its pool's."""
        ...


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Thresholds for ``sq`` and ``sl`` when their spec names none (``"sq"`` rather than ``"sq:4"``)."""

    sq_queued_requests: int = 1
    sl_prompt_tokens: int = 1024


@dataclass(frozen=True, slots=True)
class _PrefillOption:
    """The best prefill node for one request."""

    node: PrefillNodeView
    ttft_s: float  # Eq. 1; with admission on the hand-off's to its first token (core.admission.handoff_ttft_s)
    cached_tokens: int  # prompt tokens the node's cache holds (as priced)
    kv_wait_s: float  # estimated wait of its KV for a decode node that can take it (0 with admission off)
    target: DecodeNodeView | None  # with admission on, the decode node its KV goes to (``_earliest_handoff``)


SEEDS = 4
"""Nodes of least W a pruned deflection search tries, in order of T0, before its scan (``_deflection_pruned``)."""


@dataclass(frozen=True, slots=True)
class _DecodeOption:
    """A priced deflection onto one decode node."""

    node: DecodeNodeView
    ttft_s: float
    runs: Runs  # the schedule of the uncached suffix
    cached_tokens: int  # prompt tokens the node's cache holds (as priced)


Planner = Callable[[StepLatency, int, int, float, int], "tuple[Runs, float] | None"]
"""(the node's model, B, K, limit_s, cached prompt tokens) -> (runs of the uncached suffix, Eq. 6 seconds),
or None if infeasible or slower than limit_s."""


class _BasePolicy:
    """Shared plumbing: prefill-path estimate, node choice, decision building."""

    spec = ""
    guards_chunks = False
    decides_with_ground_truth = False

    def __init__(self, params: PolicyParams, prefill_model: StepLatency, decode_model: StepLatency) -> None:
        self.params = params
        self.prefill_model = prefill_model
        self.decode_model = decode_model
        self._estimate = PREFILL_ESTIMATORS[params.prefill_estimator]
        self._prefill_walks, self._decode_walks = QueueWalks(), QueueWalks()  # queues priced from their last walk
        queue_s, self._own_prefill = PREFILL_PARTS[params.prefill_estimator]
        chunk = params.prefill_chunk_tokens
        self._prefill_index = PrefillIndex(prefill_model, queue_s, chunk, self._prefill_walks) if params.prune else None
        self._decode_index = (
            DecodeIndex(decode_model, params.admission.on, params.handoff_setup_tokens, self._decode_walks)
            if params.prune and isinstance(decode_model, StepLatencyModel) and bounded(decode_model)
            else None
        )

    @classmethod
    def check_arg(cls, arg: str | None) -> None:
        """Raise ``ValueError`` unless ``arg`` (the part after ``:`` in a spec) suits this policy."""
        if arg is not None:
            raise ValueError(f"policy {cls.spec!r} takes no argument, got {arg!r}")

    @classmethod
    def build(
        cls,
        arg: str | None,
        thresholds: Thresholds,
        params: PolicyParams,
        prefill_model: StepLatency,
        decode_model: StepLatency,
    ) -> _BasePolicy:
        """Construct from a spec's (checked) argument."""
        policy = cls(params, prefill_model, decode_model)
        policy._configure(arg, thresholds)
        return policy

    def _configure(self, arg: str | None, thresholds: Thresholds) -> None:
        """Take the spec's argument; policies without one have nothing to take."""

    def decide(
        self,
        prompt_tokens: int,
        view: ClusterView,
        hits: PrefixHits | None = None,
        priority: int = 0,
        output_tokens: int = 0,
    ) -> Decision:
        if prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
        if output_tokens < 0:
            raise ValueError(f"output_tokens must be >= 0, got {output_tokens}")
        if not view.prefill or not view.decode:
            raise ValueError(
                f"cluster view needs at least one prefill and one decode node, "
                f"has {len(view.prefill)} prefill and {len(view.decode)} decode"
            )
        if hits is not None:
            hits = hits.within(prompt_tokens)
        admission = self.params.admission
        in_time_s = admission.threshold_s(priority) if admission.on else math.inf
        decision = self._decide(
            prompt_tokens, output_tokens, view, hits if self.params.prefix_aware else None, in_time_s
        )
        if hits is not None and decision.route is Route.PREFILL and decision.decode_node is not None:
            # the hand-off leaves out what its decode node holds, whether or not the estimates priced it
            held = hits.at(decision.decode_node)
            if held:
                decision = replace(decision, receiver_cached_tokens=held)
        if admission.on:
            decision = replace(decision, admission=judge(admission, decision, priority))
        return decision

    def _decide(
        self, prompt_tokens: int, output_tokens: int, view: ClusterView, hits: PrefixHits | None, in_time_s: float
    ) -> Decision:
        """Decide with ``hits`` None when cache-blind; ``output_tokens``: the KV the request reserves where it decodes
        besides its prompt; ``in_time_s``: the estimate admission admits up to (inf when admission is off)."""
        raise NotImplementedError

    def chunk_guard(self, model: StepLatency | None = None) -> Guard | None:
        return chunk_guard(model or self.decode_model, self.params) if self.guards_chunks else None

    def join_guard(self, model: StepLatency | None = None) -> JoinGuard | None:
        if not self.params.admission.on:
            return None
        return join_guard(model or self.decode_model, self.params.tbt_budget_s)

    def model_of(self, node: PrefillNodeView | DecodeNodeView) -> StepLatency:
        return node.model or (self.prefill_model if isinstance(node, PrefillNodeView) else self.decode_model)

    def _best_prefill(
        self, prompt_tokens: int, output_tokens: int, view: ClusterView, hits: PrefixHits | None
    ) -> _PrefillOption:
        """Prefill node with the least estimated TTFT for this request (Eq. 1); with admission on, carried on to
        the first token on its hand-off target: its KV's wait, its transfer, a decode step
        (``core.admission.handoff_ttft_s``). Ties go to the node first in the view."""
        index = self._prefill_index
        if index is not None and (len(view.prefill) < index_module.MIN_NODES or not index.sync(view.prefill)):
            index = None
        if index is None:
            best, best_s, best_cached = self._priced_prefill(prompt_tokens, view, hits)
        else:
            best, best_s, best_cached = self._indexed_prefill(prompt_tokens, view, hits, index)
        option = _PrefillOption(best, best_s, best_cached, 0.0, None)
        if not self.params.admission.on:
            return option
        return self._earliest_handoff(prompt_tokens, output_tokens, view, hits, option)

    def _indexed_decode(self, view: ClusterView) -> DecodeIndex | None:
        """The decode index brought to ``view``, or None where its nodes are priced one by one (``core.index``:
        a small pool, a model without bounds, a view most of whose nodes are new)."""
        index = self._decode_index
        if index is None or len(view.decode) < index_module.MIN_NODES or not index.sync(view.decode):
            return None
        return index

    def _priced_prefill(
        self, prompt_tokens: int, view: ClusterView, hits: PrefixHits | None
    ) -> tuple[PrefillNodeView, float, int]:
        """(node, Eq. 1 seconds, cached tokens) of the best prefill node, every node priced."""
        chunk = self.params.prefill_chunk_tokens
        best, best_s, best_cached = view.prefill[0], math.inf, 0
        for node in view.prefill:
            cached = hits.at(node.node_id) if hits else 0
            seconds = self._estimate(self.model_of(node), node, prompt_tokens, chunk, cached, self._prefill_walks)
            if seconds < best_s:
                best, best_s, best_cached = node, seconds, cached
        return best, best_s, best_cached

    def _indexed_prefill(
        self, prompt_tokens: int, view: ClusterView, hits: PrefixHits | None, index: PrefillIndex
    ) -> tuple[PrefillNodeView, float, int]:
        """``_priced_prefill`` from the index: the nodes holding part of the prompt priced, of the others, per
        model, the least queue wait (and any node whose estimate rounds to the same seconds, for the tie rule)."""
        chunk, own = self.params.prefill_chunk_tokens, self._own_prefill
        held = index.held(hits.tokens_by_node if hits else None)
        best, best_s, best_cached = -1, math.inf, 0
        for position, cached in held.items():
            seconds = index.waits[position] + own(index.models[position], prompt_tokens, cached, chunk)
            if (seconds, position) < (best_s, best):
                best, best_s, best_cached = position, seconds, cached
        for model, by_wait in index.by_wait.items():
            cold_s = own(model, prompt_tokens, 0, chunk)
            for wait_s, position in by_wait.pairs:
                seconds = wait_s + cold_s
                if seconds > best_s:
                    break
                if position not in held and (seconds, position) < (best_s, best):
                    best, best_s, best_cached = position, seconds, 0
        if best < 0:  # every estimate inf: the first node, as pricing each would
            return view.prefill[0], math.inf, 0
        return view.prefill[best], best_s, best_cached

    def _earliest_handoff(
        self,
        prompt_tokens: int,
        output_tokens: int,
        view: ClusterView,
        hits: PrefixHits | None,
        prefill: _PrefillOption,
    ) -> _PrefillOption:
        """With admission on: ``prefill`` carried on to the decode node where the hand-off's estimated first token
        comes first (``core.admission.handoff_ttft_s``, its KV's wait for that node included); ties go to the
        node first in the view."""
        index = self._indexed_decode(view)
        if index is not None:
            held = index.held(hits.tokens_by_node if hits else None)
        params = self.params
        budget_s, setup, rate = params.tbt_budget_s, params.handoff_setup_tokens, params.handoff_tokens_per_s
        best, best_at = prefill, -1

        def price(position: int, tokens_held: int) -> None:
            nonlocal best, best_at
            node = view.decode[position]
            model = self.model_of(node)
            wait_s = kv_wait_s(model, node, prompt_tokens, budget_s, tokens_held, output_tokens)
            seconds = handoff_ttft_s(model, node, prefill.ttft_s, wait_s, prompt_tokens, tokens_held, setup, rate)
            if best.target is None or (seconds, position) < (best.ttft_s, best_at):
                best, best_at = replace(prefill, ttft_s=seconds, kv_wait_s=wait_s, target=node), position

        if index is None:
            for position, node in enumerate(view.decode):
                price(position, hits.at(node.node_id) if hits else 0)
            return best
        for position, tokens_held in held.items():
            price(position, tokens_held)
        transfer_s = (setup + prompt_tokens) / rate if rate > 0 else 0.0
        for groups in index.groups.values():
            model = groups.model
            floor_s = prefill.ttft_s + transfer_s + model.c0 + model.c_kv * prompt_tokens
            by_first_step = groups.twins.lists[0]
            for first_step_s, group in by_first_step.pairs:
                if best.target is not None and (floor_s + first_step_s[0]) * (1 - SAFETY) > best.ttft_s:
                    break
                first = groups.twins.first_of(group, held)
                if first is not None:
                    price(first, 0)
        return best

    def _fastest_deflection(
        self,
        prompt_tokens: int,
        output_tokens: int,
        view: ClusterView,
        plan: Planner,
        hits: PrefixHits | None,
        prunable: bool = False,
    ) -> tuple[_DecodeOption | None, int, int]:
        """Fastest decode option under ``plan`` (ties: the node first in the view); also counts the nodes short of
        KV and the infeasible ones, exact when no node is feasible. ``prunable``: ``plan`` is Eq. 5's sweep,
        whose times ``core.index`` bounds."""
        index = self._indexed_decode(view) if prunable else None
        if index is None:
            return self._deflection_over(prompt_tokens, output_tokens, view, plan, hits)
        found = self._deflection_pruned(prompt_tokens, output_tokens, plan, hits, index)
        # no node feasible: every node counted, for the reason's counts (the pruned search counts twins once)
        return found if found[0] is not None else self._deflection_over(prompt_tokens, output_tokens, view, plan, hits)

    def _deflection_over(
        self, prompt_tokens: int, output_tokens: int, view: ClusterView, plan: Planner, hits: PrefixHits | None
    ) -> tuple[_DecodeOption | None, int, int]:
        """``_fastest_deflection`` pricing every node, in view order."""
        best: _DecodeOption | None = None
        lacking_kv = infeasible = 0
        protect, budget_s = self.params.admission.on, self.params.tbt_budget_s
        for node in view.decode:
            cached = hits.at(node.node_id) if hits else 0
            if node.headroom_kv_tokens < prompt_tokens - cached + output_tokens:
                lacking_kv += 1
                continue
            model = self.model_of(node)
            wait_s, batch_size, kv_tokens = planned_beside(model, node, protect, self._decode_walks)
            if protect and not joined_step_fits(model, batch_size, kv_tokens, prompt_tokens, budget_s):
                infeasible += 1
                continue
            limit_s = math.inf if best is None else best.ttft_s - wait_s
            if limit_s <= 0.0:
                continue  # already slower than the best before its own first step
            found = plan(model, batch_size, kv_tokens, limit_s, cached)
            if found is None:
                # Only exact while no node is feasible yet, which is when the count is reported.
                infeasible += 1
                continue
            runs, seconds = found
            if best is None or wait_s + seconds < best.ttft_s:
                best = _DecodeOption(node, wait_s + seconds, runs, cached)
        return best, lacking_kv, infeasible

    def _deflection_pruned(
        self, prompt_tokens: int, output_tokens: int, plan: Planner, hits: PrefixHits | None, index: DecodeIndex
    ) -> tuple[_DecodeOption | None, int, int]:
        """``_fastest_deflection`` over the index's groups in order of their bound, model by model
        (``core.index``); the counts are not kept (returned 0)."""
        params = self.params
        protect, budget_s, candidates = params.admission.on, params.tbt_budget_s, params.chunk_candidates
        held = index.held(hits.tokens_by_node if hits else None)
        assert index.nodes is not None
        nodes = index.nodes
        best: _DecodeOption | None = None
        best_at = -1

        def price(position: int, cached: int, bounded: bool = False) -> None:
            """Sweep the node unless its bound (known below the best when ``bounded``) rules it out."""
            nonlocal best, best_at
            entry = index.entries[position]
            if entry.node.headroom_kv_tokens < prompt_tokens - cached + output_tokens:
                return
            model, wait_s, batch_size, kv_tokens = entry.model, entry.wait_s, entry.batch_size, entry.kv_tokens
            if protect and not joined_step_fits(model, batch_size, kv_tokens, prompt_tokens, budget_s):
                return
            if best is not None:
                limit_s = best.ttft_s - wait_s
                if limit_s <= 0.0:
                    return
                if not cached and not bounded:
                    bound_s = deflection_bound_s(
                        model, prompt_tokens, wait_s, entry.batch_s, kv_tokens, candidates, budget_s
                    )
                    if bound_s > best.ttft_s:
                        return
            else:
                limit_s = math.inf
            found = plan(model, batch_size, kv_tokens, limit_s, cached)
            if found is None:
                return
            runs, seconds = found
            if best is None or (wait_s + seconds, position) < (best.ttft_s, best_at):
                node = nodes[position]
                assert isinstance(node, DecodeNodeView)
                best, best_at = _DecodeOption(node, wait_s + seconds, runs, cached), position

        for position, cached in held.items():
            price(position, cached)
        entries = index.entries

        def has_room(position: int) -> bool:
            return entries[position].node.headroom_kv_tokens >= prompt_tokens + output_tokens

        # each model's nodes in blocks by x = T0 - c0, W counted apart: a node's bound is at least W + E(x)
        for groups in index.groups.values():
            floor = Floor(groups.model, prompt_tokens, candidates, budget_s)
            own = groups.model.c_chunk_kv > 0  # K counts beyond x: a node's own bound is higher than W + E(x)
            swept = None  # the (W, B, K) last priced: a node alike, later in the view, cannot win
            seeds = islice(groups.plans.least_waits(), SEEDS)
            seed = next((at for at in seeds if at not in held and has_room(at)), -1)
            if seed >= 0:  # the least W first: the best found early prunes the scan sooner
                price(seed, 0)
            for block, low in zip(groups.plans.blocks, groups.plans.lows, strict=True):
                if best is not None:
                    first_x, limit_s = block[0][0][0], best.ttft_s / (1 - SAFETY)
                    if floor.below(first_x) > limit_s:
                        break  # every node from here on, whatever its W
                    if floor.below(first_x) + low > limit_s or floor.at(first_x) + low > limit_s:
                        if floor.at(first_x) > limit_s:
                            break
                        continue
                for (x, wait_s), position in block:
                    if best is not None:
                        limit_s = best.ttft_s / (1 - SAFETY) - wait_s
                        if floor.below(x) > limit_s:
                            continue
                    entry = entries[position]
                    alike = (wait_s, entry.batch_size, entry.kv_tokens)
                    if alike != swept and position != seed and position not in held and has_room(position):
                        swept = alike
                        price(position, 0, bounded=not own)
        return best, 0, 0

    def _handoff_target(
        self, prompt_tokens: int, output_tokens: int, view: ClusterView, hits: PrefixHits | None
    ) -> DecodeNodeView:
        """Decode node for a disaggregated request: the one its KV reaches first, among those that can take it.

        Its KV reaches a node after the transfers still bound there (one link per decode node carries them
        first: what the node lacks of their prompts, ``DecodeNodeView.incoming_transfer_tokens``, each paying
        its setup, ``PolicyParams.handoff_setup_tokens`` in tokens' worth of the link), and then its own, the
        prompt less what the node's cache holds (prefix-aware; a cache-blind policy counts nothing held): so
        the node with the fewest such tokens (``core.index.link_tokens``), then the fewest hand-offs bound
        there, then the most KV headroom. A node can take it when it has KV room for the uncached prompt and
        the request's output once the hand-offs bound there have joined with theirs, and a decode step with
        them and this request joined stays within beta * tau (Eq. 4 with Eq. 5's budget). When no node can,
        it waits for the one with the most KV room once it holds the request, then the smallest batch: a
        decode node lets a hand-off join only once its KV fits (vLLM's scheduler waits for free blocks), so
        no node is filled past its KV.

        Headroom says where the KV fits, not when it arrives: ranked by it alone, hand-offs would pile onto
        the emptiest node, or onto the node holding the history, whatever its link carries (``docs/prefix.md``).
        """
        held = hits.at if hits else lambda node_id: 0
        budget_s, setup = self.params.tbt_budget_s, self.params.handoff_setup_tokens

        def room(n: DecodeNodeView) -> int:
            """KV room once the hand-offs bound there have joined, what the node holds of the prompt counting."""
            return n.headroom_kv_tokens - n.incoming_kv_tokens + held(n.node_id)

        def fits(n: DecodeNodeView, tokens_held: int) -> bool:
            model = self.model_of(n)
            return handoff_fits(model, n, prompt_tokens, budget_s, tokens_held, output_tokens=output_tokens)

        index = self._indexed_decode(view)
        if index is None:
            able = [n for n in view.decode if fits(n, held(n.node_id))]
            if able:
                return min(
                    able,
                    key=lambda n: (
                        link_tokens(n, setup) + prompt_tokens - held(n.node_id),
                        n.incoming_requests,
                        -n.headroom_kv_tokens,
                    ),
                )
        else:  # the same ranking from the index: the nodes holding part of the prompt, then the first able other
            holding = index.held(hits.tokens_by_node if hits else None)
            best: tuple[tuple[float, ...], int] | None = None
            for position, tokens in holding.items():
                node = view.decode[position]
                if fits(node, tokens):
                    tokens_bound, bound, headroom = index.entries[position].link
                    ranked: tuple[tuple[float, ...], int] = (
                        (tokens_bound + prompt_tokens - tokens, bound, headroom),
                        position,
                    )
                    best = ranked if best is None else min(best, ranked)
            for groups in index.groups.values():
                by_link = groups.twins.lists[1]
                for link, group in by_link.pairs:
                    if best is not None and (link[0] + prompt_tokens, link[1], link[2]) > best[0]:
                        break
                    first = groups.twins.first_of(group, holding)
                    if first is None or not fits(view.decode[first], 0):
                        continue
                    ranked = ((link[0] + prompt_tokens, link[1], link[2]), first)
                    best = ranked if best is None else min(best, ranked)
            if best is not None:
                return view.decode[best[1]]
        return max(view.decode, key=lambda n: (room(n), -n.batch_size - n.incoming_requests))

    def _to_prefill(
        self,
        prompt_tokens: int,
        output_tokens: int,
        view: ClusterView,
        hits: PrefixHits | None,
        prefill: _PrefillOption,
        ttft_dec_s: float | None,
        reason: str,
    ) -> Decision:
        decode = prefill.target or self._handoff_target(prompt_tokens, output_tokens, view, hits)
        return Decision(
            Route.PREFILL,
            prefill.node.node_id,
            decode.node_id,
            (),
            prefill.ttft_s,
            ttft_dec_s,
            reason,
            prefill.cached_tokens,
            kv_wait_s=prefill.kv_wait_s,
        )

    @staticmethod
    def _to_decode(option: _DecodeOption, ttft_pf_s: float, reason: str) -> Decision:
        return Decision(
            Route.DEFLECT,
            None,
            option.node.node_id,
            expand(option.runs),
            ttft_pf_s,
            option.ttft_s,
            reason,
            option.cached_tokens,
        )


class KairosPolicy(_BasePolicy):
    """Algorithm 1: deflect to the fastest TBT-safe decode node when it wins by the margin alpha."""

    spec = "kairos"
    guards_chunks = True

    def _decide(
        self, prompt_tokens: int, output_tokens: int, view: ClusterView, hits: PrefixHits | None, in_time_s: float
    ) -> Decision:
        params = self.params
        prefill = self._best_prefill(prompt_tokens, output_tokens, view, hits)
        ttft_pf = prefill.ttft_s
        option, lacking_kv, infeasible = self._fastest_deflection(
            prompt_tokens,
            output_tokens,
            view,
            lambda model, batch_size, kv_tokens, limit_s, cached: largest_safe_runs(
                model,
                batch_size,
                kv_tokens,
                prompt_tokens - cached,
                params.chunk_candidates,
                params.tbt_budget_s,
                limit_s,
                cached,
            ),
            hits,
            prunable=True,
        )
        if option is None:
            reason = f"no TBT-safe decode node ({infeasible} infeasible, {lacking_kv} short of KV)"
            return self._to_prefill(prompt_tokens, output_tokens, view, hits, prefill, None, reason)
        if params.alpha * option.ttft_s < ttft_pf:
            reason = f"decode {option.ttft_s:.3f}s x alpha {params.alpha:g} < prefill {ttft_pf:.3f}s"
            return self._to_decode(option, ttft_pf, reason)
        if option.ttft_s <= in_time_s < ttft_pf:
            reason = f"decode {option.ttft_s:.3f}s in time, prefill {ttft_pf:.3f}s not (admission {in_time_s:.3f}s)"
            return self._to_decode(option, ttft_pf, reason)
        reason = f"decode {option.ttft_s:.3f}s x alpha {params.alpha:g} >= prefill {ttft_pf:.3f}s"
        return self._to_prefill(prompt_tokens, output_tokens, view, hits, prefill, option.ttft_s, reason)


class OraclePolicy(KairosPolicy):
    """Algorithm 1 with perfect step-time knowledge: its models are the noise-free ground truth."""

    spec = "oracle"
    decides_with_ground_truth = True


class PDPolicy(_BasePolicy):
    """Plain prefill/decode disaggregation: never deflects."""

    spec = "pd"

    def _decide(
        self, prompt_tokens: int, output_tokens: int, view: ClusterView, hits: PrefixHits | None, in_time_s: float
    ) -> Decision:
        prefill = self._best_prefill(prompt_tokens, output_tokens, view, hits)
        return self._to_prefill(prompt_tokens, output_tokens, view, hits, prefill, None, "pd never deflects")


class _StaticPolicy(_BasePolicy):
    """A threshold baseline: when ``_wants_deflection``, deflect in fixed chunks with no TBT check."""

    def _wants_deflection(self, prompt_tokens: int, view: ClusterView, hits: PrefixHits | None) -> tuple[bool, str]:
        raise NotImplementedError

    def _decide(
        self, prompt_tokens: int, output_tokens: int, view: ClusterView, hits: PrefixHits | None, in_time_s: float
    ) -> Decision:
        prefill = self._best_prefill(prompt_tokens, output_tokens, view, hits)
        wants, why = self._wants_deflection(prompt_tokens, view, hits)
        if not wants:
            return self._to_prefill(prompt_tokens, output_tokens, view, hits, prefill, None, why)
        chunk = self.params.static_chunk_tokens

        def plan(
            model: StepLatency, batch_size: int, kv_tokens: int, limit_s: float, cached: int
        ) -> tuple[Runs, float] | None:
            full, rest = divmod(prompt_tokens - cached, chunk)
            fixed: Runs = [(chunk, full)] if full else []
            if rest:
                fixed.append((rest, 1))
            seconds = runs_s(model, batch_size, kv_tokens + cached, fixed, cached)
            return (fixed, seconds) if seconds < limit_s else None

        option, lacking_kv, _ = self._fastest_deflection(prompt_tokens, output_tokens, view, plan, hits)
        if option is None:
            reason = f"{why}, but {lacking_kv} decode nodes short of KV"
            return self._to_prefill(prompt_tokens, output_tokens, view, hits, prefill, None, reason)
        return self._to_decode(option, prefill.ttft_s, why)


class _ThresholdPolicy(_StaticPolicy):
    """A static policy with one positive integer threshold, given as ``name:threshold``."""

    name = ""
    threshold_field = ""  # the ``Thresholds`` field used when the spec names no threshold

    @classmethod
    def check_arg(cls, arg: str | None) -> None:
        if arg is None:
            return
        try:
            threshold = int(arg)
        except ValueError:
            raise ValueError(f"policy {cls.name}: threshold {arg!r} is not an integer") from None
        if threshold < 1:
            raise ValueError(f"policy {cls.name}: threshold must be >= 1, got {threshold}")

    def _configure(self, arg: str | None, thresholds: Thresholds) -> None:
        self.threshold: int = getattr(thresholds, self.threshold_field) if arg is None else int(arg)
        self.spec = f"{self.name}:{self.threshold}"


class SQPolicy(_ThresholdPolicy):
    """SQ(theta): deflect when the shortest prefill queue holds at least theta requests."""

    name = "sq"
    threshold_field = "sq_queued_requests"

    def _wants_deflection(self, prompt_tokens: int, view: ClusterView, hits: PrefixHits | None) -> tuple[bool, str]:
        shortest = min(node.num_queued for node in view.prefill)
        if shortest >= self.threshold:
            return True, f"shortest prefill queue {shortest} >= {self.threshold}"
        return False, f"shortest prefill queue {shortest} < {self.threshold}"


class SLPolicy(_ThresholdPolicy):
    """SL(l): deflect every prompt of at most l tokens; prefix-aware, every prompt whose uncached suffix
    on some decode node is at most l tokens (llm-d's prefix-based P/D decider)."""

    name = "sl"
    threshold_field = "sl_prompt_tokens"

    def _wants_deflection(self, prompt_tokens: int, view: ClusterView, hits: PrefixHits | None) -> tuple[bool, str]:
        cached = max(hits.at(n.node_id) for n in view.decode) if hits else 0
        what, tokens = ("uncached suffix", prompt_tokens - cached) if cached else ("prompt", prompt_tokens)
        if tokens <= self.threshold:
            return True, f"{what} {tokens} <= {self.threshold} tokens"
        return False, f"{what} {tokens} > {self.threshold} tokens"


POLICIES: dict[str, type[_BasePolicy]] = {
    "kairos": KairosPolicy,
    "oracle": OraclePolicy,
    "pd": PDPolicy,
    "sq": SQPolicy,
    "sl": SLPolicy,
}
"""Registry: spec name -> policy class. A spec is ``name`` or ``name:threshold``, then ``+prefix`` or ``+blind``."""

PREFIX_MODES: dict[str, bool] = {"+prefix": True, "+blind": False}
"""Spec suffixes that set ``PolicyParams.prefix_aware`` for one policy (without one, the params decide)."""


def prefix_mode(spec: str) -> tuple[str, str]:
    """(spec without its prefix-mode suffix, that suffix or "")."""
    text = spec.strip()
    for suffix in PREFIX_MODES:
        if text.lower().endswith(suffix):
            return text[: -len(suffix)], suffix
    return text, ""


def parse_spec(spec: str) -> tuple[type[_BasePolicy], str | None]:
    """Split and check a spec string (``kairos``, ``oracle``, ``pd``, ``sq:<theta>``, ``sl:<tokens>``,
    each optionally followed by ``+prefix`` or ``+blind``).

    Raises ``ValueError`` naming the accepted forms for an unknown name or a bad threshold.
    """
    name, sep, arg = prefix_mode(spec)[0].partition(":")
    cls = POLICIES.get(name.lower())
    if cls is None:
        raise ValueError(
            f"unknown policy {spec!r}; known: kairos, oracle, pd, sq:<theta>, sl:<tokens>, "
            "each optionally +prefix or +blind"
        )
    cls.check_arg(arg if sep else None)
    return cls, arg if sep else None


def make_policy(
    spec: str,
    params: PolicyParams,
    prefill_model: StepLatency,
    decode_model: StepLatency | None = None,
    thresholds: Thresholds = Thresholds(),
) -> Policy:
    """Build the policy a spec string names; see ``parse_spec``.

    ``decode_model`` defaults to ``prefill_model`` (same hardware, as in the paper). A ``+prefix`` or
    ``+blind`` suffix overrides ``params.prefix_aware`` and stays in the policy's ``spec``.
    """
    cls, arg = parse_spec(spec)
    if params.prefill_estimator not in PREFILL_ESTIMATORS:
        raise ValueError(
            f"unknown prefill estimator {params.prefill_estimator!r}; known: {', '.join(PREFILL_ESTIMATORS)}"
        )
    suffix = prefix_mode(spec)[1]
    if suffix:
        params = replace(params, prefix_aware=PREFIX_MODES[suffix])
    policy = cls.build(arg, thresholds, params, prefill_model, decode_model or prefill_model)
    policy.spec += suffix
    return policy
