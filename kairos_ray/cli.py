"""The ``kairos`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import yaml

from kairos_ray import __version__
from kairos_ray.config import ConfigError, KairosConfig, load_config
from kairos_ray.workloads.synthetic import WORKLOADS

T = TypeVar("T")

DESCRIPTION = """\
Kairos-Ray: load-aware prefill deflection for disaggregated LLM serving.

For each request, Kairos estimates the time to first token on the prefill
path and, for every decode node, builds the largest TBT-safe shrinking chunk
schedule; it runs the prefill on the decode node when that is clearly faster.
"""

EPILOG = """\
examples:
  kairos demo                          decide a burst of 12 requests on a 2P2D cluster
  kairos demo --policy sl:2048         the same burst under a static baseline
  kairos sim --workload bursty --rps 2,4,8 --policies pd,kairos
                                       what deflection buys on bursty traffic, no GPU needed
  kairos bench --url http://127.0.0.1:8000 --workload bursty --rps 4
                                       replay a workload against a live server
  kairos top --url http://127.0.0.1:8000
                                       watch a running app's nodes, refreshed every second
  kairos config show > kairos.yaml     write the default configuration
  kairos config check kairos.yaml      validate a configuration file
  kairos profile -o steps.csv          time a real vLLM engine's steps (the tiny CPU model by default)
  kairos fit steps.csv -o profile.json fit the step-latency model to measured steps
  kairos chaos --url http://127.0.0.1:8000
                                       inject faults into a running app under load
  kairos soak --duration-s 3600 --skip-s 600 --rps 3 --fault-every-s 300 --plot soak.png
                                       an hour under load and faults: does any Serve process grow?
