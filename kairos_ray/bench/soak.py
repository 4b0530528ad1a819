"""``kairos soak``: drive a running app for hours under steady or bursty load, optionally with periodic faults, and
measure whether its Serve processes grow.

The load is open loop: requests of a synthetic workload (``lpld`` ... ``hphd``
arrive as a Poisson process, ``bursty`` in gamma-distributed clumps) at
``--rps``, drawn a chunk at a time so that a run of any length holds only a
chunk of them, each a streamed completion with ``ignore_eos`` classified as
``kairos chaos`` classifies it (``chaos.streamed_answer``): completed, failed
with a clean error (429s, requests the app shed, counted apart too), hung or
lost. Only the counts are kept.

Every ``--sample-s`` it reads the resident set size and the open file
descriptors of every Serve process of the app on this host: each replica
(found by its named actor), the router's actor, the Serve controller and the
proxy (and a process the proxy runs, HAProxy in Serve's HAProxy mode). A
process is known by its pid; a replica that a fault kills comes back as a new
process of the same role (its deployment), and is reported as replacing the
old one, each measured on its own, so that the step between them is not taken
for growth. Samples are thinned as the run goes (every other one dropped once
a process has ``SAMPLES_CAP``), which keeps them evenly spread and the tool's
own memory bounded.

Growth is the least-squares slope of RSS (and of FDs) over the samples of the
measured window, the run after ``--skip-s`` of warm-up: against time (per
hour) and against requests answered (per 1,000 requests), which, unlike the
end minus the start, a single spike or a collection at the wrong moment does
not swing. A replacement warms up as the first process did (imports, its
caches filling up to their bound), so its growth is measured from ``--skip-s``
after it was first seen; one younger than that at the end is measured over
what it has, its warm-up included, and the row says so. With ``--fault-every-s`` the faults of ``kairos chaos`` are
injected in turn, each once the router's view is whole again. It runs on the
app's host, connected to its Ray cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from kairos_ray.bench.chaos import FAULTS, OUTCOMES, Answer, Chaos, health_in_flight, streamed_answer
from kairos_ray.bench.loadgen import prompt_ids, served_model
from kairos_ray.workloads import Request
from kairos_ray.workloads.synthetic import SYNTHETIC, synthetic

MIB = 1 << 20
SAMPLES_CAP = 512  # samples kept per live process; past it, every other one is dropped
ENDED_SAMPLES = 64  # kept of a process once it is gone (its line and plot need no more)
FAULTS_KEPT = 1000  # fault events kept for the report and the plot (all are counted)
CHUNK_REQUESTS = 1024  # requests drawn at a time
ASK_TIMEOUT_S = 10.0  # asking an actor for its pid (a dying one never answers)
FIND_WAIT_S = 1.0  # how long a sample waits for the discovery it started before reading without it
SETTLE_S = 30.0  # after the last answer, how long the ingress may take to count no request in flight
IDLE_S = 90.0  # then, how long every process may take to hold nothing per request (the router's ledger expires)
SERVE_NAMESPACE, CONTROLLER, PROXY = "serve", "SERVE_CONTROLLER_ACTOR", "SERVE_PROXY_ACTOR"
WORKLOADS = tuple(SYNTHETIC)  # what a soak draws from (multiturn's next turns need every answer kept)


# ---- samples and growth: no Ray, no clock --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float  # seconds since the soak began
    num_answered: int  # requests answered by then, whatever their outcome
    rss_bytes: int
    num_fds: int


class Samples:
    """A process's samples in bounded memory, evenly spread over its life, its latest one always kept.

    Past ``cap`` samples every other one is dropped and from then on only
    every other one kept (a stride that doubles each time), so the samples
    kept are those whose index is a multiple of the stride.
    """

    def __init__(self, cap: int = SAMPLES_CAP) -> None:
        self.cap = cap
        self.points: list[Sample] = []
        self.last: Sample | None = None
        self._stride, self._seen = 1, 0

    def add(self, sample: Sample) -> None:
        if self._seen % self._stride == 0:
            self.points.append(sample)
            if len(self.points) > self.cap:
                self._halve()
        self._seen += 1
        self.last = sample

    def shrink(self, cap: int) -> None:
        """Keep at most ``cap`` from now on (a process that is gone needs fewer)."""
        self.cap = cap
        while len(self.points) > cap:
            self._halve()

    def _halve(self) -> None:
        del self.points[1::2]
        self._stride *= 2

    def since(self, from_s: float) -> list[Sample]:
        """The samples taken at ``from_s`` or later, the latest included."""
        kept = [s for s in self.points if s.t_s >= from_s]
        if self.last is not None and self.last.t_s >= from_s and (not kept or kept[-1] is not self.last):
            kept.append(self.last)
        return kept


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The least-squares slope of ``ys`` against ``xs``; NaN with fewer than two distinct ``xs``."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    dx = x - x.mean() if len(x) else x
    spread = float(dx @ dx)
    return float(dx @ (y - y.mean())) / spread if spread > 0 else math.nan


@dataclass(frozen=True, slots=True)
class Growth:
    per_hour: float  # least-squares slope against time, per hour (NaN: fewer than two samples)
    per_1k_requests: float  # against requests answered, per 1,000 (NaN: none answered over the samples)


def growth(samples: Sequence[Sample], value: Callable[[Sample], float]) -> Growth:
    """How ``value`` of the samples grows per hour and per 1,000 requests answered."""
    ys = [value(s) for s in samples]
    per_s = slope([s.t_s for s in samples], ys)
    per_request = slope([float(s.num_answered) for s in samples], ys)
    return Growth(3600 * per_s, 1000 * per_request)


@dataclass(frozen=True, slots=True)
class Found:
    """A serving process as discovery names it."""

    label: (
        str  # "decode#ab12" (a replica), "router-actor#cd34" (of Router#cd34; "router-actor-1#ef56" of Router-1#ef56),
        # "controller", "proxy", "proxy:haproxy"
    )
    role: str  # what its replacement shares: the replica's deployment, else the label
    pid: int


@dataclass
class Tracked:
    """One process over its life (a replacement is another one)."""

    label: str
    role: str
    pid: int
    first_s: float
    samples: Samples = field(default_factory=Samples)
    ended_s: float | None = None  # when it was found gone
    replaces: str | None = None  # the label of the process of its role it took over from
    replaced_by: str | None = None


Reading = tuple[int, int]  # (RSS bytes, open FDs)


class Tracker:
    """Every serving process seen, by pid; a process gone and a new one of its role make a replacement.

    Each pass reads every live process it knows (one whose reading fails is
    gone), then adds those a discovery (if one finished) names for the first
    time. A process new after the first discovery replaces the oldest unpaired
    gone one of its role, or waits for one to go (Serve may start the new
    replica before the old one is gone).
    """

    def __init__(self) -> None:
        self.processes: dict[tuple[str, int], Tracked] = {}  # (label, pid) -> its life, in the order seen
        self._gone: dict[str, deque[Tracked]] = {}  # role -> gone, not yet replaced
        self._new: dict[str, deque[Tracked]] = {}  # role -> new, not yet paired with a gone one
        self._discoveries = 0

    def live(self) -> list[Tracked]:
        return [p for p in self.processes.values() if p.ended_s is None]

    def observe(
        self, t_s: float, found: Iterable[Found] | None, num_answered: int, read: Callable[[int], Reading | None]
    ) -> None:
        """Sample at ``t_s``; ``found``: what a discovery found since the last pass (None: none finished)."""
        for p in self.live():
            reading = read(p.pid)
            if reading is None:
                self._end(p, t_s)
            else:
                p.samples.add(Sample(t_s, num_answered, *reading))
        if found is None:
            return
        for f in found:
            if (f.label, f.pid) in self.processes:
                continue
            reading = read(f.pid)
            if reading is None:  # gone already
                continue
            p = self.processes[f.label, f.pid] = Tracked(f.label, f.role, f.pid, t_s)
            p.samples.add(Sample(t_s, num_answered, *reading))
            if self._discoveries:
                self._arrived(p)
        self._discoveries += 1

    def _end(self, p: Tracked, t_s: float) -> None:
        p.ended_s = t_s
        p.samples.shrink(ENDED_SAMPLES)
        waiting = self._new.get(p.role, deque())
        with contextlib.suppress(ValueError):
            waiting.remove(p)
        if waiting:
            _pair(p, waiting.popleft())
        else:
            self._gone.setdefault(p.role, deque()).append(p)

    def _arrived(self, p: Tracked) -> None:
        gone = self._gone.get(p.role)
        if gone:
            _pair(gone.popleft(), p)
        else:
            self._new.setdefault(p.role, deque()).append(p)


def _pair(old: Tracked, new: Tracked) -> None:
    old.replaced_by, new.replaces = new.label, old.label


@dataclass(frozen=True, slots=True)
class ProcessRow:
    """One process's line of the report, over its part of the measured window."""

    label: str
    role: str
    pid: int
    first_s: float  # its first and last sample in the window, seconds since the soak began
    last_s: float
    rss_start_mib: float
    rss_end_mib: float
    rss_mib_per_hour: float  # least-squares slopes over its samples in the window (NaN: too few)
    rss_mib_per_1k_requests: float
    fds_start: int
    fds_end: int
    fds_per_hour: float
    fds_per_1k_requests: float
    started_s: float  # when it was first seen (before the window for a process there from the start)
    ended_s: float | None  # when it was found gone
    replaces: str | None
    replaced_by: str | None
    warm_up_included: bool = False  # a replacement younger than the warm-up: measured over all it has in the window


