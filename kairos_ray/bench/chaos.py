"""``kairos chaos``: inject faults into a running app while it serves a bursty workload, and print what clients saw.

For each fault in turn: wait until the app serves normally with every node
in the router's view, start replaying a bursty workload (open loop, streamed
completions with ``ignore_eos``, so every request should get exactly its
``max_tokens``), inject the fault a few seconds in, and classify every
request when the replay is over:

- completed: HTTP 200, every token, ``[DONE]``;
- failed: a clean OpenAI error (an error object with a 4xx/5xx status, or an
  SSE ``error`` event followed by ``[DONE]``);
- hung: no complete answer within ``--hang-s``;
- lost: anything else (a cut stream, an empty reply, a wrong token count).

Then it reports how long after the fault the app served normally again
(three probes in a row answered 200 by the router's own decisions), how long
until every node was back in the router's view, and the ingress's
``in_flight`` count once the replay and the probes are over.

Faults: ``decode-engine-kill`` and ``prefill-engine-kill`` (``kill -9`` of a
node's vLLM engine core; of the replica process for emulated engines),
``engine-stop`` (``SIGSTOP`` of a decode engine for ``--stop-s``, then
``SIGCONT``), ``decode-replica-kill``, ``prefill-replica-kill`` and
``router-kill`` (``ray.kill`` of the replica), ``router-stop`` (``SIGSTOP``
of the router's actor for ``--stop-s``, then ``SIGCONT`` if Serve has not
replaced it by then), ``kv-peer-kill`` (a prefill
replica killed while it sends KV over the channel; vLLM apps with
``serving.kv_channel``), and ``client-wave`` (clients that give up before
their first token). It runs on the app's host, connected to its Ray cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from kairos_ray.bench.loadgen import PROMPT_BASE, PROMPT_IDS
from kairos_ray.messages import NodeState, Role
from kairos_ray.workloads import Workload
from kairos_ray.workloads.synthetic import synthetic

FAULTS = (
    "decode-engine-kill",
    "prefill-engine-kill",
    "engine-stop",
    "decode-replica-kill",
    "prefill-replica-kill",
    "router-kill",
    "router-stop",
    "kv-peer-kill",
    "client-wave",
)
OUTCOMES = ("completed", "failed", "hung", "lost")
FRESH_S = 5.0  # a node whose last report is older is not serving (the router forgets it then)
STATES_TIMEOUT_S = 30.0  # reading the router's view (Router.snapshot) may take this long


@dataclass(frozen=True, slots=True)
class FaultRow:
    """One fault's line of the table."""

    fault: str
    sent: int
    outcomes: dict[str, int]  # completed, failed, hung, lost
    serving_after_s: float  # fault to three probes in a row answered by the router's decisions
    full_after_s: float  # fault to every node back in the router's view
    in_flight_after: int | None  # the ingress's count once everything is over (None: /health gave none)
    note: str = ""


