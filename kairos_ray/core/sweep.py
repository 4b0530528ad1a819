"""TBT-safe shrinking chunk schedules (paper Eq. 5, LargestSafe).

A schedule X = [chi_1 .. chi_m] for a prompt of l_r tokens on a decode node
with B_n decoding requests and K_n resident KV tokens is safe when every step
satisfies

    T_step(B_n, K_n + P_i, chi_i, P_i) <= beta * tau,   P_i = sum_{j<i} chi_j       (Eq. 5)

P_i is the chunk's own prefix: its attention spans the request's earlier
chunks (Eq. 4, ``core.latency``), and their KV is resident too. LargestSafe
builds X greedily: each step takes the largest candidate that satisfies Eq. 5
at the prefix reached so far. Since the prefix grows, the largest safe chunk
shrinks step by step; we also never let a chunk grow back (candidates are
scanned downwards once), so schedules are non-increasing even for a fitted
model with odd signs. The last chunk is only what is left of the prompt (a
step with fewer tokens than the candidate), so sum(X) == l_r; it is checked at
its real size.

A prompt whose first ``prefix_tokens`` the node's cache already holds is
scheduled for its uncached suffix only, P_1 = prefix_tokens: the chunks
start from a long context (and its KV is resident, in K), so they are smaller
than a cold prompt's and sum(X) is the suffix.

Runs of equal chunks are counted and priced in closed form
(``StepLatency.safe_steps``, ``StepLatency.run_s``), so a sweep costs
O(number of candidates), not O(number of steps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kairos_ray.core.latency import StepLatency

Runs = list[tuple[int, int]]
"""A schedule in run-length form: [(chunk_tokens, num_steps), ...]."""


def largest_safe_runs(
    model: StepLatency,
    batch_size: int,
    kv_tokens: int,
    prompt_tokens: int,
    candidates: Sequence[int],
    tbt_budget_s: float,
    limit_s: float = math.inf,
    prefix_tokens: int = 0,
) -> tuple[Runs, float] | None:
    """LargestSafe in run-length form with its Eq. 6 time, or None.

    None when some step has no safe candidate, or as soon as the time exceeds
    ``limit_s`` (a caller looking for the fastest node passes the best so far).
    ``candidates`` must be strictly decreasing; ``tbt_budget_s`` is beta * tau.
    ``prompt_tokens`` are the tokens to compute, after ``prefix_tokens`` of
    the request already in KV (a cached prefix; ``kv_tokens`` excludes them).
    """
    runs: Runs = []
    seconds = 0.0
    remaining = prompt_tokens
    prefix = prefix_tokens  # the request's tokens already in KV: the next chunk's own prefix
    for chunk in candidates:
        if chunk < remaining:
            full = remaining // chunk
            steps = model.safe_steps(batch_size, kv_tokens + prefix, chunk, full, tbt_budget_s, prefix)
            if steps:
                runs.append((chunk, steps))
                seconds += model.run_s(batch_size, kv_tokens + prefix, chunk, steps, prefix)
                if seconds > limit_s:
                    return None
                remaining -= steps * chunk
                prefix += steps * chunk
                if remaining == 0:
                    return runs, seconds
            if steps < full:
                continue  # this chunk stopped being safe: shrink
        # remaining <= chunk: every candidate from here down to `remaining` schedules the same last step.
        last_s = model.step_s(batch_size, kv_tokens + prefix, remaining, prefix)
        if last_s <= tbt_budget_s:
            runs.append((remaining, 1))
            return (runs, seconds + last_s) if seconds + last_s <= limit_s else None
    return None


def expand(runs: Runs) -> tuple[int, ...]:
    """Run-length form to the flat tuple of chunk sizes."""
    flat: list[int] = []
    for chunk, count in runs:
        flat += [chunk] * count
    return tuple(flat)


def tbt_safe_schedule(
    model: StepLatency,
    batch_size: int,
    kv_tokens: int,
    prompt_tokens: int,
    candidates: Sequence[int],
    tbt_budget_s: float,
    prefix_tokens: int = 0,
) -> tuple[int, ...] | None:
    """The greedy shrinking TBT-safe schedule X (Eq. 5), or None when the node is infeasible.

    Every step of X satisfies Eq. 5, chunks never grow, and sum(X) == prompt_tokens, the tokens to
    compute after ``prefix_tokens`` already in KV (a cached prefix: the first chunk's own prefix).
    """
    found = largest_safe_runs(
        model, batch_size, kv_tokens, prompt_tokens, candidates, tbt_budget_s, prefix_tokens=prefix_tokens
    )
    return None if found is None else expand(found[0])


def largest_safe_chunk(
    model: StepLatency,
    batch_size: int,
    kv_tokens: int,
    planned_tokens: int,
    candidates: Sequence[int],
    tbt_budget_s: float,
    prefix_tokens: int = 0,
) -> int:
    """The engine-side guard of Eq. 5: how much of a planned chunk fits this step, 0 if nothing does.

    The router plans a schedule for the B and K it sees; by the time a chunk
    runs, other requests may have joined the batch. The decode engine runs
    ``planned_tokens`` if that still fits beta * tau, else the largest smaller
    candidate that does, else no prefill this step (it retries the next one).
    ``kv_tokens`` is the node's resident KV now (the request's own prefix
    included) and ``prefix_tokens`` the request's tokens prefilled so far.
    With no decode batch there is no TBT to protect: the plan runs as is.
    """
    if batch_size == 0 or model.step_s(batch_size, kv_tokens, planned_tokens, prefix_tokens) <= tbt_budget_s:
        return planned_tokens
    for chunk in candidates:
        if chunk < planned_tokens and model.step_s(batch_size, kv_tokens, chunk, prefix_tokens) <= tbt_budget_s:
            return chunk
    return 0