def process_rows(tracker: Tracker, skip_s: float) -> list[ProcessRow]:
    """A row per process sampled in the window (the run after ``skip_s``), by role, then as they came; a
    replacement's from ``skip_s`` after it was first seen, where it has two samples from then."""
    rows = []
    for p in tracker.processes.values():
        window = p.samples.since(skip_s)
        warm = p.samples.since(p.first_s + skip_s) if p.replaces is not None else window
        young = len(warm) < 2
        window = window if young else warm
        if not window:
            continue
        rss = growth(window, lambda s: s.rss_bytes / MIB)
        fds = growth(window, lambda s: s.num_fds)
        first, last = window[0], window[-1]
        rows.append(
            ProcessRow(
                p.label, p.role, p.pid, first.t_s, last.t_s,
                first.rss_bytes / MIB, last.rss_bytes / MIB, rss.per_hour, rss.per_1k_requests,
                first.num_fds, last.num_fds, fds.per_hour, fds.per_1k_requests,
                p.first_s, p.ended_s, p.replaces, p.replaced_by, young and p.replaces is not None,
            )
        )  # fmt: skip
    return sorted(rows, key=lambda r: (r.role, r.started_s, r.label))


# ---- requests -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestCounts:
    sent: int
    completed: int  # HTTP 200, every token, [DONE]
    failed: int  # a clean OpenAI error, the shed ones included
    shed: int  # of the failed: 429, the app's refusal of more than it admits
    hung: int  # no complete answer within --hang-s
    lost: int  # anything else: a cut stream, an empty reply, a wrong token count


