"""SLO-aware admission and decode-side protection, on the estimates Algorithm 1 already computes.

Admission (``judge``). A request r of priority p is admitted when the
estimated TTFT of the route the policy chose is within its class's threshold,
and shed at once otherwise:

    TTFT_est(r) <= theta(p),    theta(p) = s * TTFT_SLO * (1 - rho) ** max(0, p)

TTFT_est is TTFT_dec(n*) (Eq. 6) for a deflection, and for a hand-off to decode
node d the prefill path's estimate (Eq. 1-2) carried on to its first token:

    R = max(TTFT_pf(r), W_kv(r, d))                                     its KV can leave
    TTFT_hand-off(r, d) = max(R + min(1, W_link / R) * W_link / J_d, W_link)    its transfer starts
                          + T_kv(r, d) + T_step(B_d + I_d + 1, K_d + I_p + l_r, 0)

Its KV waits W_kv for d to take it (below). d's link first carries the J_d
transfers still bound there, W_link seconds of them (what d lacks of their
prompts, each with the link's setup): r's transfer starts once they are done,
and when they fit before R, r still finds the link busy a share
rho = W_link / R of the time and then waits about one of them (W_link / J_d),
the first-order queueing delay a fluid bound misses. Then its own transfer
T_kv (setup plus what d lacks of its prompt), and one decode step in d's batch
with the I_d hand-offs bound there joined (their prompts, I_p tokens, resident). With admission on a
hand-off goes to the decode node where this is least, and ``kairos`` deflects
whenever the decode path alone is in time, so a request is shed only when no
route is. The prefill FIFO and a node's committed deflections run in arrival
order, so a later request never delays an admitted one's prefill and the
estimate made at arrival stands; the slack s < 1 is the margin for its error
(step noise, link queues, how fast decode batches drain).

Priorities (vLLM's ``priority``: lower is more important, 0 the default)
follow trunk reservation: each level less important than 0 is admitted only
up to the share 1 - rho of the threshold of the level above it, so under
overload the work ahead settles at the threshold of the least important class
still admitted and the headroom above it is kept for the more important ones:
the least important requests are shed first. A class more important than 0
has 0's threshold (past the objective it would miss anyway); a class in
``never_shed_priorities`` is always admitted and queues.

A shed request's answer says when to come back (``Admission.retry_after_s``):
TTFT_est - theta(p), since a node drains one second of the work ahead of it
per second, within a floor and a cap.

Decode-side protection (on whenever admission is). A hand-off or a deflection
goes only to a decode node whose decode step with the request joined stays
within beta * tau (Eq. 4 with Eq. 5's budget; ``joined_step_fits``). For a
hand-off (``handoff_fits``) that step has the hand-offs bound there joined
too, and carries the next chunk of the deflection the node is prefilling, so
that a deflection keeps the room its chunks were planned with; a deflection is
planned for the batch the bound hand-offs will have joined (``core.policy``).
When its decode node cannot take it, a hand-off's KV waits on its prefill node
(``AdmissionParams.kv_wait_max_s`` at most; then it waits in the decode node's
queue, which lets it join only within the budget too), and that wait W_kv
(``kv_wait_s``) is part of its TTFT estimate: the requests beyond what the
node can run within the budget, the hand-offs bound there counted, must leave
first, at the rate the node finishes requests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from kairos_ray.core.latency import StepLatency
from kairos_ray.core.state import Admission, Decision, DecodeNodeView, ShedReason

KV_WAIT_SIGMAS = 1.645
"""A hand-off's KV wait is priced this many standard deviations above its mean (``kv_wait_s``): its 95th
percentile, so that a wait that runs long does not make every request admitted at the threshold late."""


class AdmissionMode(StrEnum):
    """Whether the router sheds requests that no route can serve in time."""

    OFF = "off"  # the paper's behaviour: every request is admitted, a hand-off joins its decode node at once
    SHED = "shed"  # admission (``judge``) and decode-side protection


@dataclass(frozen=True, slots=True)
class AdmissionParams:
    """Admission's knobs (validated at the edge by ``kairos_ray.config``)."""

    mode: AdmissionMode = AdmissionMode.OFF
    ttft_slo_s: float = 4.0  # the TTFT objective
    slack: float = 0.9  # s: admit while the estimate is within s times the objective (margin for its error)
    priority_reserve: float = 0.25  # rho: the share of a level's threshold kept for the levels above it
    never_shed_priorities: frozenset[int] = field(default_factory=frozenset)  # classes that queue instead
    kv_wait_max_s: float = 2.0  # longest a KV waits on its prefill node before going to its decode node's queue
    retry_after_min_s: float = 1.0  # floor of a shed request's retry-after
    retry_after_max_s: float = 60.0  # cap of a shed request's retry-after

    @property
    def on(self) -> bool:
        return self.mode is AdmissionMode.SHED

    def threshold_s(self, priority: int) -> float:
        """theta(p): the estimated TTFT a request of ``priority`` is admitted up to (inf: never shed)."""
        if priority in self.never_shed_priorities:
            return math.inf
        return self.slack * self.ttft_slo_s * (1.0 - self.priority_reserve) ** max(0, priority)


