"""The router's live decision latency and ceiling, through the router's actor, as the ingress and engines call it.

    python -m kairos_ray.bench.router_latency --rps 4 --decisions 120 --seconds 10

Starts a local Ray (with the app's ``CLUSTER_ENV``) and Serve with one ``Router`` replica (the app's own
deployment) and reaches its ``RouterActor`` through a ``RouterLink``, as the
ingress and the engines do. Four engine nodes (2 prefill, 2 decode, seeded
busy states from ``kairos_ray.scenarios``) keep its view fresh with reports
at the engines' rate, each acknowledging the decisions sent to it since its
last report, as engines do when they take a request. Then:

- latency: decisions sent open loop at ``--rps``, each timed from the call to
  its reply (p50, p99); then, as the floor under it, the same calls to a
  method that does nothing, over a TCP line as the router's (``serve.wire``)
  and as a plain Ray actor call (what the line saves: a Ray call's round
  trip varies from host to host and day to day);
- ceiling: ``--callers`` concurrent callers, each sending its next decision
  as soon as the last is answered, for ``--seconds``; decisions per second,
  one call per decision and in batches of ``--batch`` (``decide_many``, as
  the ingress batches the decisions of one event-loop tick).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import numpy as np
import ray
from ray import serve

from kairos_ray.config import KairosConfig
from kairos_ray.core import DecodeNodeView, PrefillNodeView
from kairos_ray.messages import DecisionRequest, NodeState, RoutingReply, WireAddress
from kairos_ray.scenarios import prompt_tokens, random_view
from kairos_ray.serve import use_cluster_env
from kairos_ray.serve.router import Router
from kairos_ray.serve.router_link import RouterLink
from kairos_ray.serve.types import RouterOptions
from kairos_ray.serve.wire import WireClient, WireServer


def node_states(seed: int) -> list[NodeState]:
    config = KairosConfig()
    params = config.policy_params()
    view = random_view(random.Random(seed), config.predictor.load(), 2, 2, params.chunk_candidates, params.tbt_budget_s)
    views: list[PrefillNodeView | DecodeNodeView] = [*view.prefill, *view.decode]
    return [NodeState(v, "bench", time.time()) for v in views]


DECIDED: dict[str, list[int]] = {}  # node id -> request ids sent to it since its last report
CALL_TIMEOUT_S = 10.0  # a decision the bench waits for longer has failed


async def keep_reporting(link: RouterLink, states: list[NodeState], interval_s: float) -> None:
    """Each node reports every ``interval_s``, acknowledging the decisions sent to it since its last report."""
    while True:
        for state in states:
            taken = DECIDED.pop(state.node_id, [])
            link.report(replace(state, wall_s=time.time(), accepted_request_ids=tuple(taken)))
        await asyncio.sleep(interval_s)


def decided(replies: list[RoutingReply], requests: list[DecisionRequest]) -> None:
    """Every node a decision names acknowledges it in its next report: a prefill node as it takes the request,
    a decode node as a deflection's node does, or once a hand-off's KV has arrived (here: at once)."""
    for reply, request in zip(replies, requests, strict=True):
        for node in (reply.decision.prefill_node, reply.decision.decode_node):
            if node is not None:
                DECIDED.setdefault(node, []).append(request.request_id)


async def open_loop(call: Callable[[], Awaitable[None]], rps: float, count: int, seed: int) -> list[float]:
    """``count`` calls sent open loop at ``rps`` (exponential gaps), each timed from the call to its reply."""
    rng = random.Random(seed)
    times: list[float] = []

    async def one() -> None:
        start = time.perf_counter()
        await call()
        times.append(time.perf_counter() - start)

    tasks = []
    for _ in range(count):
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(rng.expovariate(rps))
    await asyncio.gather(*tasks)
    return times


def request_maker(seed: int, batch: int = 1, first_id: int = 1 << 40) -> Callable[[], list[DecisionRequest]]:
    """``batch`` decision requests per call, new ids from ``first_id``, prompt lengths as in the app's scenarios."""
    rng = random.Random(seed)
    ids = itertools.count(first_id)
    return lambda: [DecisionRequest(next(ids), prompt_tokens(rng), 256) for _ in range(batch)]


