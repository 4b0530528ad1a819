"""TTFT estimates on both paths: prefill node (Eq. 1-2) and decode node (Eq. 6), with cached prefixes.

Two prefill-node estimators, selected by ``PREFILL_ESTIMATORS[name]``:

``paper`` (Eq. 1-2 as written): the queue ahead of r, S = sum(l_i), drains in
S / chi_p steps, each priced at T_step(B=0, K=S/2, chi_p) ("half the queued
tokens already cached"; the cached tokens are the context each chunk attends
over, so they are its prefix P too). The paper leaves T_pf(r) unspecified; we
price it the same way as r alone: l_r / chi_p steps at T_step(0, l_r/2,
chi_p). Use it to reproduce the paper, or when the queue holds prompts of
similar length.

``exact`` (default): walks the FIFO request by request, each prompt in
ceil(l / chi_p) chunks whose own prefix (and the node's KV) grows by chi_p per
step, priced with the model's closed-form runs. When a short prompt queues
behind a long one, Eq. 2 prices the short one's steps at the long one's
average context; this does not.
vLLM may pack the tail chunk of one prompt with the head of the next into one
step; counting them as two steps overestimates by at most one step's fixed
cost per queued request.

Decode path (Eq. 6): TTFT_dec = sum_i T_step(B_n, K_n + P_i, chi_i, P_i) with
P_i = sum_{j<i} chi_j, each chunk's own prefix, after the steps that
deflections already committed to the node still occupy.

Cached prefixes (``core.prefix``): a node computes only what its cache does
not hold. A request with ``cached_tokens`` of its prompt cached on the node is
priced as its uncached suffix whose chunks start from that context (P_1 =
cached_tokens, and the cached KV is resident: K grows by it); the queue
ahead is priced the same way from each queued request's cached context
(``PrefillNodeView.context_tokens``, ``DecodeNodeView.committed_cached_tokens``).
With nothing cached every formula is the paper's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from kairos_ray.core.latency import StepLatency
from kairos_ray.core.state import DecodeNodeView, PrefillNodeView


def queue_wait_paper_s(model: StepLatency, queued_tokens: int, chunk_tokens: int, cached_tokens: int = 0) -> float:
    """Eq. 2: W_queue = (S / chi_p) * T_step(chi_p, S / 2), on a prefill node (B = 0), S / 2 cached (K = P).

    ``cached_tokens`` of context before the S tokens (a cached prefix) add to the context of every step.
    """
    if queued_tokens <= 0:
        return 0.0
    context = cached_tokens + queued_tokens / 2
    return queued_tokens / chunk_tokens * model.step_s(0, context, chunk_tokens, context)


def queue_ttft_paper_s(
    model: StepLatency, node: PrefillNodeView, chunk_tokens: int, walks: QueueWalks | None = None
) -> float:
    """Eq. 2 over the node's queue: its S counts the tokens its requests still have to compute (the node reports
    them uncached). ``walks`` is not needed: Eq. 2 reads only the queue's sum."""
    return queue_wait_paper_s(model, sum(node.queued_prompt_tokens), chunk_tokens)


def own_prefill_paper_s(model: StepLatency, prompt_tokens: int, cached_tokens: int, chunk_tokens: int) -> float:
    """T_pf(r) as the paper's estimator prices it: like a queue holding only r's uncached suffix, which drains
    from its cached context on."""
    return queue_wait_paper_s(model, prompt_tokens - cached_tokens, chunk_tokens, cached_tokens)


def prefill_ttft_paper_s(
    model: StepLatency,
    node: PrefillNodeView,
    prompt_tokens: int,
    chunk_tokens: int,
    cached_tokens: int = 0,
    walks: QueueWalks | None = None,
) -> float:
    """Eq. 1 with Eq. 2: W_queue(r) + T_pf(r), T_pf priced like a queue holding only r's uncached suffix."""
    own_s = own_prefill_paper_s(model, prompt_tokens, cached_tokens, chunk_tokens)
    return queue_ttft_paper_s(model, node, chunk_tokens) + own_s


def chunked_prefill_s(model: StepLatency, prompt_tokens: int, context_tokens: int, chunk_tokens: int) -> float:
    """One prompt prefilled alone in chunks of ``chunk_tokens``, starting from ``context_tokens`` cached.

    Alone on a prefill node, the resident KV is the prompt's own prefix: K = P.
    """
    full, rest = divmod(prompt_tokens, chunk_tokens)
    seconds = model.run_s(0, context_tokens, chunk_tokens, full, context_tokens)
    if rest:
        done = context_tokens + full * chunk_tokens
        seconds += model.step_s(0, done, rest, done)
    return seconds


