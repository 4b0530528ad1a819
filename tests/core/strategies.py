"""Hypothesis strategies and small reference implementations for the core tests."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from kairos_ray.core import ClusterView, DecodeNodeView, PrefillNodeView, StepLatency, StepLatencyModel

# A hand-checkable model in the paper's form, the chunk priced by all resident KV:
# T = 0.01 + 0.001 B + chi * (1e-4 + 1e-7 K)
SIMPLE = StepLatencyModel(c0=0.01, c_batch=0.001, c_kv=0.0, c_chunk=1e-4, c_chunk_kv=1e-7, c_chunk_sq=0.0)
# The same numbers with the chunk priced by its own prefix P instead: T = 0.01 + 0.001 B + chi * (1e-4 + 1e-7 P)
OWN = StepLatencyModel(
    c0=0.01, c_batch=0.001, c_kv=0.0, c_chunk=1e-4, c_chunk_kv=0.0, c_chunk_sq=0.0, c_chunk_prefix=1e-7
)

CANDIDATES = (2048, 1024, 512, 256, 128, 64)


@st.composite
def models(draw: st.DrawFn) -> StepLatencyModel:
    """Non-negative linear models around A100-like magnitudes."""
    return StepLatencyModel(
        c0=draw(st.floats(0.002, 0.05)),
        c_batch=draw(st.floats(0.0, 2e-4)),
        c_kv=draw(st.floats(0.0, 1e-7)),
        c_chunk=draw(st.floats(0.0, 1e-4)),
        c_chunk_kv=draw(st.floats(0.0, 1e-9)),
        c_chunk_sq=draw(st.floats(0.0, 1e-7)),
        c_chunk_prefix=draw(st.floats(0.0, 1e-8)),
        c_prefix=draw(st.floats(0.0, 1e-6)),
        c_batch_sq=draw(st.floats(0.0, 1e-6)),
        tile_tokens=draw(st.sampled_from((1, 16, 128))),
    )


candidate_sets = st.lists(st.integers(16, 4096), min_size=1, max_size=7, unique=True).map(
    lambda xs: tuple(sorted(xs, reverse=True))
)
prompts = st.integers(1, 32_768)
budgets = st.floats(0.005, 0.3)


@st.composite
def decode_nodes(draw: st.DrawFn, index: int) -> DecodeNodeView:
    kv_tokens = draw(st.integers(0, 400_000))
    committed = draw(st.lists(st.lists(st.integers(1, 2048), min_size=1, max_size=6).map(tuple), max_size=3))
    return DecodeNodeView(
        f"decode-{index}",
        batch_size=draw(st.integers(0, 128)),
        kv_tokens=kv_tokens,
        free_kv_tokens=draw(st.integers(0, 1_000_000)),
        committed=tuple(committed),
        head_prefilled_tokens=draw(st.integers(0, 4096)) if committed else 0,
    )


@st.composite
def views(draw: st.DrawFn) -> ClusterView:
    prefill = tuple(
        PrefillNodeView(
            f"prefill-{i}",
            tuple(draw(st.lists(st.integers(1, 32_768), max_size=8))),
            head_prefilled_tokens=draw(st.integers(0, 4096)),
        )
        for i in range(draw(st.integers(1, 3)))
    )
    decode = tuple(draw(decode_nodes(i)) for i in range(draw(st.integers(1, 4))))
    return ClusterView(prefill, decode)


def reference_largest_safe(
    model: StepLatency, batch_size: int, kv_tokens: int, prompt_tokens: int, candidates: Sequence[int], budget_s: float
) -> tuple[int, ...] | None:
    """LargestSafe one step at a time, straight from Eq. 5: the largest candidate (never growing back) that fits."""
    schedule: list[int] = []
    i, remaining, prefix = 0, prompt_tokens, 0
    while remaining > 0:
        while (
            i < len(candidates)
            and model.step_s(batch_size, kv_tokens + prefix, min(candidates[i], remaining), prefix) > budget_s
        ):
            i += 1
        if i == len(candidates):
            return None
        chunk = min(candidates[i], remaining)
        schedule.append(chunk)
        remaining -= chunk
        prefix += chunk
    return tuple(schedule)