class Tally:
    """Outcomes counted as requests end; nothing of a request is kept."""

    def __init__(self) -> None:
        self.num_sent, self.num_shed = 0, 0
        self.outcomes: Counter[str] = Counter()

    def add(self, answer: Answer) -> None:
        self.outcomes[answer.outcome] += 1
        self.num_shed += answer.outcome == "failed" and answer.status == 429

    @property
    def num_answered(self) -> int:
        return sum(self.outcomes[o] for o in OUTCOMES)

    def counts(self) -> RequestCounts:
        o = self.outcomes
        return RequestCounts(self.num_sent, o["completed"], o["failed"], self.num_shed, o["hung"], o["lost"])


def arrivals(workload: str, rps: float, seed: int, context_tokens: int) -> Iterator[Request]:
    """An endless stream of ``workload``'s requests at ``rps``, arrival times from 0, drawn a chunk at a time.

    Chunks are ``synthetic`` workloads of their own seeds, each starting a
    mean gap after the last request of the one before.
    """
    offset_s = 0.0
    for chunk in itertools.count():
        chunk_seed = int(np.random.SeedSequence((seed, chunk)).generate_state(1)[0])
        requests = synthetic(workload, rps, CHUNK_REQUESTS, chunk_seed, context_tokens).requests
        for r in requests:
            yield dataclasses.replace(r, arrival_s=offset_s + r.arrival_s)
        offset_s += requests[-1].arrival_s + 1 / rps


