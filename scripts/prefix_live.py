"""Prefix-aware against cache-blind Kairos on the live app: the same multi-turn conversations, one run each.

    .venv/bin/python scripts/prefix_live.py --config serve_configs/2p2d-cpu.yaml --rps 1 --requests 40

Starts a local Ray (with ``kairos_ray.serve.CLUSTER_ENV``) and Serve in this
process, deploys the config's application once per policy spec (fresh
engines, so both start with empty prefix caches), replays the same
``multiturn`` conversations with the load generator (each turn's prompt
holds the last turn's prompt and the answer the server gave,
``bench.loadgen.Conversations``) and prints one row per policy: P50/P95
TTFT, TBT violations, deflections, and the prompt tokens the computing nodes
found cached (``x-kairos-cached-tokens``). The default conversations are
``workloads.multiturn``'s, shrunk to what a 2-core CPU serves in a minute
(``--cpu-sized``, on by default): a 512-token system prompt, first messages
around 256 tokens, later ones around 64, answers around 96, 3 s of thinking.
Everything it started is shut down at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import math
from pathlib import Path

import yaml
from ray import serve

from kairos_ray.bench.loadgen import replay, wait_until_routed
from kairos_ray.bench.local import local_serve
from kairos_ray.config import load_config
from kairos_ray.metrics import summarize
from kairos_ray.serve import build_app
from kairos_ray.workloads.multiturn import MULTITURN, MultiTurnSpec, multiturn
from kairos_ray.workloads.synthetic import LogNormal

CPU_SIZED = MultiTurnSpec(
    system_prompt_tokens=512,
    mean_turns=4.0,
    first_message=LogNormal(256, 0.5),
    next_message=LogNormal(64, 0.5),
    answer=LogNormal(96, 0.5),
    think_median_s=3.0,
    think_sigma=0.5,
    block_tokens=16,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="serve_configs/2p2d-cpu.yaml", help="a Serve config of the app")
    parser.add_argument("--policies", default="kairos+prefix,kairos+blind", help="policy specs, comma-separated")
    parser.add_argument("--rps", type=float, default=1.0)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--context", type=int, default=4096, help="the app's context, tokens")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--full-sized", action="store_true", help="workloads.multiturn's own lengths and times")
    args = parser.parse_args()
    (application,) = yaml.safe_load(Path(args.config).read_text())["applications"]
    slo = load_config(args.config).slo
    model = application["args"]["decode_config"]["model_loading_config"]["model_id"]
    spec = MULTITURN if args.full_sized else CPU_SIZED
    workload = multiturn(args.rps, args.requests, args.seed, args.context, spec)
    rows = []
    with local_serve(log_to_driver=False) as url:
        for policy in args.policies.split(","):
            app_args = {**application["args"]}
            app_args["kairos"] = {**app_args["kairos"], "policy": {**app_args["kairos"]["policy"], "name": policy}}
            serve.run(build_app(app_args), name="kairos", route_prefix="/")
            wait_until_routed(url, model, within_s=900)
            result = asyncio.run(replay(url, model, workload))
            row = summarize(result.records, slo, policy, round(workload.rate_rps, 3), failed=len(result.failures))
            cached = [r.cached_tokens for r in result.records if r.cached_tokens is not None]
            prompt = sum(r.prompt_tokens for r in result.records)
            row["cached_pct"] = 100 * sum(cached) / prompt if prompt else math.nan
            rows.append(row)
            serve.delete("kairos")  # the next policy starts on fresh engines, its caches empty
    print(f"multiturn ({'full' if args.full_sized else 'CPU'}-sized), {args.requests} requests at "
          f"{workload.rate_rps:.2f} req/s, seed {args.seed}, {args.config}")  # fmt: skip
    print("| policy | P50 TTFT (s) | P95 TTFT (s) | TBT viol. % | deflected | failed | prompt cached % "
          "| hit: prefill route % | hit: deflected % |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['p50_ttft_s']:.3f} | {r['p95_ttft_s']:.3f} | {r['tbt_violation_pct']:.2f} "
              f"| {r['deflections']} | {r['failed']} | {r['cached_pct']:.1f} | {r['prefill_hit_pct']:.1f} "
              f"| {r['deflect_hit_pct']:.1f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