async def health_in_flight(url: str) -> int | None:
    """The ingress's count of requests in flight (``GET /health``); None, said on stderr, when the answer
    carries none (Serve's proxy answers in plain text while no ingress replica is up)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        try:
            response = await client.get("/health")
        except httpx.HTTPError as exc:
            why = f"{type(exc).__name__}: {exc}"
        else:
            try:
                return int(response.json()["in_flight"])
            except (ValueError, KeyError, TypeError):
                why = f"HTTP {response.status_code}: {response.text[:200]!r}"
    print(f"chaos: /health gave no in-flight count ({why})", file=sys.stderr, flush=True)
    return None


@dataclass(frozen=True, slots=True)
class Answer:
    """How one streamed request ended, as its client saw it: what ``kairos chaos`` and ``kairos soak`` count."""

    outcome: str  # completed, failed, hung, lost
    status: int | None  # the reply's HTTP status; None when none came (refused, cut or hung before the headers)


async def streamed_answer(client: httpx.AsyncClient, body: dict[str, object], hang_s: float) -> Answer:
    """The outcome of one streamed ``/v1/completions`` call of ``body`` (``ignore_eos``: all its ``max_tokens``)."""
    status: int | None = None
    try:
        async with asyncio.timeout(hang_s):
            async with client.stream("POST", "/v1/completions", json=body) as r:
                status = r.status_code
                if r.status_code != 200:
                    data = await r.aread()
                    return Answer("failed" if _is_error(data) else "lost", status)
                tokens, error, done = 0, False, False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        error = error or "error" in event
                        tokens += bool(event.get("choices"))
        if done and error:
            return Answer("failed", status)
        return Answer("completed" if done and tokens == body["max_tokens"] else "lost", status)
    except TimeoutError:
        return Answer("hung", status)
    except (httpx.HTTPError, json.JSONDecodeError):
        return Answer("lost", status)


class Chaos:
    """One running app: its URL, its Serve application name and the size of its pools."""

    def __init__(self, url: str, app: str, model: str, hang_s: float, stop_s: float) -> None:
        self.url, self.app, self.model = url.rstrip("/"), app, model
        self.hang_s, self.stop_s = hang_s, stop_s
        self.pools = Counter(s.role for s in self.states().values())

    def states(self) -> dict[str, NodeState]:
        """The router's view (call from a thread: it blocks)."""
        from kairos_ray.bench.faults import deployment_handle

        router = deployment_handle("Router", self.app)
        states: dict[str, NodeState] = router.snapshot.remote().result(timeout_s=STATES_TIMEOUT_S)
        return states

    def whole(self) -> bool:
        """Every node of both pools in the router's view, each with a report of the last five seconds.

        Not while the view cannot be read: the ``Router`` replica killed, or hung, and not yet replaced.
        """
        try:
            states = self.states().values()
        except Exception:  # its replica died under the call (RayActorError), or did not answer in time
            return False
        fresh = all(time.time() - s.wall_s < FRESH_S for s in states)
        return fresh and Counter(s.role for s in states) == self.pools

    # ---- clients ------------------------------------------------------------------------

    def body(self, prompt_tokens: int, max_tokens: int) -> dict[str, object]:
        prompt = [PROMPT_BASE + i % PROMPT_IDS for i in range(prompt_tokens)]
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}

    async def replay(self, workload: Workload) -> list[str]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=self.url, timeout=None, limits=limits) as client:
            start = time.monotonic()

            async def at_arrival(prompt_tokens: int, max_tokens: int, arrival_s: float) -> str:
                await asyncio.sleep(max(0.0, start + arrival_s - time.monotonic()))
                answer = await streamed_answer(client, self.body(prompt_tokens, max_tokens), self.hang_s)
                return answer.outcome

            requests = [at_arrival(r.prompt_tokens, r.output_tokens, r.arrival_s) for r in workload.requests]
            return list(await asyncio.gather(*requests))

    async def probe(self) -> bool:
        """A short request answered 200 by the router's own decision (not its fallback)."""
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as client:
            body = {**self.body(64, 2), "stream": False}
            try:
                r = await client.post("/v1/completions", json=body)
            except httpx.HTTPError:
                return False
            return r.status_code == 200 and r.headers.get("x-kairos-fallback") == "0"

    async def in_flight(self) -> int | None:
        return await health_in_flight(self.url)

    # ---- faults -------------------------------------------------------------------------

    async def inject(self, fault: str, states: dict[str, NodeState]) -> str:
        """Do ``fault`` on the nodes ``states`` shows; a note on what was done."""
        from kairos_ray.bench import faults

        def busiest(role: Role) -> str:  # the node with the most requests on it
            nodes = [s for s in states.values() if s.role is role]
            return max(
                nodes,
                key=lambda s: (
                    len(getattr(s.view, "queued_prompt_tokens", ())) + getattr(s.view, "batch_size", 0),
                    s.node_id,
                ),
            ).node_id

        if fault in ("decode-engine-kill", "prefill-engine-kill"):
            node = busiest(Role.DECODE if fault.startswith("decode") else Role.PREFILL)
            pid = await asyncio.to_thread(faults.kill_engine, self.app, node)
            return f"kill -9 {pid} ({node})"
        if fault == "engine-stop":
            node = busiest(Role.DECODE)
            pid = await asyncio.to_thread(faults.engine_pid, self.app, node)
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(self.stop_s)
            os.kill(pid, signal.SIGCONT)
            return f"SIGSTOP {pid} ({node}) for {self.stop_s:g} s"
        if fault in ("decode-replica-kill", "prefill-replica-kill", "kv-peer-kill"):
            node = busiest(Role.DECODE if fault.startswith("decode") else Role.PREFILL)
            await asyncio.to_thread(faults.kill_replica, self.app, node)
            return f"ray.kill {node}"
        if fault == "router-kill":
            await asyncio.to_thread(faults.kill_replica, self.app, "Router")
            return "ray.kill Router"
        if fault == "router-stop":
            pid = await asyncio.to_thread(lambda: faults.replica_pid(faults.router_actor(self.app)))
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(self.stop_s)
            with contextlib.suppress(ProcessLookupError):  # gone with its replica, which Serve replaced
                os.kill(pid, signal.SIGCONT)
            return f"SIGSTOP {pid} (the router's actor) for {self.stop_s:g} s"
        if fault == "client-wave":
            async with httpx.AsyncClient(base_url=self.url, timeout=0.3) as client:
                waves = [self._give_up(client) for _ in range(16)]
                await asyncio.gather(*waves)
            return "16 clients gave up before their first token"
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")

    async def _give_up(self, client: httpx.AsyncClient) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await client.post("/v1/completions", json={**self.body(8000, 500), "stream": False})

    async def run(self, fault: str, workload: Workload, fault_at_s: float) -> FaultRow:
        """Replay ``workload``, inject ``fault`` at ``fault_at_s``, then measure the recovery."""
        await self.until(self.probe, 600, "the app to serve")
        await self.until(lambda: asyncio.to_thread(self.whole), 600, "every node in the router's view")
        replay = asyncio.create_task(self.replay(workload))
        await asyncio.sleep(fault_at_s)
        states = await asyncio.to_thread(self.states)
        injected = time.monotonic()
        watching = asyncio.create_task(self.watch(injected, replay))
        note = await self.inject(fault, states)
        outcomes = await replay
        serving_s, full_s = await watching
        await self.until(self._settled, 120, "no request in flight")
        counts = {name: outcomes.count(name) for name in OUTCOMES}
        return FaultRow(fault, len(outcomes), counts, serving_s, full_s, await self.in_flight(), note)

    async def watch(self, since: float, replay: asyncio.Task[list[str]]) -> tuple[float, float]:
        """(seconds from ``since`` until requests sent then are served again, until every node is back).

        A probe goes out every half second, each on its own, until the replay
        is over and the view is whole again; the app serves again from the
        first of three probes in a row that succeed. The view is back when it is
        whole (``whole``) after the last moment it was not (0 when it never was
        broken: no node went silent or left).
        """
        probes: list[tuple[float, asyncio.Task[bool]]] = []
        broken, back = False, since
        while not (replay.done() and back >= since and (not broken or back > since)):
            probes.append((time.monotonic(), asyncio.create_task(self.probe())))
            if not await asyncio.to_thread(self.whole):
                broken, back = True, since - 1  # not back (yet)
            elif broken and back < since:
                back = time.monotonic()
            if time.monotonic() - since > 900:
                raise TimeoutError("the app did not recover within 900 s")
            await asyncio.sleep(0.5)
        full_s = back - since if broken else 0.0
        results = [(sent, await task) for sent, task in probes]
        serving_s = math.inf
        for i in range(len(results) - 2):
            if all(ok for _, ok in results[i : i + 3]):
                serving_s = max(0.0, results[i][0] - since)
                break
        return serving_s, full_s

    async def _settled(self) -> bool:
        return await self.in_flight() == 0

    @staticmethod
    async def until(condition: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not await condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:g} s for {what}")
            await asyncio.sleep(1.0)