def judge(params: AdmissionParams, decision: Decision, priority: int = 0) -> Admission:
    """Admit or shed the request ``decision`` routes (module docstring): its estimate against theta(priority)."""
    estimate = decision.ttft_decode_s if decision.deflected else decision.ttft_prefill_s
    if estimate is None:
        raise ValueError(f"decision for route {decision.route.value} carries no estimate of it: {decision.reason}")
    threshold = params.threshold_s(priority)
    if estimate <= threshold:
        return Admission(True, None, estimate, threshold, 0.0)
    reason = ShedReason.PRIORITY if estimate <= params.threshold_s(0) else ShedReason.NO_ROUTE_IN_TIME
    retry = min(max(estimate - threshold, params.retry_after_min_s), params.retry_after_max_s)
    return Admission(False, reason, estimate, threshold, retry)


def handoff_ttft_s(
    model: StepLatency,
    node: DecodeNodeView,
    prefill_s: float,
    wait_s: float,
    prompt_tokens: int,
    held_tokens: int,
    setup_tokens: int,
    tokens_per_s: float,
) -> float:
    """TTFT_hand-off(r, d) (module docstring) from the prefill path's estimate ``prefill_s`` (Eq. 1-2) and the
    KV's wait ``wait_s`` (``kv_wait_s``); ``held_tokens`` of the prompt are on ``node`` already, and a link carries
    ``tokens_per_s`` KV tokens per second after a setup worth ``setup_tokens`` (0 tokens per second: unpriced)."""
    ready_s = max(prefill_s, wait_s)
    start_s, transfer_s = ready_s, 0.0
    if tokens_per_s > 0:
        transfer_s = (setup_tokens + prompt_tokens - held_tokens) / tokens_per_s
        transfers = node.incoming_transfers
        if transfers:
            link_s = (node.incoming_transfer_tokens + setup_tokens * transfers) / tokens_per_s
            busy = min(1.0, link_s / ready_s) if ready_s > 0 else 1.0
            start_s = max(ready_s + busy * link_s / transfers, link_s)
    batch_size, kv_tokens = node.with_bound
    first_step_s = model.step_s(batch_size + 1, kv_tokens + prompt_tokens, 0)
    return start_s + transfer_s + first_step_s


def joined_step_fits(
    model: StepLatency,
    batch_size: int,
    kv_tokens: int,
    prompt_tokens: int,
    budget_s: float,
    chunk_tokens: int = 0,
    prefix_tokens: int = 0,
) -> bool:
    """Whether a decode step of B requests with K resident stays within beta * tau once a request of
    ``prompt_tokens`` has joined: T_step(B + 1, K + l_r, chi, P) <= beta * tau (Eq. 4, Eq. 5's budget), with
    a deflected chunk of ``chunk_tokens`` and its own prefix ``prefix_tokens`` in the step (none by default)."""
    return model.step_s(batch_size + 1, kv_tokens + prompt_tokens, chunk_tokens, prefix_tokens) <= budget_s