def queue_wait_exact_s(
    model: StepLatency, node: PrefillNodeView, chunk_tokens: int, walks: QueueWalks | None = None
) -> float:
    """W_queue walked request by request: every queued prompt in chunks, each from its context in KV.

    With ``walks``, a FIFO that only grew at its tail since the node's last
    walk is priced from where that walk ended.
    """
    queued = node.queued_prompt_tokens
    base = (node.head_prefilled_tokens, chunk_tokens)
    start, state = walks.resume(model, node.node_id, base, queued, node.queued_cached_tokens) if walks else (0, ())
    seconds = state[0] if start else 0.0
    if node.queued_cached_tokens:
        for index in range(start, len(queued)):
            seconds += chunked_prefill_s(model, queued[index], node.context_tokens(index), chunk_tokens)
    else:  # only the head has context: what it has prefilled
        context = 0 if start else node.head_prefilled_tokens
        for tokens in queued[start:]:
            seconds += chunked_prefill_s(model, tokens, context, chunk_tokens)
            context = 0
    if walks:
        walks.keep(model, node.node_id, base, queued, node.queued_cached_tokens, (seconds,))
    return seconds


def own_prefill_exact_s(model: StepLatency, prompt_tokens: int, cached_tokens: int, chunk_tokens: int) -> float:
    """T_pf(r) walked: r's uncached suffix in chunks from its cached context."""
    return chunked_prefill_s(model, prompt_tokens - cached_tokens, cached_tokens, chunk_tokens)


def prefill_ttft_exact_s(
    model: StepLatency,
    node: PrefillNodeView,
    prompt_tokens: int,
    chunk_tokens: int,
    cached_tokens: int = 0,
    walks: QueueWalks | None = None,
) -> float:
    """Eq. 1 with the queue walked request by request: every queued prompt, then r's uncached suffix."""
    own_s = own_prefill_exact_s(model, prompt_tokens, cached_tokens, chunk_tokens)
    return queue_wait_exact_s(model, node, chunk_tokens, walks) + own_s


class PrefillEstimator(Protocol):
    """(model, node, prompt tokens, chi_p, prompt tokens the node has cached, walks) -> TTFT_pf seconds."""

    def __call__(
        self,
        model: StepLatency,
        node: PrefillNodeView,
        prompt_tokens: int,
        chunk_tokens: int,
        cached_tokens: int = 0,
        walks: QueueWalks | None = None,
    ) -> float: ...


PrefillEstimatorName = Literal["exact", "paper"]

PREFILL_ESTIMATORS: dict[str, PrefillEstimator] = {
    "exact": prefill_ttft_exact_s,
    "paper": prefill_ttft_paper_s,
}


class OwnPrefill(Protocol):
    """(model, prompt tokens, of them cached on the node, chi_p) -> T_pf(r) seconds."""

    def __call__(self, model: StepLatency, prompt_tokens: int, cached_tokens: int, chunk_tokens: int) -> float: ...


class QueueTTFT(Protocol):
    """(model, node, chi_p, walks) -> W_queue seconds: the request-independent part of an estimator."""

    def __call__(
        self, model: StepLatency, node: PrefillNodeView, chunk_tokens: int, walks: QueueWalks | None = None
    ) -> float: ...


PREFILL_PARTS: dict[str, tuple[QueueTTFT, OwnPrefill]] = {
    "exact": (queue_wait_exact_s, own_prefill_exact_s),
    "paper": (queue_ttft_paper_s, own_prefill_paper_s),
}
"""Each estimator of ``PREFILL_ESTIMATORS`` as W_queue + T_pf(r), the same terms in the same order: the queue's
part depends on the node only, so a policy can keep it per node (``core.index``)."""


def runs_of(schedule: Iterable[int]) -> list[tuple[int, int]]:
    """Run-length form [(chunk_tokens, num_steps), ...] of a chunk schedule."""
    runs: list[tuple[int, int]] = []
    previous, count = 0, 0
    for chunk in schedule:
        if chunk == previous:
            count += 1
            continue
        if count:
            runs.append((previous, count))
        previous, count = chunk, 1
    if count:
        runs.append((previous, count))
    return runs


def runs_s(
    model: StepLatency, batch_size: int, kv_tokens: float, runs: Sequence[tuple[int, int]], prefix_tokens: int = 0
) -> float:
    """Eq. 6 over a schedule in run-length form, K and the chunks' own prefix growing by every chunk.

    ``kv_tokens`` is the node's KV before the first chunk (its prefix included),
    ``prefix_tokens`` that first chunk's own prefix (0 unless part of the prompt is done).
    """
    seconds = 0.0
    for chunk, count in runs:
        seconds += model.run_s(batch_size, kv_tokens, chunk, count, prefix_tokens)
        kv_tokens += chunk * count
        prefix_tokens += chunk * count
    return seconds