# ---- the app's processes (Ray, psutil) ----------------------------------------------------------------------


def read_process(procs: dict[int, psutil.Process], pid: int) -> Reading | None:
    """RSS and open FDs of ``pid``; None once it is gone. ``procs`` holds each pid's process, which psutil tells
    apart from a later process given the same pid."""
    try:
        proc = procs.get(pid) or procs.setdefault(pid, psutil.Process(pid))
        if not proc.is_running():
            raise psutil.NoSuchProcess(pid)
        with proc.oneshot():
            return int(proc.memory_info().rss), int(proc.num_fds())
    except psutil.Error:
        procs.pop(pid, None)
        return None


class Finder:
    """The serving processes of one app on this host, through Ray's named actors; each actor asked once."""

    def __init__(self, app: str) -> None:
        import ray

        self.app = app
        self.here = ray.get_runtime_context().get_node_id()
        self._pids: dict[str, int | None] = {}  # actor name -> its pid (None: on another host)
        self._routers: dict[str, int | None] = {}  # a router shard replica's actor name -> the pid of its RouterActor
        self.elsewhere: set[str] = set()  # labels of processes on other hosts, not sampled

    def find(self) -> list[Found]:
        """Every serving process now (LookupError naming the apps there are when the app has no replica)."""
        import ray

        from kairos_ray.bench import faults

        named = [
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == SERVE_NAMESPACE
        ]
        prefix = f"SERVE_REPLICA::{self.app}#"
        if not any(n.startswith(prefix) for n in named):
            apps = sorted({n.split("::", 1)[1].split("#", 1)[0] for n in named if n.startswith("SERVE_REPLICA::")})
            raise LookupError(
                f"no Serve application {self.app!r} in this Ray cluster (applications: {', '.join(apps) or 'none'})"
            )
        self._pids = {n: pid for n, pid in self._pids.items() if n in named}
        self._routers = {n: pid for n, pid in self._routers.items() if n in named}
        found = []
        for name in named:
            if name.startswith(prefix):
                label = name.removeprefix(prefix)
                role = label.split("#", 1)[0]
            elif name == CONTROLLER or name.startswith(PROXY):
                label = role = "controller" if name == CONTROLLER else "proxy"
            else:
                continue
            pid = self._pid(self._pids, name, functools.partial(ray.get_actor, name, namespace=SERVE_NAMESPACE), label)
            if pid is None:
                continue
            found.append(Found(label, role, pid))
            if role == "proxy":
                with contextlib.suppress(psutil.Error):
                    found += [
                        Found(f"proxy:{c.name()}", f"proxy:{c.name()}", c.pid) for c in psutil.Process(pid).children()
                    ]
            if faults.is_router_shard(role):  # and the RouterActor the shard's replica owns
                shard = role.removeprefix("Router")  # "" for the first, "-1", ...
                owned = f"router-actor{shard}#{label.split('#', 1)[1]}"  # named after the replica that owns it
                ask = functools.partial(faults.router_actor, self.app, role)
                actor_pid = self._pid(self._routers, name, ask, owned)
                if actor_pid is not None:
                    found.append(Found(owned, f"router-actor{shard}", actor_pid))
        return found

    def _pid(self, asked: dict[str, int | None], name: str, actor: Callable[[], Any], label: str) -> int | None:
        """``name``'s entry in ``asked``, the pid of ``actor()`` asked the first time; None while it does not answer."""
        if name not in asked:
            try:
                asked[name] = self._ask(actor(), label)
            except Exception:  # a replica dying, or starting and not answering yet: asked again next pass
                return None
        return asked[name]

    def _ask(self, actor: Any, label: str) -> int | None:
        """The actor's pid if it runs on this host; None, its label noted, if elsewhere."""
        import ray

        def whereabouts(_: object) -> tuple[int, str]:
            return os.getpid(), ray.get_runtime_context().get_node_id()

        pid, node = ray.get(actor.__ray_call__.remote(whereabouts), timeout=ASK_TIMEOUT_S)
        if node != self.here:
            self.elsewhere.add(label)
            return None
        return int(pid)


