"""Microbenchmark: how long one ``kairos`` decision takes on realistic cluster views.

Views are drawn once, up front, from a seeded generator: heavy-tailed prompts
up to 32K tokens (log-normal, median 2K), prefill queues of 0-8 requests,
decode nodes with 1-128 running requests, their resident KV, and 0-2
deflections already committed to each. Each decision is timed alone with
``perf_counter_ns``, ``--repeats`` times, keeping the fastest (as ``timeit``
does: the rest is other processes on a shared machine, not the decision); the
report gives the median and 99th percentile over views and the throughput of
one pass of decisions back to back.

``--prefix`` times ``kairos+prefix`` on the same views, each decision given
the prefix hits of its request: about half the nodes hold a random
whole-block share of the prompt (``scenarios.random_hits``).

    python -m kairos_ray.bench.decision --decode-nodes 64 --json [--prefix]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Sequence

from kairos_ray.config import KairosConfig
from kairos_ray.scenarios import prompt_tokens, random_hits, random_view


def run(
    num_decode: int,
    num_prefill: int = 2,
    decisions: int = 5000,
    seed: int = 0,
    repeats: int = 3,
    prefix: bool = False,
) -> dict[str, float | int | bool]:
    """Time ``decisions`` kairos decisions (``prefix``: prefix-aware, with hits); returns the JSON report."""
    config = KairosConfig()
    policy = config.build_policy("kairos+prefix" if prefix else "kairos+blind")
    params = config.policy_params()
    decode_model = config.predictor.load()
    rng, hits_rng = random.Random(seed), random.Random(seed + 1)  # the same views either way
    cases = []
    for _ in range(decisions):
        tokens = prompt_tokens(rng)
        view = random_view(rng, decode_model, num_prefill, num_decode, params.chunk_candidates, params.tbt_budget_s)
        cases.append((tokens, view, random_hits(hits_rng, view, tokens) if prefix else None))
    timings_ns = [math.inf] * decisions
    deflected = 0
    pass_s = math.inf
    for _ in range(repeats):
        deflected = 0
        pass_start = time.perf_counter()
        for i, (tokens, view, hits) in enumerate(cases):
            start = time.perf_counter_ns()
            decision = policy.decide(tokens, view, hits)
            timings_ns[i] = min(timings_ns[i], time.perf_counter_ns() - start)
            deflected += decision.deflected
        pass_s = min(pass_s, time.perf_counter() - pass_start)
    timings_ns.sort()
    return {
        "decode_nodes": num_decode,
        "prefill_nodes": num_prefill,
        "prefix_aware": prefix,
        "decisions": decisions,
        "repeats": repeats,
        "p50_us": round(timings_ns[len(timings_ns) // 2] / 1e3, 2),
        "p99_us": round(timings_ns[min(len(timings_ns) - 1, int(len(timings_ns) * 0.99))] / 1e3, 2),
        "decisions_per_s": round(decisions / pass_s),
        "deflected_pct": round(100 * deflected / decisions, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kairos_ray.bench.decision",
        description="Time kairos routing decisions (Algorithm 1) on realistic, seeded cluster views.",
    )
    parser.add_argument(
        "--decode-nodes", type=int, default=2, metavar="N", help="decode nodes in each view (default 2)"
    )
    parser.add_argument(
        "--prefill-nodes", type=int, default=2, metavar="N", help="prefill nodes in each view (default 2)"
    )
    parser.add_argument("--decisions", type=int, default=5000, metavar="N", help="decisions to time (default 5000)")
    parser.add_argument(
        "--repeats", type=int, default=3, metavar="N", help="passes; each view keeps its fastest (default 3)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the view generator (default 0)")
    parser.add_argument("--prefix", action="store_true", help="time kairos+prefix, each request with prefix hits")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a sentence")
    args = parser.parse_args(argv)
    for flag in ("decode_nodes", "prefill_nodes", "decisions", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    report = run(args.decode_nodes, args.prefill_nodes, args.decisions, args.seed, args.repeats, args.prefix)
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{report['decisions']} {'prefix-aware ' if args.prefix else ''}decisions, "
            f"{report['prefill_nodes']}P{report['decode_nodes']}D: "
            f"p50 {report['p50_us']} us, p99 {report['p99_us']} us, "
            f"{report['decisions_per_s']} decisions/s, {report['deflected_pct']} % deflected"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