def one_decision(link: RouterLink, seed: int) -> Callable[[], Awaitable[None]]:
    make = request_maker(seed)

    async def call() -> None:
        requests = make()
        decided(await link.decide(requests, CALL_TIMEOUT_S), requests)

    return call


@ray.remote(num_cpus=0)
class Echo:
    """An actor whose ``decide_many`` does nothing, on a TCP line as the router's and as a Ray method: floors."""

    def decide_many(self, requests: list[DecisionRequest]) -> list[RoutingReply]:
        return []

    async def wire(self) -> WireAddress:
        self.server = WireServer({"decide_many": self.decide_many})
        return await self.server.open(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


def one_echo(echo: Any, wire: WireClient | None, seed: int) -> Callable[[], Awaitable[None]]:
    """A call carrying the same request as ``one_decision``'s, to a method that does nothing (None: a Ray call)."""
    make = request_maker(seed)

    async def call() -> None:
        if wire is not None:
            await wire.call("decide_many", make())
        else:
            await echo.decide_many.remote(make())

    return call


async def ceiling(link: RouterLink, callers: int, seconds: float, batch: int, seed: int) -> float:
    make = request_maker(seed, batch, first_id=1 << 41)  # ids apart from the latency run's: not retries of those
    done = 0
    deadline = time.monotonic() + seconds

    async def caller() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            requests = make()
            decided(await link.decide(requests, CALL_TIMEOUT_S), requests)
            done += batch

    start = time.monotonic()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return done / (time.monotonic() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rps", type=float, default=4.0, help="decisions per second for the latency run")
    parser.add_argument("--decisions", type=int, default=120, help="decisions timed for latency")
    parser.add_argument("--report-interval-s", type=float, default=0.02, help="how often each node reports")
    parser.add_argument("--callers", type=int, default=32, help="concurrent callers for the ceiling")
    parser.add_argument("--batch", type=int, default=16, help="decisions per call in the batched ceiling run")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each ceiling run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    use_cluster_env()  # the app's Serve settings, as its cluster runs it
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        app = Router.bind(KairosConfig(), RouterOptions())  # type: ignore[attr-defined]
        router = serve.run(app, name="router-bench", route_prefix=None)

        async def run() -> None:
            link = RouterLink(router)
            await link.actor()
            reporting = asyncio.create_task(keep_reporting(link, node_states(args.seed), args.report_interval_s))
            await asyncio.sleep(1.0)
            times = await open_loop(one_decision(link, args.seed), args.rps, args.decisions, args.seed)
            p50, p99 = np.percentile(np.array(times) * 1e3, [50, 99])
            print(f"latency at {args.rps:g} decisions/s, {len(times)} decisions: p50 {p50:.2f} ms, p99 {p99:.2f} ms")
            echo = Echo.remote()  # type: ignore[attr-defined]
            wire = await WireClient.connect(await echo.wire.remote(), 10.0)
            for name, line in (("the same TCP line", wire), ("a plain Ray actor call", None)):
                floor = await open_loop(one_echo(echo, line, args.seed), args.rps, args.decisions, args.seed)
                f50, f99 = np.percentile(np.array(floor) * 1e3, [50, 99])
                print(f"floor, {name} with the same request to a method that does nothing, "
                      f"at {args.rps:g} calls/s: p50 {f50:.2f} ms, p99 {f99:.2f} ms")  # fmt: skip
            wire.close()
            single = await ceiling(link, args.callers, args.seconds, 1, args.seed)
            print(f"ceiling, one decision per call, {args.callers} callers: {single:,.0f} decisions/s")
            batched = await ceiling(link, args.callers, args.seconds, args.batch, args.seed)
            print(f"ceiling, {args.batch} decisions per call, {args.callers} callers: {batched:,.0f} decisions/s")
            print(f"median of the latency run: {1e3 * statistics.median(times):.2f} ms")
            reporting.cancel()
            # on this loop: with the app's settings the handle's request router runs on it, and it closes next
            await serve.shutdown_async()  # type: ignore[no-untyped-call]

        asyncio.run(run())
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
