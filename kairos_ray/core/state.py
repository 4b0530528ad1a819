"""Snapshots of cluster state that policies decide on, and the decisions they return.

All are frozen, slotted dataclasses: a policy reads a ``ClusterView`` and
returns a ``Decision``; it never mutates state. ``apply_decision`` is the
router's ledger step: it returns the view as it will be once the decision is
dispatched, so a burst of requests sees its own earlier decisions at once
(Algorithm 1 is evaluated per queued request against the current state).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class Route(StrEnum):
    """Where a request's prefill runs."""

    PREFILL = "prefill"  # on a prefill node, KV then shipped to a decode node
    DEFLECT = "deflect"  # chunked, in place on a decode node (no KV transfer)


@dataclass(frozen=True, slots=True)
class PrefillNodeView:
    """A prefill node as the router sees it."""

    node_id: str
    queued_prompt_tokens: tuple[int, ...] = ()  # prompt tokens still to prefill per queued request, FIFO order
    head_prefilled_tokens: int = 0  # tokens of the head request already prefilled (its cached context)

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

    @property
    def committed_tokens(self) -> int:
        """Prompt tokens that committed deflections will still add to the KV cache."""
        return sum(map(sum, self.committed)) if self.committed else 0

    @property
    def headroom_kv_tokens(self) -> int:
        """Free KV once committed deflections have been prefilled."""
        return self.free_kv_tokens - self.committed_tokens


@dataclass(frozen=True, slots=True)
class ClusterView:
    """Everything a policy may look at for one decision."""

    prefill: tuple[PrefillNodeView, ...]
    decode: tuple[DecodeNodeView, ...]


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's answer for one request (Algorithm 1 output, plus the estimates behind it)."""

    route: Route
    prefill_node: str | None  # prefill node id for Route.PREFILL, else None
    decode_node: str | None  # decode node that streams the tokens (None only when the cluster has none)
    chunk_schedule: tuple[int, ...]  # X*: chunk sizes for Route.DEFLECT, empty otherwise
    ttft_prefill_s: float | None  # estimated TTFT on the best prefill node (Eq. 1), None without prefill nodes
    ttft_decode_s: float | None  # estimated TTFT on the chosen/best decode node (Eq. 6), None if none feasible
    reason: str  # short, human-readable

    @property
    def deflected(self) -> bool:
        return self.route is Route.DEFLECT


def apply_decision(view: ClusterView, prompt_tokens: int, decision: Decision, output_tokens: int = 0) -> ClusterView:
    """The view after ``decision`` is dispatched, before any engine reports back.

    A prefill-routed request joins the tail of its prefill node's FIFO; a
    deflected one commits its chunk schedule to its decode node, behind the
    deflections already there, and reserves KV for its ``output_tokens`` there
    at once (its prompt's KV is the schedule itself), as a decode node does
    when it takes the request.
    """
    if decision.route is Route.PREFILL:
        prefill = tuple(
            replace(node, queued_prompt_tokens=(*node.queued_prompt_tokens, prompt_tokens))
            if node.node_id == decision.prefill_node
            else node
            for node in view.prefill
        )
        return replace(view, prefill=prefill)
    decode = tuple(
        replace(
            node,
            committed=(*node.committed, decision.chunk_schedule),
            free_kv_tokens=node.free_kv_tokens - output_tokens,
        )
        if node.node_id == decision.decode_node
        else node
        for node in view.decode
    )
    return replace(view, decode=decode)
