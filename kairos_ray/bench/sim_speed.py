"""Benchmark: how fast ``kairos sim`` replays a whole trace, and how it scales with the cluster.

    python -m kairos_ray.bench.sim_speed [--trace FILE] [--policy kairos] [--command] [--json]

Replays the trace (default: the Azure 2023 conversation trace, 19,366
requests, from ``../shared/traces`` beside the project) on 2P2D at its own
rate, then on 4P4D, 8P8D and 16P16D with the rate scaled by the same factor
as the cluster, so every node sees the same load. Prints wall time, requests
and events per second for each size (median of ``--repeats`` runs): the
event loop alone. ``--command`` also times the whole ``kairos sim --trace
FILE --policies POLICY`` command as a user runs it (a fresh interpreter:
imports, loading, simulating, the CSVs and the plots), median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from kairos_ray.config import KairosConfig
from kairos_ray.sim.run import SimSetup, check_specs
from kairos_ray.workloads.traces import load_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "azure_llm_2023_conv.csv"


Row = dict[str, float | int | str]


def run(trace: Path, policy: str, sizes: Sequence[int], repeats: int) -> list[Row]:
    base = load_trace(trace)
    rows: list[Row] = []
    for size in sizes:
        setup = SimSetup.from_config(KairosConfig(), prefill=size, decode=size)
        workload = base.scaled_to_rate(base.rate_rps * size / 2)
        walls, events = [], 0
        for _ in range(repeats):
            start = time.perf_counter()
            result = setup.simulate(policy, workload)
            walls.append(time.perf_counter() - start)
            events = result.events
        wall = statistics.median(walls)
        rows.append(
            {
                "cluster": f"{size}P{size}D",
                "policy": policy,
                "requests": len(workload),
                "rps": round(workload.rate_rps, 2),
                "wall_s": round(wall, 3),
                "requests_per_s": round(len(workload) / wall),
                "events": events,
                "events_per_s": round(events / wall),
            }
        )
    return rows


def run_command(trace: Path, policy: str, repeats: int) -> Row:
    """Wall time of the whole ``kairos sim`` command on ``trace`` at its own rate (2P2D), median of ``repeats``."""
    walls = []
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "kairos_ray.cli", "sim", "--trace", str(trace), "--policies", policy]
        for _ in range(repeats):
            start = time.perf_counter()
            subprocess.run([*command, "--out", out], check=True, capture_output=True)
            walls.append(time.perf_counter() - start)
    return {
        "command": f"kairos sim --trace {trace.name} --policies {policy}",
        "wall_s": round(statistics.median(walls), 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kairos_ray.bench.sim_speed", description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="trace to replay (default: Azure conv)")
    parser.add_argument("--policy", default="kairos", help="policy spec (default kairos)")
    parser.add_argument("--sizes", default="2,4,8,16", help="P = D cluster sizes (default 2,4,8,16)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per size; the median is reported (3)")
    parser.add_argument("--command", action="store_true", help="also time the whole kairos sim command")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        parser.error(f"no trace at {args.trace}; pass --trace FILE")
    check_specs([args.policy])
    sizes = [int(s) for s in args.sizes.split(",")]
    for row in run(args.trace, args.policy, sizes, max(1, args.repeats)):
        if args.json:
            print(json.dumps(row))
        else:
            print(
                f"{row['cluster']:>7} {row['policy']}: {row['requests']} requests at {row['rps']} req/s in "
                f"{row['wall_s']} s ({row['requests_per_s']} req/s, {row['events']} events, "
                f"{row['events_per_s']} events/s)"
            )
    if args.command:
        row = run_command(args.trace, args.policy, max(1, args.repeats))
        print(json.dumps(row) if args.json else f"{row['command']}: {row['wall_s']} s, whole command")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