"""


def _config(path: str | None) -> KairosConfig:
    return load_config(path) if path else KairosConfig()


def _cmd_demo(args: argparse.Namespace) -> int:
    from kairos_ray.demo import run_burst

    policy = _config(args.config).build_policy(args.policy)
    run_burst(policy, args.requests, args.seed, sys.stdout)
    return 0


def _cmd_config_show(args: argparse.Namespace) -> int:
    print(yaml.safe_dump(_config(args.config).model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _cmd_config_check(args: argparse.Namespace) -> int:
    load_config(args.file)
    print(f"{args.file}: ok")
    return 0


def _cmd_chaos(args: argparse.Namespace) -> int:
    from kairos_ray.bench.chaos import run_command

    return run_command(args)


def _cmd_soak(args: argparse.Namespace) -> int:
    from kairos_ray.bench.soak import run_command

    return run_command(args)


def _cmd_fit(args: argparse.Namespace) -> int:
    from kairos_ray.profiling.fit import fit, read_table
    from kairos_ray.profiling.plot import plot_fit

    table = read_table(args.table)
    result = fit(table, holdout=args.holdout, seed=args.seed, tile_tokens=args.tile_tokens)
    Path(args.output).write_text(result.model.to_json() + "\n")
    plot = plot_fit(table, result.model, Path(args.plot or Path(args.output).with_suffix(".png")), result.holdout_mape)
    print(
        f"fitted on {result.num_train} rows; held-out MAPE {100 * result.holdout_mape:.2f} % "
        f"on {result.num_holdout} rows; wrote {args.output} and {plot}"
    )
    return 0


def _cmd_sim(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from tqdm import tqdm

    from kairos_ray.core import AdmissionMode
    from kairos_ray.sim.run import SimSetup, check_specs, sweep, write_outputs
    from kairos_ray.workloads.synthetic import synthetic
    from kairos_ray.workloads.traces import load_trace

    specs = [s.strip() for s in args.policies.split(",") if s.strip()]
    check_specs(specs)
    setup = SimSetup.from_config(_config(args.config), args.profile, args.prefill, args.decode, args.seed)
    if args.admission:
        setup = setup.with_admission(AdmissionMode(args.admission))
    setup = replace(
        setup, probe_every=args.probe_shed, node_models=args.node_models == "own", router_shards=args.router_shards
    )
    if args.router_shards > setup.num_decode:
        raise ValueError(f"--router-shards {args.router_shards}: more shards than the {setup.num_decode} decode nodes")
    if args.trace:
        trace = load_trace(args.trace).clipped_to_context(setup.hardware.context_tokens)
        if trace.clipped:
            print(
                f"{args.trace}: {trace.clipped} requests clipped to the {setup.hardware.context_tokens}-token context"
            )
        runs = [(rps, trace.scaled_to_rate(rps)) for rps in args.rps] if args.rps else [(trace.rate_rps, trace)]
    else:
        rates = args.rps or [2.0, 4.0, 6.0, 8.0, 10.0, 12.0]
        runs = [(rps, synthetic(args.workload, rps, args.requests, args.seed)) for rps in rates]
    if args.priorities:
        runs = [(rps, workload.with_priorities(args.priorities, args.seed)) for rps, workload in runs]
    total = len(specs) * sum(len(w) for _, w in runs) * (2 if args.router_shards > 1 else 1)
    with tqdm(total=total, unit="req", desc="simulating", disable=None) as bar:
        summary, rows, _ = sweep(setup, specs, runs, bar.update)
        # sharded: the same runs with one router, to show what sharding cost
        one = sweep(replace(setup, router_shards=1), specs, runs, bar.update)[0] if args.router_shards > 1 else []
    out = Path(args.out)
    written = write_outputs(out, summary, rows, setup.config.slo, plots=not args.no_plots)
    print(
        f"{'policy':<10} {'rps':>6} {'P95 TTFT':>9} {'P95 TBT':>8} {'TBT viol':>8} {'SLO att':>8} {'deflected':>9} "
        f"{'shed':>6} {'goodput':>8}"
    )
    for row in summary:
        print(
            f"{row['policy']:<10} {row['rps']:>6.2f} {row['p95_ttft_s']:>8.2f}s {1000 * row['p95_tbt_s']:>6.1f}ms "
            f"{row['tbt_violation_pct']:>7.2f}% {row['slo_attainment_pct']:>7.1f}% {row['deflections']:>9} "
            f"{row['shed_pct']:>5.1f}% {row['goodput_rps']:>8.2f}"
        )
    if one:
        print(f"\n{args.router_shards} router shards against one router (the same runs):")
        print(f"{'policy':<10} {'rps':>6} {'P95 TTFT 1':>10} {'P95 TTFT S':>10} {'change':>7} {'kept from better':>16}")
        for sharded, single in zip(summary, one, strict=True):
            a, b = single["p95_ttft_s"], sharded["p95_ttft_s"]
            change = f"{100 * (b / a - 1):>+6.1f}%" if a else f"{'-':>7}"
            print(
                f"{sharded['policy']:<10} {sharded['rps']:>6.2f} {a:>9.2f}s {b:>9.2f}s {change} "
                f"{sharded['shard_kept_pct']:>15.2f}%"
            )
    print(f"wrote {', '.join(str(p) for p in written)}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import asyncio

    import httpx
    import numpy as np
    from tqdm import tqdm

    from kairos_ray.bench.loadgen import replay, served_model
    from kairos_ray.metrics import RECORD_COLUMNS, SUMMARY_COLUMNS, record_rows, summarize, write_csv
    from kairos_ray.metrics.plots import plot_all
    from kairos_ray.workloads.synthetic import synthetic
    from kairos_ray.workloads.traces import load_trace

    slo = _config(args.config).slo
    if args.trace:
        workload = load_trace(args.trace).clipped_to_context(args.context)
        if args.rps:
            workload = workload.scaled_to_rate(args.rps[0])
        if args.requests:
            workload = workload.head(args.requests)
    else:
        workload = synthetic(args.workload, (args.rps or [2.0])[0], args.requests or 200, args.seed, args.context)
    if args.priorities:
        workload = workload.with_priorities(args.priorities, args.seed)
    url = args.url.rstrip("/")
    try:
        model = args.model or asyncio.run(served_model(url))
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {url}: {exc}") from None
    with tqdm(total=len(workload), unit="req", desc=f"replaying at {workload.rate_rps:.2f} req/s", disable=None) as bar:
        result = asyncio.run(replay(url, model, workload, args.timeout, bar.update, args.retry_shed))
    rps = round(workload.rate_rps, 3)
    row = summarize(result.records, slo, args.label, rps, failed=len(result.failures))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "summary.csv", SUMMARY_COLUMNS, [row])
    write_csv(out / "requests.csv", RECORD_COLUMNS, record_rows(result.records, slo, args.label, rps))
    written = [out / "summary.csv", out / "requests.csv", *plot_all([row], out, slo)] if result.records else []
    for line in result.failures[:10]:
        print(f"failed: {line}")
    print(
        f"sent at {result.achieved_rps:.2f} req/s against {result.scheduled_rps:.2f} scheduled; "
        f"send lag P50 {1e3 * result.p50_send_lag_s:.1f} ms, max {1e3 * result.max_send_lag_s:.1f} ms"
    )
    if result.behind:
        print("warning: the load generator fell behind the schedule by more than 2 %: this machine is too busy to "
              "replay this workload at this rate; the figures describe a lighter load", file=sys.stderr)  # fmt: skip
    shed = sum(r.shed for r in result.records)
    print(
        f"{len(result.records) - shed} of {len(workload)} requests served in {result.wall_s:.1f} s "
        f"({shed} shed, {len(result.failures)} failed); "
        f"P50/P95 TTFT {row['p50_ttft_s']:.3f}/{row['p95_ttft_s']:.3f} s, "
        f"P95 TBT {1000 * row['p95_tbt_s']:.1f} ms, {row['tbt_violation_pct']:.2f} % TBT violations, "
        f"SLO attainment {row['slo_attainment_pct']:.1f} % ({row['admitted_slo_attainment_pct']:.1f} % of those "
        f"admitted), goodput {row['goodput_rps']:.2f} req/s, {row['deflections']} deflected"
    )
    answers = [r.shed_answer_s for r in result.records if r.shed]
    if answers:
        p50, p99 = np.percentile(answers, [50, 99])
        print(f"shed requests answered (429) in P50 {1e3 * p50:.1f} ms, P99 {1e3 * p99:.1f} ms (last try)")
    if written:
        print(f"wrote {', '.join(str(p) for p in written)}")
    if args.compare_sim:
        from kairos_ray.sim.run import SimSetup, compare_rows

        config = _config(args.config)
        setup = SimSetup.from_config(config, None, args.prefill, args.decode, args.seed)
        simulated = setup.simulate(config.policy.name, workload)
        sim_row = summarize(simulated.records, slo, config.policy.name, rps)
        print(compare_rows(sim_row, row))
    return 0 if result.records else 1


def _cmd_profile(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kairos_ray.profiling.fit import write_table
    from kairos_ray.profiling.profiler import TINY_MODEL, make_engine, profile

    batch_sizes, contexts, chunks, prefixes = args.batch_sizes, args.contexts, args.chunks, args.prefixes
    print(f"profile: starting vLLM on {args.model or 'the shipped tiny model'} (tens of seconds on a CPU)")
    llm = make_engine(
        args.model or TINY_MODEL,
        max(batch_sizes),
        max(chunks),
        max(contexts),
        max(prefixes),
        **dict(args.engine_arg),
    )
    cells = len(batch_sizes) * len(contexts)
    with tqdm(total=cells, unit="cell", desc="profiling", disable=None) as bar:
        table = profile(llm, batch_sizes, contexts, chunks, args.repeats, bar.update, prefixes)
    write_table(args.output, table)
    print(f"profile: {len(table)} grid points (each the median of {args.repeats} steps) written to {args.output}")
    if args.fit:
        return _cmd_fit(
            argparse.Namespace(table=args.output, output=args.fit, holdout=0.2, seed=0, plot=None, tile_tokens=1)
        )
    return 0


def _cmd_top(args: argparse.Namespace) -> int:
    from kairos_ray.top import run

    return run(args.url, args.interval, args.once, args.api_key)


def _engine_arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def _arg_type(convert: Callable[[str], T], valid: Callable[[T], bool], what: str, rule: str) -> Callable[[str], T]:
    """An argparse ``type``: ``convert`` the text, then insist on ``valid``; errors say what was expected."""

    def parse(text: str) -> T:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not valid(value):
            raise argparse.ArgumentTypeError(f"{rule}, got {text}")
        return value

    return parse


def _numbers(kind: Callable[[str], T]) -> Callable[[str], list[T]]:
    return lambda text: [kind(part) for part in text.split(",") if part.strip()]


def _shares(text: str) -> dict[int, float]:
    """``CLASS:WEIGHT,...`` -> {class: weight}."""
    shares = {}
    for part in text.split(","):
        name, sep, weight = part.partition(":")
        if not sep:
            raise ValueError(text)
        shares[int(name)] = float(weight)
    return shares


_positive_int = _arg_type(int, lambda v: v >= 1, "an integer", "must be >= 1")
_non_negative_int = _arg_type(int, lambda v: v >= 0, "an integer", "must be >= 0")
_positive_float = _arg_type(float, lambda v: v > 0, "a number", "must be > 0")
_non_negative_float = _arg_type(float, lambda v: v >= 0, "a number", "must be >= 0")
_fraction = _arg_type(float, lambda v: 0.0 < v < 1.0, "a number", "must be between 0 and 1")
_rates = _arg_type(
    _numbers(float), lambda v: bool(v) and min(v) > 0, "a comma-separated list of rates", "rates must be > 0 requests/s"
)
_priority_shares = _arg_type(
    _shares,
    lambda v: bool(v) and min(v.values()) >= 0 and sum(v.values()) > 0,
    "a comma-separated list of PRIORITY:WEIGHT",
    "weights must be >= 0, not all 0",
)


def _pool(text: str) -> object:
    """``kairos sim``'s ``--prefill``/``--decode``: N, or N:PROFILE groups (``sim.run.parse_groups``)."""
    from kairos_ray.sim.run import parse_groups

    try:
        return parse_groups(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_ints = _arg_type(
    _numbers(int), lambda v: bool(v) and min(v) >= 0, "a comma-separated list of integers", "values must be >= 0"
)


def _add_source(parser: argparse.ArgumentParser) -> None:
    """What to replay: a synthetic workload or a trace (sim and bench)."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workload", choices=WORKLOADS, help="synthetic workload")
    source.add_argument("--trace", metavar="FILE", help="Azure / Mooncake (.jsonl) / BurstGPT / plain CSV trace")


def _add_run_options(parser: argparse.ArgumentParser, config_use: str, seeds: str, out: str) -> None:
    """--config, --seed and --out, as sim and bench share them."""
    parser.add_argument("--config", metavar="FILE", help=f"Kairos configuration YAML ({config_use})")
    parser.add_argument("--seed", type=int, default=0, help=f"seed of {seeds} (0)")
    parser.add_argument("--out", default=out, metavar="DIR", help=f"output directory ({out})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kairos", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"kairos-ray {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    demo = commands.add_parser(
        "demo",
        help="decide a burst of requests on a 2P2D cluster and print each decision",
        description="Decide a seeded burst of requests on a busy 2P2D cluster with the scheduling core, "
        "updating the cluster view after every decision as the live router does.",
    )
    demo.add_argument("--policy", metavar="SPEC", help="kairos, pd, sq:<theta> or sl:<tokens> (default: from config)")
    demo.add_argument("--requests", type=_positive_int, default=12, metavar="N", help="requests in the burst (12)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the prompt lengths (0)")
    demo.add_argument("--config", metavar="FILE", help="Kairos configuration YAML (default: built-in defaults)")
    demo.set_defaults(func=_cmd_demo)

    config = commands.add_parser(
        "config", help="show or check a configuration", description="Show or check a configuration."
    )
    config_commands = config.add_subparsers(title="commands", metavar="COMMAND", required=True)
    show = config_commands.add_parser("show", help="print the effective configuration as YAML")
    show.add_argument("--config", metavar="FILE", help="configuration to load (default: built-in defaults)")
    show.set_defaults(func=_cmd_config_show)
    check = config_commands.add_parser("check", help="validate a configuration file")
    check.add_argument("file", metavar="FILE")
    check.set_defaults(func=_cmd_config_check)

    sim = commands.add_parser(
        "sim",
        help="simulate policies on a disaggregated cluster (no GPU needed)",
        description="Discrete-event simulation of prefill and decode pools, deciding with the very same "
        "policies as the live router. Writes OUT/summary.csv, OUT/requests.csv and plots (unless --no-plots).",
    )
    _add_source(sim)
    sim.add_argument(
        "--rps",
        type=_rates,
        metavar="R1,R2,...",
        help="rates to run (default for a workload 2,4,...,12; a trace without it runs at its own rate)",
    )
    sim.add_argument(
        "--policies",
        default="pd,sq:1,sl:1024,sl:2048,kairos,oracle",
        metavar="SPECS",
        help="comma-separated policy specs, oracle included (default %(default)s)",
    )
    sim.add_argument("--requests", type=_positive_int, default=2000, metavar="N", help="requests per synthetic run")
    sim.add_argument(
        "--prefill",
        type=_pool,
        default=2,
        metavar="N[:PROFILE],...",
        help="prefill nodes: N of the profile, or groups N:PROFILE of a mixed fleet, e.g. 2:a100-deepseek-v2-lite (2)",
    )
    sim.add_argument(
        "--decode",
        type=_pool,
        default=2,
        metavar="N[:PROFILE],...",
        help="decode nodes, as --prefill: e.g. 2:a100-deepseek-v2-lite,2:h100-deepseek-v2-lite (2)",
    )
    sim.add_argument("--profile", metavar="FILE", help="step-latency profile (default: the config's)")
    sim.add_argument(
        "--node-models",
        choices=("own", "pool"),
        default="own",
        help="price each node with its own group's profile (own), or every node with --profile's (pool): what a "
        "router that knows one model per pool would decide (default %(default)s)",
    )
    sim.add_argument(
        "--router-shards",
        type=_positive_int,
        default=1,
        metavar="S",
        help="divide the decode nodes among S router shards, each deciding on its own nodes (and every prefill "
        "node); prints how often a node of another shard would have served a request sooner, and P95 TTFT against "
        "one router on the same runs (default 1: one router)",
    )
    sim.add_argument("--no-plots", action="store_true", help="write the CSVs only, no PNG plots")
    sim.add_argument(
        "--admission",
        choices=("off", "shed"),
        help="shed what no route serves within the TTFT objective, and protect decode steps (default: the config's)",
    )
    sim.add_argument(
        "--priorities",
        type=_priority_shares,
        metavar="P:W,...",
        help="give requests vLLM priorities at random in these proportions, e.g. 0:1,1:3 (lower is more important)",
    )
    sim.add_argument(
        "--probe-shed",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="replay every N-th shed request admitted, to report how many would have met the SLO (0: none)",
    )
    _add_run_options(sim, "SLOs, policy knobs, admission", "workloads, priorities and step noise", "sim-out")
    sim.set_defaults(func=_cmd_sim)

    bench = commands.add_parser(
        "bench",
        help="replay a workload or trace against an OpenAI-compatible server",
        description="Open-loop load generator: sends each request at its arrival time as a streaming "
        "/v1/completions call to any OpenAI-compatible URL (Kairos-Ray, vLLM, Ray Serve LLM) and records "
        "TTFT, every TBT gap and the x-kairos-* breakdown. Writes OUT/summary.csv, OUT/requests.csv, plots.",
    )
    bench.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (%(default)s)")
    bench.add_argument("--model", help="model name (default: the first in /v1/models)")
    _add_source(bench)
    bench.add_argument("--rps", type=_rates, metavar="R", help="rate (default: 2 for a workload, a trace's own)")
    bench.add_argument("--requests", type=_positive_int, metavar="N", help="requests (workload: 200; trace: all)")
    bench.add_argument("--context", type=_positive_int, default=32_768, help="clip lengths to this context (32768)")
    bench.add_argument("--label", default="live", help="policy column of the summary (%(default)s)")
    bench.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds (600)")
    bench.add_argument(
        "--retry-shed",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="send a request the server shed (429, x-kairos-shed) again after its Retry-After, up to N times "
        "(0: count it as shed at once)",
    )
    bench.add_argument(
        "--priorities",
        type=_priority_shares,
        metavar="P:W,...",
        help="give requests vLLM priorities at random in these proportions, e.g. 0:1,1:3 (lower is more important)",
    )
    bench.add_argument(
        "--compare-sim",
        action="store_true",
        help="also run the same workload and seed through `kairos sim` (the config's policy and profile, "
        "--prefill/--decode nodes) and print both summaries side by side",
    )
    bench.add_argument("--prefill", type=_positive_int, default=2, help="prefill nodes, with --compare-sim (2)")
    bench.add_argument("--decode", type=_positive_int, default=2, help="decode nodes, with --compare-sim (2)")
    _add_run_options(bench, "for the SLO", "a synthetic workload", "bench-out")
    bench.set_defaults(func=_cmd_bench)

    from kairos_ray.top import columns_help

    top = commands.add_parser(
        "top",
        help="a live view of a running app: every node's queue, batch, KV and steps, the last minute's latencies",
        description="A live terminal view of a running Kairos-Ray app, refreshed every second from its\n"
        "GET /kairos/state: a line per node, then the last minute at the ingress (requests,\n"
        "deflected share, P95 TTFT and TBT, fallbacks, rejections). Ctrl-C quits.",
        epilog=f"columns:\n{columns_help()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_argument("--url", default="http://127.0.0.1:8000", help="the app's base URL (%(default)s)")
    top.add_argument("--interval", type=_positive_float, default=1.0, metavar="S", help="seconds between refreshes (1)")
    top.add_argument("--once", action="store_true", help="print the view once and exit (for scripts and logs)")
    top.add_argument(
        "--api-key",
        default=os.environ.get("KAIROS_ADMIN_API_KEY") or os.environ.get("KAIROS_API_KEY"),
        metavar="KEY",
        help="an admin API key of the app, when it has keys (default: $KAIROS_ADMIN_API_KEY, else $KAIROS_API_KEY)",
    )
    top.set_defaults(func=_cmd_top)

    prof = commands.add_parser(
        "profile",
        help="time a real vLLM engine's steps over a grid (for kairos fit)",
        description="Drive an in-process vLLM engine through a grid of decode batch sizes, contexts (resident KV), "
        "injected chunk sizes and the chunk's own prefix (tokens of its request prefilled before it), timing each "
        "step; writes the table kairos fit reads. Defaults profile the tiny CPU model shipped in the package; on a "
        "GPU node pass --model and larger grids.",
    )
    prof.add_argument("--model", help="model directory or name (default: the shipped tiny model, dummy weights)")
    prof.add_argument("--batch-sizes", type=_ints, default=[1, 4, 16], help="decode batch sizes (1,4,16)")
    prof.add_argument("--contexts", type=_ints, default=[128, 512], help="prompt tokens per decoding request (128,512)")
    prof.add_argument("--chunks", type=_ints, default=[0, 64, 128, 256, 512], help="chunk sizes (0,64,128,256,512)")
    prof.add_argument(
        "--prefixes",
        type=_ints,
        default=[0, 512, 1024, 2048],
        help="own prefix of each chunk: its request's tokens prefilled before it (0,512,1024,2048)",
    )
    prof.add_argument(
        "--repeats", type=_positive_int, default=3, help="steps timed per grid point; the table holds their median (3)"
    )
    prof.add_argument(
        "--engine-arg",
        type=_engine_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a vLLM engine argument, e.g. tensor_parallel_size=8 (repeatable; VALUE is JSON or a string)",
    )
    prof.add_argument("-o", "--output", required=True, metavar="STEPS.csv", help="where to write the measured steps")
    prof.add_argument("--fit", metavar="PROFILE.json", help="also fit the model and write the profile here")
    prof.set_defaults(func=_cmd_profile)

    fit = commands.add_parser(
        "fit",
        help="fit the step-latency model (Eq. 4) to measured steps",
        description="Fit T_step(B, K, chi, P) to a CSV of measured steps "
        "(columns batch_size, kv_tokens, chunk_tokens, prefix_tokens, step_s; prefix_tokens may be absent) "
        "and report the held-out MAPE.",
    )
    fit.add_argument("table", metavar="TABLE.csv", help="measured steps")
    fit.add_argument("-o", "--output", required=True, metavar="PROFILE.json", help="where to write the fitted profile")
    fit.add_argument("--holdout", type=_fraction, default=0.2, help="share of steps held out for the MAPE (0.2)")
    fit.add_argument("--seed", type=int, default=0, help="seed of the hold-out split (0)")
    fit.add_argument(
        "--tile-tokens",
        type=_positive_int,
        default=1,
        metavar="N",
        help="the engine runs prefill tokens in tiles of N, a partial tile costing a whole one (1: no tiles)",
    )
    fit.add_argument("--plot", metavar="FILE.png", help="predicted-vs-measured plot (default: beside the profile)")
    fit.set_defaults(func=_cmd_fit)

    from kairos_ray.bench.chaos import add_arguments as chaos_arguments

    chaos = commands.add_parser(
        "chaos",
        help="inject faults into a running app under load; print what clients saw",
        description="Inject each fault in turn into a running Kairos app while it serves a bursty workload, and "
        "print per fault: requests completed, failed with a clean error, hung, lost, and the time to recover.",
    )
    chaos_arguments(chaos)
    chaos.set_defaults(func=_cmd_chaos)

    from kairos_ray.bench.chaos import FAULTS
    from kairos_ray.bench.soak import WORKLOADS as SOAK_WORKLOADS

    soak = commands.add_parser(
        "soak",
        help="drive a running app for hours, with faults if asked; report whether its Serve processes grow",
        description="Drive a running Kairos app at a steady (Poisson) or bursty rate for --duration-s,\n"
        "with kairos chaos's faults in turn every --fault-every-s if asked, and sample the RSS\n"
        "and open file descriptors of the app's Serve processes on this host (its replicas, each\n"
        "router shard's actor, the Serve controller and proxy) every --sample-s.\n\n"
        "Prints per process its RSS and FDs at the start and the end of the measured window (the\n"
        "run after --skip-s) and their least-squares growth per hour and per 1,000 requests; a\n"
        "replica that a fault replaced is a new process, reported as replacing the old one and\n"
        "measured from --skip-s after it came (its own warm-up left out). Then\n"
        "the requests sent, completed, failed with a clean error (429s also counted apart: shed),\n"
        "hung and lost, as kairos chaos counts them. Run it on the app's host, connected to its\n"
        "Ray cluster.",
        epilog="example: the growth over the last 50 minutes of an hour at 3 req/s, a fault every 5 min:\n"
        "  kairos soak --duration-s 3600 --skip-s 600 --rps 3 --fault-every-s 300 \\\n"
        "      --faults decode-replica-kill,prefill-replica-kill,router-kill --plot soak.png --json soak.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    faults = _arg_type(
        lambda text: [f.strip() for f in text.split(",") if f.strip()],
        lambda chosen: bool(chosen) and set(chosen) <= set(FAULTS),
        "a list of faults",
        f"faults are comma-separated, each one of {', '.join(FAULTS)}",
    )
    soak.add_argument("--url", default="http://127.0.0.1:8000", help="the app's base URL (%(default)s)")
    soak.add_argument("--app", default="kairos", help="the Serve application name (%(default)s)")
    soak.add_argument("--model", help="model name (default: the first in /v1/models)")
    soak.add_argument("--address", default="auto", help="the app's Ray cluster (%(default)s: the one on this host)")
    soak.add_argument(
        "--workload",
        choices=SOAK_WORKLOADS,
        default="lpld",
        help="synthetic workload: its lengths and arrivals, Poisson for lpld..hphd, gamma clumps for bursty "
        "(%(default)s)",
    )
    soak.add_argument("--rps", type=_positive_float, default=2.0, metavar="R", help="mean requests per second (2)")
    soak.add_argument("--duration-s", type=_positive_float, default=3600.0, metavar="S", help="how long to send (3600)")
    soak.add_argument(
        "--skip-s", type=_non_negative_float, default=600.0, metavar="S", help="warm-up left out of the growth (600)"
    )
    soak.add_argument("--sample-s", type=_positive_float, default=5.0, metavar="S", help="seconds between samples (5)")
    soak.add_argument(
        "--fault-every-s", type=_positive_float, metavar="S", help="inject a fault this often (default: no faults)"
    )
    soak.add_argument(
        "--faults",
        type=faults,
        metavar="F1,F2,...",
        help=f"the faults, injected in turn (with --fault-every-s; default all: {', '.join(FAULTS)})",
    )
    soak.add_argument(
        "--stop-s", type=_positive_float, default=15.0, metavar="S", help="engine-stop's and router-stop's length (15)"
    )
    soak.add_argument(
        "--hang-s", type=_positive_float, default=180.0, metavar="S", help="no complete answer by then: hung (180)"
    )
    soak.add_argument("--context", type=_positive_int, default=32_768, help="clip lengths to this context (32768)")
    soak.add_argument("--seed", type=int, default=0, help="seed of the workload (0)")
    soak.add_argument("--plot", metavar="FILE.png", help="write RSS and FDs over time per process, faults marked")
    soak.add_argument("--json", metavar="FILE.json", help="write the report as JSON")
    soak.set_defaults(func=_cmd_soak)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"kairos: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"kairos: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    raise SystemExit(main())
