"""Microbenchmark: how long one ``kairos`` decision takes in the router, on realistic fleets.

A fleet's view is drawn from a seeded generator: heavy-tailed prompts up to
32K tokens (log-normal, median 2K), prefill queues of 0-8 requests, decode
nodes with 1-128 running requests, their resident KV, and 0-2 deflections
already committed to each. Then, as in the router, each decision sees the
view the last one left (``apply_decision``: the ledger) with
``--reports`` nodes' fresh reports in it (random nodes drawn again): a
fleet that serves traffic in proportion to its size sends the router a
number of reports per decision that does not grow with it. Timed per
decision: the reports taken into the view, the decision, the ledger step.
The sequence is replayed ``--repeats`` times with a fresh policy and each
decision keeps its fastest (as ``timeit`` does: the rest is other processes
on a shared machine, not the decision); the report gives the median and 99th
percentile over decisions and the throughput of one pass back to back.

``--cold`` times each decision on a view of its own, every node new to the
policy (what a decision cost before the router kept its index, and what one
costs after the fleet changes). ``--exhaustive`` prices every node
(``policy.prune: false``); ``--admission`` turns admission on, as in the
shipped apps (hand-offs then go where their first token comes first).
``--mixed PROFILE`` makes the fleet mixed: every other decode node carries
that profile's model (``DecodeNodeView.model``; the index keeps a model's
nodes apart). ``--prefix`` times ``kairos+prefix``, each
decision given the prefix hits of its request: about half the nodes hold a
random whole-block share of the prompt (``scenarios.random_hits``).

    python -m kairos_ray.bench.decision --decode-nodes 64 --json [--prefix] [--cold] [--exhaustive]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kairos_ray.config import KairosConfig, resolve_profile
from kairos_ray.core import (
    ClusterView,
    DecodeNodeView,
    PrefillNodeView,
    PrefixHits,
    StepLatencyModel,
    apply_decision,
    with_nodes,
)
from kairos_ray.scenarios import prompt_tokens, random_decode_node, random_hits, random_prefill_node, random_view

OUTPUT_TOKENS = 256  # what each decided request reserves on its decode node (the ledger's output tokens)


@dataclass(frozen=True, slots=True)
class _Case:
    """One decision's inputs: its prompt, its hits, and the reports that reach the router before it."""

    tokens: int
    hits: PrefixHits | None
    reports: tuple[PrefillNodeView | DecodeNodeView, ...]
    view: ClusterView | None  # --cold: the view it is decided on


def run(
    num_decode: int,
    num_prefill: int = 2,
    decisions: int = 5000,
    seed: int = 0,
    repeats: int = 3,
    prefix: bool = False,
    reports: int = 4,
    cold: bool = False,
    exhaustive: bool = False,
    admission: bool = False,
    mixed: str | None = None,
) -> dict[str, float | int | bool | str]:
    """Time ``decisions`` kairos decisions (module docstring); returns the JSON report."""
    config = KairosConfig.model_validate(
        {"policy": {"prune": not exhaustive}, "admission": {"mode": "shed" if admission else "off"}}
    )
    spec = "kairos+prefix" if prefix else "kairos+blind"
    params = config.policy_params()
    decode_model = config.predictor.load()
    rng, hits_rng = random.Random(seed), random.Random(seed + 1)  # the same views either way
    candidates, budget = params.chunk_candidates, params.tbt_budget_s
    other = StepLatencyModel.load(resolve_profile(mixed)) if mixed else None

    def own(node: DecodeNodeView) -> DecodeNodeView:
        """``--mixed``: odd decode nodes carry the other model."""
        return replace(node, model=other) if other and int(node.node_id.rsplit("-", 1)[1]) % 2 else node

    def mixed_view(view: ClusterView) -> ClusterView:
        return ClusterView(view.prefill, tuple(map(own, view.decode))) if other else view

    fleet = mixed_view(random_view(rng, decode_model, num_prefill, num_decode, candidates, budget))
    cases = []
    for _ in range(decisions):
        tokens = prompt_tokens(rng)
        view = mixed_view(random_view(rng, decode_model, num_prefill, num_decode, candidates, budget)) if cold else None
        news: list[PrefillNodeView | DecodeNodeView] = []
        for _ in range(0 if cold else reports):
            index = rng.randrange(num_prefill + num_decode)
            if index < num_prefill:
                news.append(random_prefill_node(rng, index))
            else:
                news.append(own(random_decode_node(rng, decode_model, index - num_prefill, candidates, budget)))
        hits = random_hits(hits_rng, view or fleet, tokens) if prefix else None
        cases.append(_Case(tokens, hits, tuple(news), view))
    timings_ns = [math.inf] * decisions
    deflected = 0
    pass_s = math.inf
    for _ in range(repeats):
        policy = config.build_policy(spec, model=decode_model)
        view, deflected = fleet, 0
        pass_start = time.perf_counter()
        for i, case in enumerate(cases):
            start = time.perf_counter_ns()
            current = case.view or with_nodes(view, case.reports) or view
            decision = policy.decide(case.tokens, current, case.hits, output_tokens=OUTPUT_TOKENS)
            view = current if cold else apply_decision(current, case.tokens, decision, OUTPUT_TOKENS)
            timings_ns[i] = min(timings_ns[i], time.perf_counter_ns() - start)
            deflected += decision.deflected
        pass_s = min(pass_s, time.perf_counter() - pass_start)
    timings_ns.sort()
    return {
        "decode_nodes": num_decode,
        "prefill_nodes": num_prefill,
        "prefix_aware": prefix,
        "mode": "cold" if cold else f"router, {reports} reports per decision",
        "pruned": not exhaustive,
        "admission": admission,
        "mixed": mixed or "",
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
    parser.add_argument(
        "--reports",
        type=int,
        default=4,
        metavar="N",
        help="node reports the router takes in between two decisions (default 4)",
    )
    parser.add_argument("--cold", action="store_true", help="every decision on a view of its own, all nodes new")
    parser.add_argument("--exhaustive", action="store_true", help="price every node (policy.prune: false)")
    parser.add_argument(
        "--admission", action="store_true", help="admission on (admission.mode: shed), as the shipped apps run"
    )
    parser.add_argument(
        "--mixed", metavar="PROFILE", help="every other decode node carries this profile's model (a mixed fleet)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a sentence")
    args = parser.parse_args(argv)
    for flag in ("decode_nodes", "prefill_nodes", "decisions", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.reports < 0:
        parser.error(f"--reports must be >= 0, got {args.reports}")
    if args.mixed:
        try:
            resolve_profile(args.mixed)
        except ValueError as exc:
            parser.error(f"--mixed: {exc}")
    report = run(
        args.decode_nodes,
        args.prefill_nodes,
        args.decisions,
        args.seed,
        args.repeats,
        args.prefix,
        args.reports,
        args.cold,
        args.exhaustive,
        args.admission,
        args.mixed,
    )
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{report['decisions']} {'prefix-aware ' if args.prefix else ''}decisions, "
            f"{report['prefill_nodes']}P{report['decode_nodes']}D ({report['mode']}"
            f"{'' if report['pruned'] else ', every node priced'}{', admission on' if report['admission'] else ''}): "
            f"p50 {report['p50_us']} us, p99 {report['p99_us']} us, "
            f"{report['decisions_per_s']} decisions/s, {report['deflected_pct']} % deflected"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
