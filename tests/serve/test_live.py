"""The live view without Serve: rolling windows, the router's and the ingress's parts, the JSON round trip,
and ``kairos top``'s rendering of it."""

import dataclasses
import json

import pytest
from rich.console import Console

from kairos_ray.core import Decision, DecodeNodeView, PrefillNodeView, Route
from kairos_ray.messages import LiveState, NodeState, Role, StepRecord
from kairos_ray.serve.live import SHED_KEY, IngressWindow, RouterWindow, Window
from kairos_ray.top import render


def test_a_window_forgets_what_is_older_than_its_span_and_beyond_its_size():
    window: Window[float] = Window(span_s=60.0, max_samples=3)
    for t, key in ((0.0, "a"), (30.0, "b"), (59.0, "a")):
        window.add(t, key, t)
    assert window.values(60.0, "a") == [0.0, 59.0]
    assert window.values(60.5, "a") == [59.0]  # 0.0 is older than 60 s
    window.add(61.0, "b", 61.0)
    window.add(62.0, "b", 62.0)  # a fourth sample: the oldest goes
    assert window.values(62.0) == [59.0, 61.0, 62.0]
    assert window.keys(62.0) == {"a": 1, "b": 2}


def decision(route, prefill=None, decode="d0"):
    return Decision(route, prefill, decode, (100,) if route is Route.DEFLECT else (), 0.1, 0.1, "")


def test_router_window_counts_where_decisions_sent_requests_and_averages_steps():
    window = RouterWindow(span_s=60.0)
    window.decided(0.0, decision(Route.DEFLECT))
    window.decided(1.0, decision(Route.PREFILL, prefill="p0"))
    window.decided(2.0, decision(Route.PREFILL, prefill="p0", decode="d1"))
    steps = (StepRecord(4, 1000, 0, 0.020, 0.018), StepRecord(4, 1100, 100, 0.030, 0.032))
    d0 = NodeState(DecodeNodeView("d0", 4, 1100, 5000, committed=((50, 50),)), "host", 0.0, steps=steps, num_waiting=2)
    p0 = NodeState(PrefillNodeView("p0", (300, 200), head_prefilled_tokens=100), "host", 0.0, kv_usage=0.25)
    window.reported(1.5, d0)
    live = window.live("kairos", {"p0": (p0, 2.0), "d0": (d0, 1.5)}, now=3.0)
    assert live.policy == "kairos" and live.window_s == 60.0
    d, p = live.nodes  # by node id
    assert (d.node_id, d.role, p.node_id, p.role) == ("d0", Role.DECODE, "p0", Role.PREFILL)
    assert (d.queued_requests, d.batch_size, d.kv_tokens, d.free_kv_tokens) == (2, 4, 1100, 5000)
    assert d.committed_deflections == 1
    assert d.num_steps == 2 and d.step_measured_s == pytest.approx(0.025) and d.step_predicted_s == pytest.approx(0.025)
    assert d.step_error == pytest.approx((0.002 / 0.020 + 0.002 / 0.030) / 2)  # the model's error on those steps
    assert (d.num_routed, d.num_deflected, d.report_age_s) == (2, 1, 1.5)  # deflected here, then handed off
    assert (p.queued_requests, p.queued_prompt_tokens, p.num_routed, p.num_deflected) == (2, 400, 2, 0)
    assert p.num_steps == 0 and p.kv_usage == 0.25
    later = window.live("kairos", {"d0": (d0, 1.5)}, now=61.2)
    assert (later.nodes[0].num_routed, later.nodes[0].num_steps) == (
        0,
        2,
    )  # its decisions are gone, its steps not


def test_ingress_window_sums_up_its_last_minute():
    window = IngressWindow(span_s=60.0)
    assert window.live(0.0).p95_ttft_s is None and window.live(0.0).p50_router_call_s is None
    for i in range(20):
        window.ttft.add(float(i), "deflect" if i % 4 == 0 else "prefill", 0.1 * (i + 1))
    for i in range(100):
        window.tbt.add(10.0, "prefill", 0.001 * (i + 1))
    for i in range(100):
        window.router_calls.add(12.0, "", 0.0001 * (i + 1))
    window.fallbacks.add(5.0, "prefill", 1.0)
    for reason in ("overload", "overload", "bad-request"):
        window.rejections.add(6.0, reason, 1.0)
    live = window.live(20.0)
    assert (live.num_requests, live.num_deflected, live.num_fallbacks) == (20, 5, 1)
    assert live.p95_ttft_s == pytest.approx(1.905) and live.p95_tbt_s == pytest.approx(0.09505)
    assert live.p50_router_call_s == pytest.approx(0.00505) and live.p99_router_call_s == pytest.approx(0.009901)
    assert live.rejections == {"overload": 2, "bad-request": 1}
    assert window.live(70.5).num_requests == 9  # those after t=10.5


def a_state() -> LiveState:
    window = RouterWindow()
    window.decided(0.0, decision(Route.DEFLECT, decode="decode-b"))
    step = StepRecord(3, 20_000, 0, 0.02, 0.019)
    d = NodeState(DecodeNodeView("decode-b", 3, 20_000, 900_000), "h", 0.0, steps=(step,))
    window.reported(0.5, d)
    p = NodeState(PrefillNodeView("prefill-a", (5000,)), "h", 0.0)
    ingress = IngressWindow()
    ingress.ttft.add(0.0, "deflect", 0.25)
    ingress.router_calls.add(0.0, "", 0.0014)
    ingress.router_calls.add(0.0, "", 0.0032)
    ingress.rejections.add(0.0, "overload", 1.0)
    for reason, priority in (("priority", 2), ("priority", 2), ("no-route-in-time", 0)):
        ingress.shed.add(0.0, f"{reason}{SHED_KEY}{priority}", 1.0)
    for _ in range(3):
        ingress.attained.add(0.0, "deflect", 1.0)
    return LiveState(1e9, window.live("kairos", {"decode-b": (d, 0.0), "prefill-a": (p, 0.0)}, 1.0), ingress.live(1.0))


def test_the_live_state_survives_its_json_form():
    state = a_state()
    assert LiveState.from_json(json.loads(json.dumps(dataclasses.asdict(state)))) == state


def test_top_renders_a_line_per_node_and_the_last_minute():
    console = Console(width=200, record=True)
    console.print(render(a_state(), "http://app"))
    lines = console.export_text().splitlines()
    assert "policy kairos" in lines[0]
    (decode,) = [line for line in lines if line.startswith("decode-b ")]
    assert decode.split() == [
        "decode-b", "0", "3", "20.0k", "900.0k", "0%", "0", "20.0/19.0", "5%", "1", "100", "%", "1.0"
    ]  # fmt: skip
    (prefill,) = [line for line in lines if line.startswith("prefill-a ")]
    assert "1 (5000 tok)" in prefill
    assert "1 requests, 1 deflected (100 %), P95 TTFT 0.250 s" in lines[-2] and "1 rejected (overload 1)" in lines[-2]
    assert "router call P50/P99 2.3/3.2 ms" in lines[-2]
    assert lines[-1] == (
        "admission: 3 shed (no-route-in-time 1, priority 2; priority 0 1, priority 2 2), "
        "goodput 0.05 req/s within the SLO"
    )


def test_a_window_nobody_reads_holds_only_its_last_span():
    window: Window[float] = Window(span_s=60.0)
    for i in range(10_000):  # ten a second for 1,000 s, never read
        window.add(i / 10, "k", 1.0)
    assert len(window) == 601  # the last 60 s, not every sample since the start