# ---- the run --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SoakOptions:
    workload: str  # a synthetic workload's name: its lengths and its arrival process
    rps: float
    duration_s: float  # how long requests are sent
    skip_s: float  # the warm-up left out of the growth
    sample_s: float  # between samples of the processes
    context_tokens: int
    seed: int
    faults: tuple[str, ...]  # injected in turn, one every fault_every_s; () for none
    fault_every_s: float | None
    hang_s: float  # a request with no complete answer by then hung
    stop_s: float  # how long engine-stop and router-stop keep their process stopped


@dataclass(frozen=True, slots=True)
class FaultEvent:
    t_s: float  # seconds since the soak began, when it was injected (or given up)
    fault: str
    note: str  # what was done, or why not


@dataclass(frozen=True, slots=True)
class SoakReport:
    url: str
    app: str
    options: SoakOptions
    window_s: tuple[float, float]  # the measured window: from the warm-up's end to the last sample
    requests: RequestCounts
    in_flight_after: int | None  # the ingress's count once every answer is in (None: /health gave none)
    # what each process still held per request once idle ("" for one that held nothing; None: not read)
    residue: tuple[str, ...] | None
    processes: tuple[ProcessRow, ...]
    num_faults: int  # injected
    faults: tuple[FaultEvent, ...]  # the latest FAULTS_KEPT, those that could not be injected too
    elsewhere: tuple[str, ...]  # serving processes on other hosts, not sampled