def decode_ttft_s(
    model: StepLatency, batch_size: int, kv_tokens: float, schedule: Iterable[int], prefix_tokens: int = 0
) -> float:
    """Eq. 6: TTFT_dec(r, n, X) = sum_i T_step(B_n, K_n + P_i, chi_i, P_i), P_i = prefix_tokens + sum_{j<i} chi_j."""
    return runs_s(model, batch_size, kv_tokens, runs_of(schedule), prefix_tokens)


def after_committed(
    model: StepLatency, node: DecodeNodeView, walks: QueueWalks | None = None
) -> tuple[float, int, int]:
    """(seconds, B, K) once the node has run the deflections already committed to it.

    Committed deflections run one after another (one deflected prefill per
    step keeps each step's cost what Eq. 5 checked); each joins the decode
    batch when its prefill ends. The first may be under way: its chunks start
    from the prefix it has prefilled. Each starts from its cached prefix,
    whose KV joins K when its first chunk runs. With ``walks``, commitments
    that only grew at their tail since the node's last walk are priced from
    where that walk ended.
    """
    if not node.committed:
        return 0.0, node.batch_size, node.kv_tokens
    cached = node.committed_cached_tokens
    base = (node.batch_size, node.kv_tokens, node.head_prefilled_tokens)
    start, state = walks.resume(model, node.node_id, base, node.committed, cached) if walks else (0, ())
    seconds, batch_size, kv_tokens = (
        (state[0], int(state[1]), int(state[2])) if start else (0.0, node.batch_size, node.kv_tokens)
    )
    prefix = 0 if start else node.head_prefilled_tokens
    for index in range(start, len(node.committed)):
        schedule = node.committed[index]
        hit = cached[index] if index < len(cached) else 0
        if not prefix:  # not under way: its cached KV is not in K yet
            kv_tokens += hit
        seconds += decode_ttft_s(model, batch_size, kv_tokens, schedule, prefix + hit)
        batch_size += 1
        kv_tokens += sum(schedule)
        prefix = 0
    if walks:
        walks.keep(model, node.node_id, base, node.committed, cached, (seconds, batch_size, kv_tokens))
    return seconds, batch_size, kv_tokens


@dataclass(slots=True)
class _Walk:
    model: StepLatency
    base: tuple[float, ...]
    items: tuple[object, ...]
    cached: tuple[int, ...]
    state: tuple[float, ...]


class QueueWalks:
    """Where the last walk over each node's queue ended, so a queue that grew only at its tail is priced from there.

    Eq. 1-2 (exact) walk a prefill node's FIFO and Eq. 6 a decode node's
    committed deflections: O(queue) per decision. A router deciding a burst,
    and the simulator, see queues that mostly grow at the tail between
    decisions (each decision appends to one); resuming the walk makes those
    decisions O(new entries). The result is the full walk's bit for bit: the
    same terms summed in the same order. A walk is resumed only for the same
    model, the same head of queue (``base``) and a queue whose first entries
    (and their cached tokens) are the walked ones; anything else walks again.
    One per policy (and per pool: the queues are keyed by node id). Queues
    shorter than ``min_items`` are walked whole: cheaper than comparing them.
    """

    def __init__(self, min_items: int = 8) -> None:
        self.min_items = min_items
        self._walks: dict[str, _Walk] = {}

    def resume(
        self,
        model: StepLatency,
        node_id: str,
        base: tuple[float, ...],
        items: Sequence[object],
        cached: tuple[int, ...],
    ) -> tuple[int, tuple[float, ...]]:
        """(entries already walked, the state after them), or (0, ()) to walk from the start."""
        if len(items) < self.min_items:
            return 0, ()
        walk = self._walks.get(node_id)
        if walk is None or walk.model is not model or walk.base != base:
            return 0, ()
        done = len(walk.items)
        if done > len(items) or tuple(items[:done]) != walk.items:
            return 0, ()
        if _padded(cached, done) != _padded(walk.cached, done):
            return 0, ()
        return done, walk.state

    def keep(
        self,
        model: StepLatency,
        node_id: str,
        base: tuple[float, ...],
        items: Sequence[object],
        cached: tuple[int, ...],
        state: tuple[float, ...],
    ) -> None:
        if len(items) >= self.min_items:
            self._walks[node_id] = _Walk(model, base, tuple(items), cached, state)


def _padded(cached: tuple[int, ...], length: int) -> tuple[int, ...]:
    """The first ``length`` entries of a per-request cached-token tuple (``()`` and a short tuple mean 0s)."""
    return cached[:length] if len(cached) >= length else cached + (0,) * (length - len(cached))
