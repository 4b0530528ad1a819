"""A burst of requests hits a 2P2D cluster; the core decides each one and the view keeps up.

Every decision is applied to the view before the next request is decided
(``apply_decision``), as the live router's ledger does, so later requests see
the prefill queues and the decode-node commitments that earlier ones created.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TextIO

from kairos_ray.core import ClusterView, Decision, Policy, apply_decision
from kairos_ray.core.estimate import runs_of
from kairos_ray.scenarios import burst_view, prompt_tokens


def describe_schedule(schedule: Sequence[int]) -> str:
    """Compact chunk schedule, e.g. ``512x6 256x2 100``."""
    return " ".join(f"{chunk}x{count}" if count > 1 else str(chunk) for chunk, count in runs_of(schedule))


def describe_view(view: ClusterView) -> list[str]:
    lines = [
        f"  {node.node_id}: {node.num_queued} queued, {sum(node.queued_prompt_tokens)} prompt tokens to prefill"
        for node in view.prefill
    ]
    lines += [
        f"  {node.node_id}: batch {node.batch_size}, {node.kv_tokens} KV tokens, "
        f"{len(node.committed)} deflections committed ({node.committed_tokens} tokens)"
        for node in view.decode
    ]
    return lines


def run_burst(
    policy: Policy, num_requests: int, seed: int, out: TextIO
) -> tuple[list[tuple[int, Decision]], ClusterView]:
    """Decide a burst of ``num_requests`` seeded prompts, printing each decision; returns them and the final view."""
    rng = random.Random(seed)
    view = burst_view()
    print(f"policy {policy.spec}; cluster before the burst:", file=out)
    print("\n".join(describe_view(view)), file=out)
    header = f"{'req':>3} {'prompt':>6}  {'route':<7} {'node':<9} {'TTFT_pf':>8} {'TTFT_dec':>8}  chunks / reason"
    print("\n" + header, file=out)
    decisions = []
    for i in range(num_requests):
        tokens = prompt_tokens(rng)
        decision = policy.decide(tokens, view)
        view = apply_decision(view, tokens, decision)
        decisions.append((tokens, decision))
        node = decision.decode_node if decision.deflected else decision.prefill_node
        ttft_dec = "-" if decision.ttft_decode_s is None else f"{decision.ttft_decode_s:.3f}s"
        ttft_pf = "-" if decision.ttft_prefill_s is None else f"{decision.ttft_prefill_s:.3f}s"
        detail = f"[{describe_schedule(decision.chunk_schedule)}] " if decision.deflected else ""
        print(
            f"{i:>3} {tokens:>6}  {decision.route.value:<7} {node:<9} {ttft_pf:>8} {ttft_dec:>8}  "
            f"{detail}{decision.reason}",
            file=out,
        )
    deflected = sum(d.deflected for _, d in decisions)
    print(f"\n{deflected} of {num_requests} requests deflected; cluster after the burst:", file=out)
    print("\n".join(describe_view(view)), file=out)
    return decisions, view