class Soak:
    """One soak of a running app: the load, the sampler and the faults, on one event loop."""

    def __init__(self, url: str, app: str, model: str, options: SoakOptions) -> None:
        self.url, self.app, self.model, self.options = url.rstrip("/"), app, model, options
        self.tally = Tally()
        self.tracker = Tracker()
        self.finder = Finder(app)
        self.faults: deque[FaultEvent] = deque(maxlen=FAULTS_KEPT)
        self.num_faults = 0
        self._procs: dict[int, psutil.Process] = {}
        self._in_flight: set[asyncio.Task[None]] = set()
        self._finding: asyncio.Task[list[Found]] | None = None  # the discovery running, if one is
        self._start = time.monotonic()

    def elapsed_s(self) -> float:
        return time.monotonic() - self._start

    async def run(self, progress: Callable[[Soak], None] = lambda _: None) -> SoakReport:
        o = self.options
        chaos = await asyncio.to_thread(Chaos, self.url, self.app, self.model, o.hang_s, o.stop_s) if o.faults else None
        self._start = time.monotonic()
        stopped = asyncio.Event()
        sampler = asyncio.create_task(self._sample_until(stopped, progress))
        faulting = asyncio.create_task(self._inject_faults(chaos)) if chaos is not None else None
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=self.url, timeout=None, limits=limits) as client:
            await self._send(client)
            await asyncio.gather(*self._in_flight)
        if faulting is not None:
            await faulting  # never cancelled: a process it stopped must get its SIGCONT
        in_flight = await self._settled()
        residue = await self._residue()
        stopped.set()
        await sampler
        await self._sample()
        progress(self)
        return SoakReport(
            self.url, self.app, o, (o.skip_s, self.elapsed_s()), self.tally.counts(), in_flight, residue,
            tuple(process_rows(self.tracker, o.skip_s)), self.num_faults, tuple(self.faults),
            tuple(sorted(self.finder.elsewhere)),
        )  # fmt: skip

    async def _send(self, client: httpx.AsyncClient) -> None:
        o = self.options
        for rid, request in enumerate(arrivals(o.workload, o.rps, o.seed, o.context_tokens)):
            if request.arrival_s >= o.duration_s:
                return
            await asyncio.sleep(max(0.0, request.arrival_s - self.elapsed_s()))
            self.tally.num_sent += 1
            task = asyncio.create_task(self._one(client, rid, request))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    async def _one(self, client: httpx.AsyncClient, rid: int, request: Request) -> None:
        body: dict[str, object] = {
            "model": self.model,
            "prompt": prompt_ids(rid, request.prompt_tokens),
            "max_tokens": request.output_tokens,
            "stream": True,
            "ignore_eos": True,
        }
        self.tally.add(await streamed_answer(client, body, self.options.hang_s))

    async def _sample(self) -> None:
        """Read every known process now; add those a discovery finished by now found (one runs at a time, in a
        thread, and may take long while a replica starts: the readings do not wait for it)."""
        if self._finding is None:
            self._finding = asyncio.create_task(asyncio.to_thread(self.finder.find))
        await asyncio.wait([self._finding], timeout=FIND_WAIT_S)
        found: list[Found] | None = None
        if self._finding.done():
            with contextlib.suppress(Exception):  # Ray did not answer, or the app was between replicas: next pass
                found = self._finding.result()
            self._finding = None
        self.tracker.observe(
            self.elapsed_s(), found, self.tally.num_answered, lambda pid: read_process(self._procs, pid)
        )

    async def _sample_until(self, stopped: asyncio.Event, progress: Callable[[Soak], None]) -> None:
        for tick in itertools.count(1):
            await self._sample()
            progress(self)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopped.wait(), max(0.0, tick * self.options.sample_s - self.elapsed_s()))
            if stopped.is_set():
                return

    async def _inject_faults(self, chaos: Chaos) -> None:
        """Each fault in turn every ``fault_every_s``, once the router's view is whole, while requests are sent."""
        o = self.options
        assert o.fault_every_s is not None, "faults come with their period"
        for i in itertools.count():
            at_s = (i + 1) * o.fault_every_s
            if at_s >= o.duration_s:
                return
            await asyncio.sleep(max(0.0, at_s - self.elapsed_s()))
            fault = o.faults[i % len(o.faults)]
            while not await asyncio.to_thread(chaos.whole):
                if self.elapsed_s() >= o.duration_s:
                    self.faults.append(FaultEvent(self.elapsed_s(), fault, "not injected: the view was never whole"))
                    return
                await asyncio.sleep(1.0)
            t_s = self.elapsed_s()
            try:
                note = await chaos.inject(fault, await asyncio.to_thread(chaos.states))
            except Exception as exc:  # a soak outlives a fault it could not inject; the report says why
                self.faults.append(FaultEvent(t_s, fault, f"not injected: {type(exc).__name__}: {exc}"))
            else:
                self.faults.append(FaultEvent(t_s, fault, note))
                self.num_faults += 1

    async def _residue(self) -> tuple[str, ...] | None:
        """Each process's per-request state once none holds any, or as it is after ``IDLE_S`` (None: unread)."""
        from kairos_ray.bench.faults import residues  # Ray's: not for the CLI's parser, which lists WORKLOADS

        deadline = time.monotonic() + IDLE_S
        while True:
            try:
                found = await asyncio.to_thread(residues, self.app)
            except Exception:  # a replica between lives, or Ray slow to answer: the report says it was not read
                found = None
            if (found is not None and all(r.idle for r in found)) or time.monotonic() > deadline:
                return None if found is None else tuple("" if r.idle else str(r) for r in found)
            await asyncio.sleep(1.0)

    async def _settled(self) -> int | None:
        """The ingress's in-flight count once it reaches 0, or after ``SETTLE_S``."""
        deadline = time.monotonic() + SETTLE_S
        while (count := await health_in_flight(self.url)) != 0 and time.monotonic() < deadline:
            await asyncio.sleep(1.0)
        return count


