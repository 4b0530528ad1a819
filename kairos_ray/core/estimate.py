"""TTFT estimates on both paths: prefill node (Eq. 1-2) and decode node (Eq. 6).

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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Literal

from kairos_ray.core.latency import StepLatency
from kairos_ray.core.state import DecodeNodeView, PrefillNodeView


def queue_wait_paper_s(model: StepLatency, queued_tokens: int, chunk_tokens: int) -> float:
    """Eq. 2: W_queue = (S / chi_p) * T_step(chi_p, S / 2), on a prefill node (B = 0), S / 2 cached (K = P)."""
    if queued_tokens <= 0:
        return 0.0
    cached = queued_tokens / 2
    return queued_tokens / chunk_tokens * model.step_s(0, cached, chunk_tokens, cached)


def prefill_ttft_paper_s(model: StepLatency, node: PrefillNodeView, prompt_tokens: int, chunk_tokens: int) -> float:
    """Eq. 1 with Eq. 2: W_queue(r) + T_pf(r), T_pf priced like a queue holding only r."""
    queued = sum(node.queued_prompt_tokens)
    return queue_wait_paper_s(model, queued, chunk_tokens) + queue_wait_paper_s(model, prompt_tokens, chunk_tokens)


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


def queue_wait_exact_s(model: StepLatency, node: PrefillNodeView, chunk_tokens: int) -> float:
    """W_queue walked request by request: every queued prompt in chunks, the head from its cached context."""
    seconds = 0.0
    context = node.head_prefilled_tokens
    for tokens in node.queued_prompt_tokens:
        seconds += chunked_prefill_s(model, tokens, context, chunk_tokens)
        context = 0
    return seconds


def prefill_ttft_exact_s(model: StepLatency, node: PrefillNodeView, prompt_tokens: int, chunk_tokens: int) -> float:
    """Eq. 1 with the queue walked request by request: every queued prompt, then r itself."""
    return queue_wait_exact_s(model, node, chunk_tokens) + chunked_prefill_s(model, prompt_tokens, 0, chunk_tokens)


PrefillEstimator = Callable[[StepLatency, PrefillNodeView, int, int], float]
PrefillEstimatorName = Literal["exact", "paper"]

PREFILL_ESTIMATORS: dict[str, PrefillEstimator] = {
    "exact": prefill_ttft_exact_s,
    "paper": prefill_ttft_paper_s,
}


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


def after_committed(model: StepLatency, node: DecodeNodeView) -> tuple[float, int, int]:
    """(seconds, B, K) once the node has run the deflections already committed to it.

    Committed deflections run one after another (one deflected prefill per
    step keeps each step's cost what Eq. 5 checked); each joins the decode
    batch when its prefill ends. The first may be under way: its chunks start
    from the prefix it has prefilled.
    """
    seconds = 0.0
    batch_size, kv_tokens = node.batch_size, node.kv_tokens
    if not node.committed:
        return seconds, batch_size, kv_tokens
    prefix = node.head_prefilled_tokens
    for schedule in node.committed:
        seconds += decode_ttft_s(model, batch_size, kv_tokens, schedule, prefix)
        batch_size += 1
        kv_tokens += sum(schedule)
        prefix = 0
    return seconds, batch_size, kv_tokens
