"""The same workload and seed through `kairos sim` and through the live app, side by side.

    .venv/bin/python scripts/sim_vs_live.py --config serve_configs/2p2d-emulated.yaml --rates 1,2,4

Starts a local Ray and Serve in this process and, for each rate, a fresh
deployment of the config's application (emulated engines replay the
simulator's timing, so the two should agree; a fresh app's prefix caches are
empty, as the simulator's), replays a synthetic workload with the load
generator, runs the simulator on the very same requests, and prints both
summaries with the ratio of each figure, the rate the load generator
achieved, the CPU the serving path spent per streamed token (every Serve
process of the app: proxy, ingress, router and its actor, engine replicas), in all and per
process, and the router's decisions as the ingress waited for them (P50 and
P99 from asking to the reply). ``--idle S`` first measures each process's CPU per second while no
request runs. Ray starts with ``kairos_ray.serve.CLUSTER_ENV``. With
``--profile DIR``, py-spy samples each of those processes during the last
rate's replay and the script prints where each spent its time (the functions
on top of the stacks, and the busiest stacks' frames from this project, Ray
and asyncio). Everything it started is shut down at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from ray import serve

from kairos_ray.bench.loadgen import replay, wait_until_routed
from kairos_ray.bench.local import local_serve
from kairos_ray.bench.serving_cost import cpu_s, own_cpu_s, router_calls, serving_processes
from kairos_ray.config import load_config
from kairos_ray.metrics import summarize
from kairos_ray.serve import build_app
from kairos_ray.sim.run import SimSetup, compare_rows
from kairos_ray.workloads.synthetic import synthetic


def start_spies(processes: list[Any], out: Path, seconds: float) -> list[tuple[str, subprocess.Popen[bytes], Path]]:
    """One py-spy sampler per process, writing collapsed stacks (``--format raw``) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    spy = Path(sys.executable).parent / "py-spy"
    spies = []
    for p in processes:
        path = out / f"{p.name.replace('#', '-')}.txt"
        command = [str(spy), "record", "--pid", str(p.pid), "--rate", "200", "--format", "raw", "--nonblocking",
                   "--duration", str(int(seconds)), "--output", str(path)]  # fmt: skip
        spies.append((p.name, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), path))
    return spies


def hot_spots(name: str, path: Path, top: int = 8) -> str:
    """The functions on top of a process's sampled stacks (self time), as shares of its samples."""
    leaves: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines() if path.exists() else ():
        stack, _, count = line.rpartition(" ")
        frames = [f for f in stack.split(";") if f]
        if not frames or not count.isdigit():
            continue
        total += int(count)
        leaves[frames[-1]] += int(count)
    lines = [f"py-spy {name}: {total} samples at 200 Hz while it ran (idle waits included)"]
    for frame, count in leaves.most_common(top):
        lines.append(f"  {100 * count / max(1, total):5.1f} %  {frame[:150]}")
    return "\n".join(lines)


def per_process(values: dict[str, float], scale: float, unit: str) -> str:
    """``name value`` pairs, largest first."""
    ranked = sorted(values.items(), key=lambda item: -item[1])
    return ", ".join(f"{name} {scale * value:.3f}" for name, value in ranked) + f" ({unit})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="serve_configs/2p2d-emulated.yaml", help="a Serve config of the app")
    parser.add_argument("--rates", default="1,2,4", help="request rates, comma-separated")
    parser.add_argument("--workload", default="bursty")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", metavar="DIR", help="py-spy the serving processes during the last rate's replay")
    parser.add_argument("--idle", type=float, default=0.0, metavar="S", help="first measure the idle app's CPU for S s")
    args = parser.parse_args()
    (application,) = yaml.safe_load(Path(args.config).read_text())["applications"]
    app_args = application["args"]
    kairos = load_config(args.config)
    model = app_args["decode_config"]["model_loading_config"]["model_id"]
    with local_serve(log_to_driver=False) as url:
        setup = SimSetup.from_config(kairos, None, 2, 2, args.seed)
        rates = [float(r) for r in args.rates.split(",")]
        for rps in rates:
            # a fresh app per rate, as the simulator starts: the same prompts would find the last rate's prefix caches
            serve.run(build_app(app_args), name="kairos", route_prefix="/")
            wait_until_routed(url, model, within_s=600)
            processes = serving_processes("kairos")
            if args.idle and rps == rates[0]:
                before = {p: cpu_s(p.pid) for p in processes}
                time.sleep(args.idle)
                idle = {p.name: (cpu_s(p.pid) - before[p]) / args.idle for p in processes}
                print(f"idle: {1e3 * sum(idle.values()):.1f} ms of CPU per second", per_process(idle, 1e3, "ms/s"))
            workload = synthetic(args.workload, rps, args.requests, args.seed)
            spies = []
            if args.profile and rps == rates[-1]:
                spies = start_spies(processes, Path(args.profile), workload.requests[-1].arrival_s + 30)
            before = {p: cpu_s(p.pid) for p in processes}
            own = own_cpu_s()
            result = asyncio.run(replay(url, model, workload))
            spent_by = {p.name: cpu_s(p.pid) - before[p] for p in processes}
            spent = sum(spent_by.values())
            own = own_cpu_s() - own
            tokens = sum(r.output_tokens for r in result.records)
            live = summarize(result.records, kairos.slo, "live", rps, failed=len(result.failures))
            simulated = setup.simulate(kairos.policy.name, workload)
            sim = summarize(simulated.records, kairos.slo, "sim", rps)
            print(f"\n{args.workload}, {args.requests} requests, seed {args.seed}, {rps:g} req/s "
                  f"({len(result.failures)} failed; sent at {result.achieved_rps:.2f} req/s, "
                  f"P50 send lag {1e3 * result.p50_send_lag_s:.1f} ms)")  # fmt: skip
            print(compare_rows(sim, live))
            print(f"serving path CPU {1e3 * spent / max(1, tokens):.3f} ms per streamed token ({tokens} tokens); "
                  f"load generator {1e3 * own / max(1, tokens):.3f} ms", flush=True)  # fmt: skip
            print("  per process:", per_process(spent_by, 1e3 / max(1, tokens), "ms/token"), flush=True)
            print(router_calls(url), flush=True)
            for name, spy, path in spies:
                spy.wait()
                print(hot_spots(name, path))
            serve.delete("kairos")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