# ---- what it prints and writes --------------------------------------------------------------------------------


def _number(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else format(value, spec)


def _note(row: ProcessRow) -> str:
    notes = []
    if row.replaces is not None:
        notes.append(f"replaces {row.replaces} (from {row.started_s:.1f} s)")
        if row.warm_up_included:
            notes.append("its warm-up included (younger than --skip-s)")
    if row.ended_s is not None:
        gone = f"replaced by {row.replaced_by}" if row.replaced_by is not None else "gone"
        notes.append(f"{gone} at {row.ended_s:.1f} s")
    return "; ".join(notes)


def _residue(residue: tuple[str, ...] | None) -> str:
    if residue is None:
        return "not read (the app did not answer)"
    held = [r for r in residue if r]
    return "; ".join(held) if held else f"nothing held in any of {len(residue)} processes"


def text(report: SoakReport) -> str:
    """The report as the command prints it."""
    o, r = report.options, report.requests
    start_s, end_s = report.window_s
    lines = [
        f"soak of {report.url} (app {report.app}): {o.duration_s:g} s of {o.workload} at {o.rps:g} req/s; "
        f"growth measured over {start_s:.0f}-{end_s:.0f} s",
        f"requests: {r.sent} sent, {r.completed} completed, {r.failed} failed with a clean error ({r.shed} of them "
        f"429: shed), {r.hung} hung, {r.lost} lost; "
        f"{'?' if report.in_flight_after is None else report.in_flight_after} in flight at the ingress after",
        f"per-request state once idle: {_residue(report.residue)}",
    ]
    if o.faults:
        lines.append(
            f"faults: {report.num_faults} injected, one every {o.fault_every_s:g} s, in turn: {', '.join(o.faults)}"
        )
        lines += [f"  {e.t_s:8.1f} s  {e.fault}: {e.note}" for e in report.faults]
    columns = f"{'start':>8} {'end':>8} {'per hour':>9} {'per 1k req':>11}"
    lines.append(f"{'':<42}  {'RSS (MiB)':^39}  {'open file descriptors':^39}".rstrip())
    lines.append(f"{'process':<22} {'pid':>8} {'seen s':>10}  {columns}  {columns}  note")
    for p in report.processes:
        seen = f"{p.first_s:.0f}-{p.last_s:.0f}"
        rss = f"{p.rss_start_mib:>8.1f} {p.rss_end_mib:>8.1f} {_number(p.rss_mib_per_hour, '+.1f'):>9} "
        rss += f"{_number(p.rss_mib_per_1k_requests, '+.2f'):>11}"
        fds = f"{p.fds_start:>8} {p.fds_end:>8} {_number(p.fds_per_hour, '+.1f'):>9} "
        fds += f"{_number(p.fds_per_1k_requests, '+.2f'):>11}"
        lines.append(f"{p.label:<22} {p.pid:>8} {seen:>10}  {rss}  {fds}  {_note(p)}".rstrip())
    if report.elsewhere:
        lines.append(f"on other hosts, not sampled: {', '.join(report.elsewhere)}")
    return "\n".join(lines)


def _finite(value: Any) -> Any:
    """``value`` with NaNs as None, for strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def write_json(report: SoakReport, path: Path) -> None:
    path.write_text(json.dumps(_finite(dataclasses.asdict(report)), indent=2, allow_nan=False) + "\n")


def plot(tracker: Tracker, report: SoakReport, path: Path) -> None:
    """RSS and FDs over time, a line per process (a replacement in its role's colour, dashed), faults marked."""
    from matplotlib.figure import Figure

    scale, unit = (60.0, "min") if report.options.duration_s >= 600 else (1.0, "s")
    fig = Figure(figsize=(11, 7))
    rss_ax, fds_ax = fig.subplots(2, 1, sharex=True)
    roles = sorted({p.role for p in tracker.processes.values()})
    colours = {role: f"C{i % 10}" for i, role in enumerate(roles)}
    for p in sorted(tracker.processes.values(), key=lambda p: (p.role, p.first_s)):
        points = p.samples.since(0.0)
        ts = [s.t_s / scale for s in points]
        style = {"color": colours[p.role], "linestyle": "--" if p.replaces else "-", "linewidth": 1.2}
        rss_ax.plot(ts, [s.rss_bytes / MIB for s in points], label=p.label, **style)
        fds_ax.plot(ts, [s.num_fds for s in points], **style)
    for ax in (rss_ax, fds_ax):
        ax.axvspan(0, report.options.skip_s / scale, color="0.92", zorder=0)
        for e in report.faults:
            ax.axvline(e.t_s / scale, color="red", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    for e in report.faults:
        rss_ax.annotate(
            e.fault, (e.t_s / scale, 1), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
            color="red", va="top", ha="right",
        )  # fmt: skip
    rss_ax.set_ylabel("RSS (MiB)")
    fds_ax.set_ylabel("open file descriptors")
    fds_ax.set_xlabel(f"time since the soak began ({unit}); grey: warm-up, not measured")
    rss_ax.set_title(f"kairos soak: {report.app} at {report.options.rps:g} req/s ({report.options.workload})")
    rss_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    fig.subplots_adjust(left=0.08, right=0.78, top=0.94, bottom=0.08, hspace=0.08)
    fig.savefig(path, dpi=100)


def options_from(args: argparse.Namespace) -> SoakOptions:
    """The run's options, checked against each other (each on its own is checked by the parser)."""
    if args.skip_s >= args.duration_s:
        raise ValueError(f"--skip-s {args.skip_s:g} leaves nothing of --duration-s {args.duration_s:g} to measure")
    if args.faults and args.fault_every_s is None:
        raise ValueError("--faults needs --fault-every-s: how often to inject them")
    if args.fault_every_s is not None and args.fault_every_s >= args.duration_s:
        raise ValueError(
            f"--fault-every-s {args.fault_every_s:g} is not shorter than --duration-s {args.duration_s:g}: no fault "
            "would be injected"
        )
    chosen = tuple(args.faults or ()) if args.fault_every_s is None else tuple(args.faults or FAULTS)
    return SoakOptions(
        args.workload, args.rps, args.duration_s, args.skip_s, args.sample_s, args.context, args.seed, chosen,
        args.fault_every_s, args.hang_s, args.stop_s,
    )  # fmt: skip


def run_command(args: argparse.Namespace) -> int:
    """Check the input, connect to the app's Ray cluster, soak, print the report and write what was asked."""
    import ray
    from tqdm import tqdm

    options = options_from(args)
    url = args.url.rstrip("/")
    try:
        model = args.model or asyncio.run(served_model(url))
    except httpx.HTTPStatusError as exc:
        raise ValueError(f"{url} lists no models: HTTP {exc.response.status_code} from /v1/models") from None
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
    if not ray.is_initialized():
        try:
            ray.init(address=args.address, log_to_driver=False)
        except ConnectionError as exc:
            raise ValueError(f"cannot connect to the app's Ray cluster ({args.address}): {exc}") from None
    soak = Soak(url, args.app, model, options)
    try:
        soak.finder.find()
    except LookupError as exc:
        raise ValueError(str(exc)) from None
    bar_format = "{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}] {postfix}"
    with tqdm(total=options.duration_s, desc="soak", bar_format=bar_format, disable=None) as bar:

        def progress(s: Soak) -> None:
            c = s.tally.counts()
            bar.update(min(s.elapsed_s(), options.duration_s) - bar.n)
            bar.set_postfix_str(
                f"{c.sent} sent, {c.completed} completed, {c.failed} failed, {c.hung} hung, {c.lost} lost, "
                f"{s.num_faults} faults, {len(s.tracker.live())} processes",
                refresh=False,
            )

        report = asyncio.run(soak.run(progress))
    print(text(report))
    if args.json:
        write_json(report, Path(args.json))
        print(f"wrote {args.json}")
    if args.plot:
        plot(soak.tracker, report, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0