def _is_error(data: bytes) -> bool:
    try:
        return "error" in json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
        return False


def table(rows: list[FaultRow]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| fault | sent | completed | failed (clean error) | hung | lost | serving again | all nodes back "
        "| in_flight after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        o = r.outcomes
        after = "?" if r.in_flight_after is None else r.in_flight_after
        lines.append(
            f"| {r.fault} | {r.sent} | {o['completed']} | {o['failed']} | {o['hung']} | {o['lost']} | "
            f"{r.serving_after_s:.1f} s | {r.full_after_s:.1f} s | {after} |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kairos chaos``."""
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the app's HTTP address")
    parser.add_argument("--app", default="kairos", help="the Serve application name")
    parser.add_argument("--model", default=None, help="model name (default: the first the app lists)")
    parser.add_argument("--address", default="auto", help="Ray cluster address (run on the app's host)")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, in order: {', '.join(FAULTS)}")
    parser.add_argument("--workload", default="bursty", help="synthetic workload replayed during each fault")
    parser.add_argument("--rps", type=float, default=2.0, help="its rate")
    parser.add_argument("--requests", type=int, default=40, help="requests per fault")
    parser.add_argument("--context", type=int, default=4096, help="clip prompt + output to this many tokens")
    parser.add_argument("--fault-at-s", type=float, default=3.0, help="seconds into the replay to inject")
    parser.add_argument(
        "--stop-s", type=float, default=15.0, help="how long engine-stop and router-stop keep their process stopped"
    )
    parser.add_argument("--hang-s", type=float, default=180.0, help="a request with no complete answer by then hung")
    parser.add_argument("--seed", type=int, default=1)


def run_command(args: argparse.Namespace) -> int:
    """Run the chosen faults in turn and print the table."""
    import ray

    chosen = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in chosen if f not in FAULTS]
    if unknown:
        raise ValueError(f"unknown faults {', '.join(unknown)}; known: {', '.join(FAULTS)}")
    ray.init(address=args.address, log_to_driver=False)
    model = args.model or httpx.get(f"{args.url.rstrip('/')}/v1/models", timeout=30).json()["data"][0]["id"]
    chaos = Chaos(args.url, args.app, model, args.hang_s, args.stop_s)
    workload = synthetic(args.workload, args.rps, args.requests, args.seed, args.context)
    rows = []
    for fault in chosen:
        print(f"chaos: {fault} ...", flush=True)
        row = asyncio.run(chaos.run(fault, workload, args.fault_at_s))
        print(
            f"chaos: {fault}: {row.note}; {row.outcomes}; serving again after {row.serving_after_s:.1f} s", flush=True
        )
        rows.append(row)
    print(table(rows))
    print(f"median time to serve again: {statistics.median(r.serving_after_s for r in rows):.1f} s")
    return 0
