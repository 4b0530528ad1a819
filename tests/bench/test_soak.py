"""``kairos soak``: the growth it computes (slopes, the warm-up, replaced processes) on synthetic samples, its
counting of answers and its input errors (a short soak with a replica kill runs on ``tests/serve/test_faults.py``'s
app)."""

import asyncio
import itertools
import math

import httpx
import pytest

from kairos_ray.bench.chaos import streamed_answer
from kairos_ray.bench.soak import MIB, Found, Sample, Samples, Tally, Tracker, _note, arrivals, growth, process_rows
from tests.test_cli import kairos

HOUR_S = 3600.0


def linear(t_s: float, start_mib: float, mib_per_hour: float) -> int:
    return round((start_mib + mib_per_hour * t_s / HOUR_S) * MIB)


def test_growth_is_the_least_squares_slope_per_hour_and_per_thousand_requests():
    # an hour sampled every 10 s, 3 requests answered a second, 6 MiB an hour under +-4 MiB of collection noise,
    # and a spike on the very last sample that end-minus-start would take for 40 MiB of growth
    samples = [
        Sample(t, 3 * int(t), linear(t, 500, 6) + (4 if i % 2 else -4) * MIB, 40 + i // 12)
        for i, t in enumerate(10.0 * k for k in range(361))
    ]
    samples[-1] = Sample(samples[-1].t_s, samples[-1].num_answered, linear(HOUR_S, 540, 6), 70)
    rss = growth(samples, lambda s: s.rss_bytes / MIB)
    assert rss.per_hour == pytest.approx(6, abs=1)  # end minus start: 46
    assert rss.per_1k_requests == pytest.approx(6 / (3 * HOUR_S / 1000), abs=0.1)  # 6 MiB per 10,800 requests
    assert growth(samples, lambda s: s.num_fds).per_hour == pytest.approx(30, rel=0.05)  # one every 2 minutes
    flat = [Sample(t, 0, MIB, 9) for t in (0.0, 10.0, 20.0)]  # no request answered: no slope per request
    assert growth(flat, lambda s: s.rss_bytes).per_hour == 0 and math.isnan(
        growth(flat, lambda s: s.rss_bytes).per_1k_requests
    )
    assert math.isnan(growth(flat[:1], lambda s: s.rss_bytes).per_hour)


def observe_all(tracker: Tracker, times, processes) -> None:
    """``processes(t)``: {(label, role, pid): (rss MiB, fds)} of the processes alive at ``t``."""
    for t in times:
        alive = processes(t)
        by_pid = {pid: (round(mib * MIB), fds) for (_, _, pid), (mib, fds) in alive.items()}
        tracker.observe(t, [Found(*key) for key in alive], int(t), by_pid.get)


def test_the_warm_up_is_left_out_of_the_growth():
    tracker = Tracker()
    # grows 200 MiB over the first 600 s (start-up, caches filling), flat after
    observe_all(
        tracker, range(0, 3601, 5), lambda t: {("Ingress#a", "Ingress", 7): (100 + 200 * min(t, 600) / 600, 30)}
    )
    (whole,) = process_rows(tracker, skip_s=0)
    (measured,) = process_rows(tracker, skip_s=600)
    assert whole.rss_mib_per_hour > 20
    assert measured.rss_mib_per_hour == pytest.approx(0, abs=1e-6) and measured.rss_start_mib == pytest.approx(300)
    assert measured.first_s == 600 and measured.last_s == 3600 and measured.started_s == 0


def test_a_replaced_process_is_split_from_its_replacement_not_counted_as_growth():
    tracker = Tracker()

    def processes(t):
        alive = {("controller", "controller", 1): (200, 50)}
        if t < 50:
            alive["decode#old", "decode", 2] = (100 + t / 100, 20)  # slowly growing until it is killed
        if t >= 55:  # Serve's new replica, bigger at start
            alive["decode#new", "decode", 3] = (300, 25)
        if t < 80:  # the router's actor, replaced: its successor is seen before the old one is found gone
            alive["router-actor#r1", "router-actor", 4] = (150, 12)
        if t >= 75:
            alive["router-actor#r2", "router-actor", 5] = (150, 12)
        return alive

    observe_all(tracker, range(0, 121, 5), processes)
    rows = {(r.label, r.pid): r for r in process_rows(tracker, skip_s=10)}
    old, new = rows["decode#old", 2], rows["decode#new", 3]
    assert (old.replaced_by, old.ended_s, new.replaces, new.started_s) == ("decode#new", 50, "decode#old", 55)
    assert new.rss_mib_per_hour == pytest.approx(0, abs=1e-6)  # the 200 MiB step belongs to neither
    assert old.rss_mib_per_hour == pytest.approx(36, rel=1e-6)  # 0.01 MiB/s, its own
    assert rows["controller", 1].replaces is rows["controller", 1].replaced_by is None
    first, second = rows["router-actor#r1", 4], rows["router-actor#r2", 5]
    assert (first.replaced_by, first.ended_s, second.replaces, second.started_s) == (
        "router-actor#r2",
        80,
        "router-actor#r1",
        75,
    )


def test_a_replacement_s_own_warm_up_is_left_out_and_a_young_one_says_it_is_in():
    tracker = Tracker()

    def warming(born: float, t: float) -> float:
        return 250 + 100 * min(t - born, 300) / 300  # imports and caches filling for 300 s, flat after

    def processes(t):
        alive = {}
        if t < 1200:
            alive["decode#a", "decode", 2] = (warming(0, t), 20)
        if t >= 1205:  # replaced at 1,200 s: an hour-long soak measures it from 1,805 s
            alive["decode#b", "decode", 3] = (warming(1205, t), 20)
        if t < 3300:
            alive["prefill#a", "prefill", 4] = (warming(0, t), 20)
        if t >= 3305:  # replaced 5 minutes before the end: younger than the warm-up
            alive["prefill#b", "prefill", 5] = (warming(3305, t), 20)
        return alive

    observe_all(tracker, range(0, 3601, 5), processes)
    rows = {r.label: r for r in process_rows(tracker, skip_s=600)}
    settled, young = rows["decode#b"], rows["prefill#b"]
    assert settled.first_s == 1805 and settled.rss_mib_per_hour == pytest.approx(0, abs=1e-6)
    assert not settled.warm_up_included and "warm-up" not in _note(settled)
    assert young.first_s == 3305 and young.rss_mib_per_hour > 1000  # 100 MiB over its 295 s, all warm-up
    assert young.warm_up_included and "its warm-up included" in _note(young)
    assert rows["decode#a"].rss_mib_per_hour == pytest.approx(0, abs=1e-6) and not rows["decode#a"].warm_up_included


def test_the_first_discovery_finds_the_originals_however_late_it_comes():
    tracker = Tracker()
    readings = {2: (MIB, 9), 3: (MIB, 9)}
    tracker.observe(0.0, None, 0, readings.get)  # the first discovery not finished yet: nothing known
    tracker.observe(1.0, [Found("decode#a", "decode", 2), Found("decode#b", "decode", 3)], 0, readings.get)
    del readings[2]
    tracker.observe(2.0, None, 0, readings.get)  # read although no discovery finished: decode#a is gone
    rows = {r.label: r for r in process_rows(tracker, skip_s=0)}
    assert rows["decode#a"].ended_s == 2 and rows["decode#a"].replaced_by is None  # not "replaced" by its sibling
    assert rows["decode#b"].replaces is None and rows["decode#b"].ended_s is None


def test_samples_stay_few_evenly_spread_and_keep_the_latest():
    samples = Samples(cap=64)
    for i in range(100_000):
        samples.add(Sample(float(i), i, linear(i, 10, 1), 5))
    kept = samples.since(0.0)
    gaps = {b.t_s - a.t_s for a, b in itertools.pairwise(kept[:-1])}  # the latest comes on its own
    assert len(kept) <= 65 and len(gaps) == 1 and kept[-1].t_s == 99_999
    assert growth(kept, lambda s: s.rss_bytes / MIB).per_hour == pytest.approx(1, rel=1e-3)
    samples.shrink(8)
    assert len(samples.since(0.0)) <= 9 and samples.since(50_000.0)[-1].t_s == 99_999


def test_answers_are_counted_as_chaos_classifies_them_the_shed_ones_apart():
    def events(*data: str) -> bytes:
        return "".join(f"data: {d}\n\n" for d in data).encode()

    async def answer(request: httpx.Request) -> httpx.Response:
        kind = request.url.params["kind"]
        if kind == "hung":
            await asyncio.sleep(30)
        replies = {
            "completed": (200, events('{"choices": [{"text": "a"}]}', '{"choices": [{"text": "b"}]}', "[DONE]")),
            "cut": (200, events('{"choices": [{"text": "a"}]}')),
            "error-event": (200, events('{"choices": [{"text": "a"}]}', '{"error": {"message": "gone"}}', "[DONE]")),
            "shed": (429, b'{"error": {"message": "too many requests in flight", "code": 429}}'),
            "unavailable": (503, b'{"error": {"message": "no node", "code": 503}}'),
            "html": (502, b"<html>bad gateway</html>"),
        }
        status, body = replies[kind]
        return httpx.Response(status, content=body)

    kinds = ["completed", "cut", "error-event", "shed", "unavailable", "html", "hung"]

    async def run() -> Tally:
        tally = Tally()
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://app") as client:
            for kind in kinds:
                client.params = {"kind": kind}
                tally.add(await streamed_answer(client, {"max_tokens": 2}, hang_s=0.5))
        return tally

    counts = asyncio.run(run()).counts()
    assert (counts.completed, counts.failed, counts.shed, counts.hung, counts.lost) == (1, 3, 1, 1, 2)


@pytest.mark.parametrize("workload", ["lpld", "bursty"])
def test_arrivals_go_on_past_a_chunk_at_the_mean_rate(workload):
    stream = arrivals(workload, 4.0, seed=1, context_tokens=2048)
    requests = [next(stream) for _ in range(20_000)]
    times = [r.arrival_s for r in requests]
    assert times == sorted(times) and len(set(times)) > 19_000
    assert (len(times) - 1) / times[-1] == pytest.approx(4.0, rel=0.1)
    assert all(r.prompt_tokens + r.output_tokens <= 2048 for r in requests)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rps", "0"], "--rps: must be > 0"),
        (["--rps", "fast"], "--rps: not a number"),
        (["--url", "http://127.0.0.1:9", "--duration-s", "5", "--skip-s", "1"], "cannot reach http://127.0.0.1:9"),
        (["--duration-s", "60"], "--skip-s 600 leaves nothing of --duration-s 60"),
        (["--faults", "router-kill,meteor"], "--faults: faults are comma-separated"),
        (["--faults", "router-kill", "--duration-s", "60", "--skip-s", "5"], "--faults needs --fault-every-s"),
    ],
)
def test_bad_input_is_a_message_not_a_traceback(args, message):
    result = kairos("soak", *args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