def handoff_fits(
    model: StepLatency,
    node: DecodeNodeView,
    prompt_tokens: int,
    budget_s: float,
    held_tokens: int = 0,
    with_deflection: bool = False,
    output_tokens: int = 0,
) -> bool:
    """Whether ``node`` can take a hand-off now: KV room for its prompt and ``output_tokens`` once the hand-offs
    bound there have joined with theirs (``held_tokens`` of the prompt are there already), and a decode step with
    them and it joined, their prompts resident, within beta * tau; ``with_deflection`` (decode-side protection):
    that step carrying the next chunk of the deflection the node is prefilling, as it will.
    """
    room = node.headroom_kv_tokens - node.incoming_kv_tokens + held_tokens
    if room < prompt_tokens + output_tokens:
        return False
    batch_size, kv_tokens = node.with_bound
    chunk = prefix = 0
    if with_deflection and node.committed:
        hit = node.committed_cached_tokens[0] if node.committed_cached_tokens else 0
        chunk, prefix = node.committed[0][0], node.head_prefilled_tokens + hit
        if not node.head_prefilled_tokens:
            kv_tokens += hit  # its cached prefix joins the resident KV with its first chunk
    return joined_step_fits(model, batch_size, kv_tokens, prompt_tokens, budget_s, chunk, prefix)


def kv_wait_s(
    model: StepLatency,
    node: DecodeNodeView,
    prompt_tokens: int,
    budget_s: float,
    held_tokens: int = 0,
    output_tokens: int = 0,
) -> float:
    """W_kv: estimated wait of a hand-off's KV for ``node`` to take it (0 when it can now; ``handoff_fits``).

    The node holds e requests beyond what it can run within beta * tau (its bound hand-offs
    counted, each request taking the node's mean KV) and finishes f requests per second
    (``DecodeNodeView.finished_per_s``); the hand-off joins once those e and one more have left.
    A large batch's finishes come about as a Poisson stream, so that takes an Erlang time of mean
    (e + 1) / f and standard deviation sqrt(e + 1) / f; W_kv is its mean plus ``KV_WAIT_SIGMAS`` of
    those. Without a measured rate there is no estimate: inf.
    """
    if handoff_fits(model, node, prompt_tokens, budget_s, held_tokens, True, output_tokens):
        return 0.0
    if node.finished_per_s <= 0:
        return math.inf
    batch_size, kv_tokens = node.with_bound
    ahead = _excess(model, batch_size, kv_tokens, budget_s) if batch_size else 0
    return (ahead + 1 + KV_WAIT_SIGMAS * math.sqrt(ahead + 1)) / node.finished_per_s


def _excess(model: StepLatency, batch_size: int, kv_tokens: int, budget_s: float) -> int:
    """Fewest requests that must leave a batch of B (each taking K / B of its KV) for its decode step to fit
    beta * tau; B if even that is not enough. Binary search: T_step grows with B and K (non-negative coefficients)."""
    if model.step_s(batch_size, kv_tokens, 0) <= budget_s:
        return 0
    per_request = kv_tokens / batch_size
    fits, fails = batch_size, 0  # leaving `fails` requests is too few, leaving `fits` is taken as enough
    while fits - fails > 1:
        middle = (fits + fails) // 2
        if model.step_s(batch_size - middle, kv_tokens - middle * per_request, 0) <= budget_s:
            fits = middle
        else:
            fails = middle
    return fits


JoinGuard = Callable[[int, int, int, int, int], bool]
"""(B, K, prompt tokens, planned chunk, its own prefix) -> whether a waiting hand-off may join the batch now,
the step also carrying the deflected chunk planned next (0: none; ``joined_step_fits``)."""


def join_guard(model: StepLatency, budget_s: float) -> JoinGuard:
    """The decode node's check before a hand-off joins its batch: the step with it stays within beta * tau."""

    def guard(batch_size: int, kv_tokens: int, prompt_tokens: int, chunk_tokens: int, prefix_tokens: int) -> bool:
        return joined_step_fits(model, batch_size, kv_tokens, prompt_tokens, budget_s, chunk_tokens, prefix_tokens)

    return guard
