"""CPU the serving path spends per streamed token: replay a workload against a running app and read every
process's CPU time before and after.

    python -m kairos_ray.bench.serving_cost --url http://127.0.0.1:8000 --workload bursty --rps 4 --requests 100

The serving path is every Serve process of the app (the HTTP proxy, the
ingress, the router's replica and its actor, every engine replica: for
emulated engines their step loops only sleep, so all they spend is
serving-path work; for vLLM engines the engine core's own processes are not
counted). The load generator runs in this process and is reported apart.
Run it on the app's host, connected to its Ray cluster. Prints CPU
milliseconds per streamed token per process and in all, the replay's
summary, and the router's decisions as the ingress waited for them (from
asking to the reply, P50 and P99 over the ingress's last minute, from
``GET /kairos/state``).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time
from dataclasses import dataclass

import psutil
import ray

from kairos_ray.bench import faults
from kairos_ray.bench.loadgen import replay, served_model
from kairos_ray.top import fetch
from kairos_ray.workloads.synthetic import synthetic


@dataclass(frozen=True, slots=True)
class Process:
    name: str  # e.g. "Ingress", "decode#ab12", "proxy"
    pid: int


def serving_processes(app: str) -> list[Process]:
    """The proxy (and its child processes), every replica of ``app`` and its router's actor, on this host."""
    named = ray.util.list_named_actors(all_namespaces=True)
    found = []
    for actor in named:
        name = actor["name"]
        if actor["namespace"] != "serve":
            continue
        if name.startswith(f"SERVE_REPLICA::{app}#"):
            label = name.split("#", 1)[1]
        elif name.startswith("SERVE_PROXY_ACTOR"):
            label = "proxy"
        else:
            continue
        pid = faults.replica_pid(ray.get_actor(name, namespace="serve"))
        found.append(Process(label, pid))
        if label == "proxy":  # and what it runs: HAProxy in Serve's HAProxy mode
            found += [Process(f"proxy:{child.name()}", child.pid) for child in psutil.Process(pid).children()]
    try:  # the router's actor takes the decisions and reports
        found.append(Process("router-actor", faults.replica_pid(faults.router_actor(app))))
    except Exception as exc:  # an app without one (another app, an older Kairos): its processes are all above
        print(f"serving_cost: no router actor in {app!r} ({type(exc).__name__}); its Serve processes only")
    return sorted(found, key=lambda p: p.name)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 once it is gone)."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(times.user + times.system)


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def router_calls(url: str, api_key: str | None = None) -> str:
    """The router's decisions as the app's ingress waited for them in its last minute (``ServiceLive``)."""
    try:
        service = fetch(url, api_key).service
    except ValueError as exc:
        return f"router calls: {exc}"
    if service.p50_router_call_s is None or service.p99_router_call_s is None:
        return "router calls: none in the ingress's last minute"
    return (
        f"router calls at the ingress (asking to the reply, last {service.window_s:.0f} s): "
        f"P50 {1e3 * service.p50_router_call_s:.2f} ms, P99 {1e3 * service.p99_router_call_s:.2f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--app", default="kairos", help="the Serve application name")
    parser.add_argument("--address", default="auto", help="Ray cluster address")
    parser.add_argument("--workload", default="bursty")
    parser.add_argument("--rps", type=float, default=4.0)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--context", type=int, default=32_768)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    ray.init(address=args.address, log_to_driver=False)
    processes = serving_processes(args.app)
    model = asyncio.run(served_model(args.url))
    workload = synthetic(args.workload, args.rps, args.requests, args.seed, args.context)
    before = {p: cpu_s(p.pid) for p in processes}
    own_before, start = own_cpu_s(), time.monotonic()
    result = asyncio.run(replay(args.url, model, workload))
    wall_s, own_s = time.monotonic() - start, own_cpu_s() - own_before
    spent = {p: cpu_s(p.pid) - before[p] for p in processes}
    tokens = sum(r.output_tokens for r in result.records)
    print(f"{len(result.records)} requests, {len(result.failures)} failed, {tokens} tokens in {wall_s:.1f} s")
    print(f"{'process':<22} {'CPU s':>8} {'CPU ms/token':>13}")
    for p, seconds in spent.items():
        print(f"{p.name:<22} {seconds:>8.2f} {1e3 * seconds / max(1, tokens):>13.3f}")
    total = sum(spent.values())
    print(f"{'serving path':<22} {total:>8.2f} {1e3 * total / max(1, tokens):>13.3f}")
    print(f"{'load generator':<22} {own_s:>8.2f} {1e3 * own_s / max(1, tokens):>13.3f}")
    print(router_calls(args.url))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
