"""Seeded example cluster states and prompt lengths, for the demo and the decision benchmark."""

from __future__ import annotations

import random
from collections.abc import Sequence

from kairos_ray.core import ClusterView, DecodeNodeView, PrefillNodeView, PrefixHits, StepLatency, tbt_safe_schedule

MAX_CONTEXT_TOKENS = 32_768
DECODE_KV_CAPACITY_TOKENS = 1_000_000


def prompt_tokens(rng: random.Random) -> int:
    """Heavy-tailed prompt length in [16, 32K] tokens (log-normal, median 2048)."""
    return max(16, min(MAX_CONTEXT_TOKENS, round(rng.lognormvariate(7.6, 1.0))))


def random_view(
    rng: random.Random,
    model: StepLatency,
    num_prefill: int,
    num_decode: int,
    candidates: Sequence[int],
    budget_s: float,
) -> ClusterView:
    """A cluster state as a busy 2-pool deployment would report it."""
    prefill = tuple(random_prefill_node(rng, i) for i in range(num_prefill))
    decode = tuple(random_decode_node(rng, model, i, candidates, budget_s) for i in range(num_decode))
    return ClusterView(prefill, decode)


def random_prefill_node(rng: random.Random, index: int) -> PrefillNodeView:
    """A busy prefill node's report: 0-8 queued prompts, the head now and then under way."""
    return PrefillNodeView(
        f"prefill-{index}",
        tuple(prompt_tokens(rng) for _ in range(rng.randint(0, 8))),
        head_prefilled_tokens=rng.choice((0, 0, 2048)),
    )


def random_decode_node(
    rng: random.Random, model: StepLatency, index: int, candidates: Sequence[int], budget_s: float
) -> DecodeNodeView:
    """A busy decode node's report: 1-128 running requests, their KV, 0-2 deflections committed."""
    batch_size = rng.randint(1, 128)
    kv_tokens = min(DECODE_KV_CAPACITY_TOKENS // 2, sum(prompt_tokens(rng) for _ in range(batch_size)))
    committed = tuple(
        schedule
        for _ in range(rng.randint(0, 2))
        if (schedule := tbt_safe_schedule(model, batch_size, kv_tokens, prompt_tokens(rng), candidates, budget_s))
    )
    return DecodeNodeView(f"decode-{index}", batch_size, kv_tokens, DECODE_KV_CAPACITY_TOKENS - kv_tokens, committed)


def random_hits(rng: random.Random, view: ClusterView, prompt_tokens: int, block_tokens: int = 16) -> PrefixHits:
    """What the nodes' caches might hold of a prompt: about half the nodes a random whole-block share of it
    (a conversation's history, a shared system prompt), the others nothing."""
    usable = (prompt_tokens - 1) // block_tokens
    nodes = [n.node_id for n in view.prefill] + [n.node_id for n in view.decode]
    return PrefixHits({node: rng.randint(0, usable) * block_tokens for node in nodes if rng.random() < 0.5})


def burst_view() -> ClusterView:
    """A 2P2D cluster as a burst hits it: prefill queues already busy, one decode node light, one heavy."""
    return ClusterView(
        prefill=(
            PrefillNodeView("prefill-0", (6144, 2048, 9000), head_prefilled_tokens=2048),
            PrefillNodeView("prefill-1", (12288, 3500)),
        ),
        decode=(
            DecodeNodeView(
                "decode-0", batch_size=24, kv_tokens=60_000, free_kv_tokens=DECODE_KV_CAPACITY_TOKENS - 60_000
            ),
            DecodeNodeView(
                "decode-1", batch_size=96, kv_tokens=300_000, free_kv_tokens=DECODE_KV_CAPACITY_TOKENS - 300_000
            ),
        ),
    )
