"""Faults on the emulated 2P2D app under real Ray and Serve: no request lost, hung or leaked.

The app deflects prompts of up to 2,000 tokens (``sl:2000``) and disaggregates
longer ones, so each test picks its route by the prompt's length. Deadlines
are short so that a fault shows within seconds. A second application on the
same Serve instance requires an API key and runs two router shards.
"""

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import ray
import vllm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ray import serve

from kairos_ray import cli
from kairos_ray.bench import faults
from kairos_ray.bench.soak import Finder
from kairos_ray.engines.emulated import token_id
from kairos_ray.messages import Role
from kairos_ray.serve import build_app
from kairos_ray.serve.app import INGRESS_ENV

from .bodies import BODIES
from .conftest import MODEL, app_args, running_app, wait_for_no_residue, wait_for_series

pytestmark = pytest.mark.ray

KEY = "sk-kairos-test"  # a tenant's key on the secured app
ADMIN = "sk-kairos-admin"  # its operator's
DECODERS = "decoders"  # the decode pool's deployment, named otherwise than its role
LIMITS = {
    "first_token_timeout_s": 15.0,  # a killed prefill node's queue, retried on the other, on two shared cores
    "token_stall_timeout_s": 3.0,
    "max_body_bytes": 1 << 20,
    "max_in_flight": 48,
}


@pytest.fixture(scope="module")
def app():
    args = app_args(**LIMITS)
    args["kairos"]["policy"]["name"] = "sl:2000"
    args["decode_config"]["deployment_config"]["name"] = DECODERS  # the faults find a pool by its nodes, not its name
    with running_app(args, MODEL, ready_within_s=120) as (url, metrics_url):
        # a second app: tenant and admin keys, no routing shown to tenants, no migration
        secured = app_args(  # and two router shards
            api_keys=[KEY], admin_api_keys=[ADMIN], expose_routing=False, api_docs=True, max_migrations=0,
            router_shards=2,
        )  # fmt: skip
        serve.run(build_app(secured), name="secured", route_prefix="/secured")
        yield url, metrics_url


def healthy(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()


def wait_until(condition, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not met within {timeout_s} s"
        time.sleep(0.2)


def node_states():
    return serve.get_deployment_handle("Router", app_name="kairos").snapshot.remote().result()


def idle(states) -> bool:
    """Every node of both pools reported, with nothing queued, decoding or committed."""
    prefill = [s for s in states.values() if s.role is Role.PREFILL]
    decode = [s for s in states.values() if s.role is Role.DECODE]
    return (
        len(prefill) == 2
        and len(decode) == 2
        and all(not s.view.queued_prompt_tokens for s in prefill)
        and all(s.view.batch_size == 0 and not s.view.committed for s in decode)
    )


def stream_events(url: str, body: dict, on_token=None, timeout_s: float = 120.0, key: str | None = None):
    """(status, headers, parsed data events, saw [DONE]) of a streamed completion (with API key ``key``)."""
    events, done = [], False
    body = {"model": MODEL, "stream": True, **body}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=timeout_s) as r:
        if r.status_code != 200:
            return r.status_code, r.headers, [json.loads(r.read())], False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            events.append(event)
            if on_token is not None and event.get("choices"):
                on_token(event)
        return r.status_code, r.headers, events, done


def test_clients_that_give_up_leak_no_slot_and_their_requests_leave_the_engines(app):
    url, _ = app
    wait_until(lambda: idle(node_states()), what="an idle app")

    async def give_up():
        async with httpx.AsyncClient(base_url=url, timeout=0.5) as client:

            async def one(i: int):
                # 16,000 tokens: far from a first token within 0.5 s, on either route
                body = {"model": MODEL, "prompt": list(range(16_000)), "max_tokens": 2000, "stream": i % 2 == 0}
                with pytest.raises(httpx.TimeoutException):
                    if body["stream"]:
                        async with client.stream("POST", "/v1/completions", json=body) as r:
                            async for _ in r.aiter_lines():
                                pass
                    else:
                        await client.post("/v1/completions", json=body)

            await asyncio.gather(*(one(i) for i in range(8)))

    asyncio.run(give_up())
    wait_until(lambda: healthy(url)["in_flight"] == 0, timeout_s=30, what="no request in flight")
    # their prefills and decodes were dropped, not run to their 2,000th token
    wait_until(lambda: idle(node_states()), timeout_s=30, what="engines free of the abandoned requests")
    assert (
        httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "still", "max_tokens": 2}).status_code
        == 200
    )


class AfterTokens:
    """Calls ``fault(decode node)`` once the stream has sent ``count`` tokens."""

    def __init__(self, count: int, fault) -> None:
        self.count, self.fault, self.seen, self.node, self.done = count, fault, 0, None, False

    def __call__(self, event: dict) -> None:
        self.node = self.node or event.get("kairos", {}).get("decode_node")
        self.seen += 1
        if self.seen == self.count and not self.done:
            self.fault(self.node)
            self.done = True


def token_ids(events: list[dict]) -> tuple[int, list[int]]:
    """(request id, the emulated token ids streamed)."""
    rid = int(events[0]["id"].split("-", 1)[1])
    return rid, [int(e["choices"][0]["text"].removeprefix(" tok")) for e in events if e.get("choices")]


def test_a_decode_replica_killed_mid_stream_is_migrated_and_the_stream_goes_on(app):
    url, metrics_url = app
    kill = AfterTokens(5, lambda node: faults.kill_replica("kairos", node))
    status, _, events, done = stream_events(url, {"prompt": list(range(1000)), "max_tokens": 120}, kill)
    assert status == 200 and done and kill.done
    rid, ids = token_ids(events)
    assert ids == [token_id(rid, i) for i in range(120)]  # every token once, in order, across the move
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("error" in e for e in events)
    wait_until(lambda: 'stage="migration"' in httpx.get(metrics_url, timeout=10).text, what="a counted migration")


def kill_a_busy_prefill_node(url: str) -> list[httpx.Response]:
    """Eight long prompts' responses, sent while the prefill node holding some of them in its queue is killed."""
    wait_until(lambda: idle(node_states()), what="an idle app")

    def queued() -> str | None:
        states = node_states()
        return next((n for n, s in states.items() if s.role is Role.PREFILL and s.view.queued_prompt_tokens), None)

    async def burst():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            base = random.randrange(1, 1 << 20) * 100_000  # prompts no prefix cache holds: they queue whole
            bodies = [
                {"model": MODEL, "prompt": list(range(base + i, base + i + 12_000)), "max_tokens": 3} for i in range(8)
            ]
            sends = [asyncio.create_task(client.post("/v1/completions", json=body)) for body in bodies]
            try:
                victim = await asyncio.to_thread(wait_until, queued, 30, "a prefill node with queued prompts")
            except AssertionError:
                answers = await asyncio.gather(*sends)
                seen = [(r.status_code, r.text[:200]) for r in answers]
                raise AssertionError(f"no prompt queued; answers {seen}") from None
            await asyncio.to_thread(faults.kill_replica, "kairos", victim)
            return await asyncio.gather(*sends)

    return asyncio.run(burst())


def test_a_prefill_replica_killed_with_queued_requests_loses_none(app):
    url, _ = app
    responses = kill_a_busy_prefill_node(url)
    assert [r.status_code for r in responses] == [200] * 8
    assert all(r.json()["usage"]["completion_tokens"] == 3 for r in responses)
    wait_until(lambda: healthy(url)["in_flight"] == 0, what="no request in flight")


def test_the_router_killed_falls_back_and_comes_back(app):
    url, _ = app
    faults.kill_replica("kairos", "Router")
    responses = [
        httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x y", "max_tokens": 2}, timeout=60)
        for _ in range(3)
    ]
    assert [r.status_code for r in responses] == [200] * 3
    wait_until(
        lambda: (
            httpx.post(
                f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=60
            ).headers.get("x-kairos-fallback")
            == "0"
        ),
        timeout_s=90,
        what="routing decisions again",
    )


def fallbacks_counted(metrics_url: str) -> float:
    """The ingress's count of requests the router could not decide (``kairos_decisions{reason="fallback"}``)."""
    lines = httpx.get(metrics_url, timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("ray_kairos_decisions") and
               'reason="fallback"' in line)  # fmt: skip


def test_a_hung_router_actor_falls_back_within_the_decision_deadline_and_is_replaced(app):
    url, metrics_url = app

    def fallback() -> str | None:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        return r.headers.get("x-kairos-fallback")

    wait_until(lambda: fallback() == "0", timeout_s=90, what="routing decisions")
    counted = fallbacks_counted(metrics_url)
    pid = faults.replica_pid(faults.router_actor("kairos"))
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        body = {"model": MODEL, "prompt": list(range(300)), "max_tokens": 3}  # decided, it would be deflected
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert time.monotonic() - start < 30
        # the decision deadline passed: plain disaggregation on nodes the ingress picks, answered in full, counted
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert r.headers["x-kairos-fallback"] == "1" and r.headers["x-kairos-route"] == "prefill"
        assert r.headers["x-kairos-prefill-node"].startswith("prefill-")
        assert r.headers["x-kairos-decode-node"].startswith("decode-")
        wait_until(lambda: fallbacks_counted(metrics_url) > counted, timeout_s=90, what="the fallback counted")
        # the replica's health check finds the actor hung; Serve replaces the replica and the actor with it
        wait_until(lambda: fallback() == "0", timeout_s=180, what="decisions from a new router actor")
        assert faults.replica_pid(faults.router_actor("kairos")) != pid
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed with its replica
            os.kill(pid, signal.SIGCONT)


def test_a_hung_node_past_the_first_token_deadline_answers_504_never_hangs(app):
    url, _ = app
    wait_until(lambda: idle(node_states()), what="an idle app")
    prefill = [n for n, s in node_states().items() if s.role is Role.PREFILL]
    pids = [faults.replica_pid(faults.replica("kairos", n)) for n in prefill]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        # 5,000 tokens no earlier prompt begins with: no node's prefix cache holds them, so they are disaggregated
        prompt = list(range(5000, 0, -1))
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=60)
        elapsed = time.monotonic() - start
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert r.status_code in (503, 504), r.text
    error = r.json()["error"]
    assert error["message"] and error["code"] == r.status_code
    assert elapsed < LIMITS["first_token_timeout_s"] + 20
    wait_until(lambda: healthy(url)["in_flight"] == 0, what="no request in flight")


def test_a_stalled_decode_stream_migrates_after_the_stall_deadline(app):
    url, _ = app
    wait_until(lambda: idle(node_states()), timeout_s=120, what="an idle app")
    stopped = []

    def stop(node: str) -> None:
        pid = faults.replica_pid(faults.replica("kairos", node))
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    stall = AfterTokens(3, stop)
    try:
        status, _, events, done = stream_events(url, {"prompt": list(range(500)), "max_tokens": 40}, stall)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert stopped and status == 200 and done
    rid, ids = token_ids(events)
    assert ids == [token_id(rid, i) for i in range(40)]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": MODEL, "prompt": ""}, "prompt"),
        ({"model": MODEL, "prompt": [""]}, "prompt"),
        ({"model": MODEL, "prompt": []}, "prompt"),
        ({"model": MODEL, "prompt": ["a b"] * 49}, "prompt"),  # more prompts than max_in_flight: never admitted
        ({"model": MODEL, "prompt": "x", "seed": 99999999999999999999999}, "seed"),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            },
            "messages.0.content",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_field(app, body, param):
    url, _ = app
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(f"{url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_deep_nesting_and_huge_bodies_are_refused_at_once(app):
    url, _ = app
    deep = b'{"model": "x", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(f"{url}/v1/completions", content=deep, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    huge = json.dumps({"model": MODEL, "prompt": "word " * 5_000_000}).encode()  # 25 MB
    r = httpx.post(f"{url}/v1/completions", content=huge, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit holds on the stream too
        for _ in range(40):
            yield b" " * (64 << 10)

    r = httpx.post(f"{url}/v1/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413
    assert healthy(url)["in_flight"] == 0
    assert (
        httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 1}).status_code == 200
    )


def test_the_api_key_is_required_where_one_is_set(app):
    url, _ = app
    secured = f"{url}/secured"
    body = {"model": MODEL, "prompt": "a b", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{secured}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, headers
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{secured}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{secured}/health", timeout=30).status_code == 200  # open to probes
    wait_until(
        lambda: (
            httpx.post(
                f"{secured}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
            ).status_code
            == 200
        ),
        what="the secured app serving",
    )
    r = httpx.get(f"{secured}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL


def test_tokenize_detokenize_and_version_are_behind_the_api_key(app):
    url, _ = app
    secured = f"{url}/secured"
    calls = [
        ("GET", "/version", None),
        ("POST", "/tokenize", {"prompt": "a b"}),
        ("POST", "/detokenize", {"tokens": [1]}),
    ]
    for method, path, body in calls:
        assert httpx.request(method, f"{secured}{path}", json=body, timeout=30).status_code == 401, path
    tenant = {"Authorization": f"Bearer {KEY}"}
    version = httpx.get(f"{secured}/version", headers=tenant, timeout=30)
    assert version.status_code == 200 and version.json()["version"] == vllm.__version__
    for method, path, body in calls[1:]:  # emulated engines have no tokenizer: a 501 saying so, not a 404 or a 500
        r = httpx.request(method, f"{secured}{path}", json=body, headers=tenant, timeout=30)
        assert r.status_code == 501 and "emulated" in r.json()["error"]["message"], r.text
        r = httpx.request(method, f"{secured}{path}", content=b"{", headers=tenant, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text


@pytest.mark.parametrize("header, value", [("x-request-disconnect-disabled", "?1"), ("x-request-timeout-seconds", "0")])
def test_a_request_asking_to_outlive_its_client_is_refused_before_it_runs(app, header, value):
    """Serve's proxy would keep such a request running after its client left (or past Serve's timeout)."""
    url, _ = app
    before = {r.process: r.counts for r in faults.residues("kairos")}  # what earlier tests' requests left
    body = {"model": MODEL, "prompt": list(range(16_000)), "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={header: value}, timeout=30) as r:
        assert r.status_code == 400 and json.loads(r.read())["error"]["param"] == header
    assert healthy(url)["in_flight"] == 0
    # nothing of it reached the router or an engine: no process holds more than before
    after = faults.residues("kairos")
    grown = [r for r in after if any(n > before.get(r.process, {}).get(k, 0) for k, n in r.counts.items())]
    assert not grown, grown


def secured_post(url: str, body: dict, key: str) -> httpx.Response:
    r = httpx.post(f"{url}/secured/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_tenants_see_no_route_no_node_and_no_cache_hit_where_routing_is_not_exposed(app):
    url, _ = app
    prompt = list(range(777_000, 779_000))  # 2,000 tokens: a second send finds them cached
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    wait_until(lambda: secured_post(url, body, ADMIN).headers.get("x-kairos-fallback") == "0", what="routing decisions")
    tenant = secured_post(url, body, KEY)
    assert not any(h.startswith("x-kairos-") for h in tenant.headers) and "kairos" not in tenant.json()
    streamed = httpx.post(f"{url}/secured/v1/completions", json={**body, "stream": True},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=60)  # fmt: skip
    assert streamed.status_code == 200 and '"kairos"' not in streamed.text and "decode-" not in streamed.text
    admin = secured_post(url, body, ADMIN)  # the operator sees everything, the cache hit included
    assert admin.headers["x-kairos-decode-node"].startswith("decode-") and "x-kairos-cached-tokens" in admin.headers
    assert admin.json()["kairos"]["cached_tokens"] == int(admin.headers["x-kairos-cached-tokens"]) > 0


def test_the_live_view_and_the_api_docs_are_for_admin_keys_and_the_view_is_built_once_a_second(app):
    url, _ = app
    secured = f"{url}/secured"
    for path in ("/kairos/state", "/openapi.json", "/docs"):
        assert httpx.get(f"{secured}{path}", timeout=30).status_code == 401
        tenant = httpx.get(f"{secured}{path}", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert tenant.status_code == 403 and tenant.json()["error"]["type"] == "permission_error"
        admin = httpx.get(f"{secured}{path}", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
        assert admin.status_code == 200, (path, admin.text)
    assert "/v1/completions" in httpx.get(f"{secured}/openapi.json", headers={"Authorization": f"Bearer {ADMIN}"},
                                          timeout=30).json()["paths"]  # fmt: skip
    assert httpx.get(f"{url}/openapi.json", timeout=30).status_code == 404  # off unless serving.api_docs
    states = [httpx.get(f"{url}/kairos/state", timeout=30).json()["wall_s"] for _ in range(5)]
    assert len(set(states)) < len(states)  # callers within a second share one answer


def test_a_failure_behind_a_remote_error_shows_the_client_no_traceback_and_names_its_request(app):
    """The secured app migrates nothing: its decode replica killed mid-stream ends the stream with an error event,
    whose cause (the dead actor's error: ids, addresses) stays in the log."""
    url, _ = app
    kill = AfterTokens(3, lambda node: faults.kill_replica("secured", node))
    body = {"prompt": list(range(600)), "max_tokens": 60}
    status, _, events, done = stream_events(f"{url}/secured", body, kill, key=ADMIN)
    assert status == 200 and done and kill.done
    (error,) = [e["error"] for e in events if "error" in e]
    rid = events[0]["id"].removeprefix("cmpl-")
    assert f"request {rid}" in error["message"] and "its decode nodes failed" in error["message"]
    for leak in ("Traceback", 'File "', "Error", "pid", "actor", ".py", "decode-"):
        assert leak not in error["message"], error["message"]


def test_the_ray_session_is_the_apps(app):
    """A guard on the helpers above: the fault injection finds this app's replicas, by their node ids."""
    assert len(faults.replica_names("kairos", DECODERS)) == 2 and ray.is_initialized()
    for node, state in node_states().items():
        expected = DECODERS if state.role is Role.DECODE else "prefill"
        assert faults.deployment_of("kairos", node) == expected


@settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODIES, chat=st.booleans(), raw=st.none() | st.binary(max_size=64))
def fuzz_once(client: httpx.Client, codes: list[int], body, chat: bool, raw: bytes | None) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    content = raw if raw is not None else json.dumps(body).encode()
    with client.stream("POST", path, content=content, headers={"content-type": "application/json"}) as r:
        r.read()
        codes.append(r.status_code)
        assert r.status_code < 500, (r.status_code, content[:300], r.text[:300])


def test_generated_bodies_never_get_a_5xx_and_the_app_keeps_serving(app):
    """Generated bodies (valid, almost valid and garbage) against a live emulated app, through the engines: the
    parsing alone meets ten times as many in process (``test_ingress.py``)."""
    url, _ = app
    fast = app_args(time_scale=0.001, context_tokens=128)  # a chat request without max_tokens fills the context
    serve.run(build_app(fast), name="fuzz", route_prefix="/fuzz")
    try:
        body = {"model": MODEL, "prompt": "ready", "max_tokens": 1}
        wait_until(
            lambda: httpx.post(f"{url}/fuzz/v1/completions", json=body, timeout=60).status_code == 200,
            what="the fuzz app",
        )
        codes: list[int] = []
        with httpx.Client(base_url=f"{url}/fuzz", timeout=60) as client:
            fuzz_once(client, codes)
        assert len(codes) >= 200 and {200, 400} <= set(codes), sorted(set(codes))
        assert httpx.post(f"{url}/fuzz/v1/completions", json=body, timeout=60).status_code == 200
        wait_until(lambda: healthy(f"{url}/fuzz")["in_flight"] == 0, what="no request in flight")
    finally:
        serve.delete("fuzz")


def test_every_per_request_structure_is_empty_once_idle_however_its_requests_ended(app):
    url, _ = app
    wait_until(lambda: idle(node_states()), what="an idle app")

    async def every_ending():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:

            async def complete(prompt_tokens: int, stream: bool, max_tokens: int = 4) -> int:
                body = {
                    "model": MODEL,
                    "prompt": list(range(prompt_tokens)),
                    "max_tokens": max_tokens,
                    "stream": stream,
                }
                return (await client.post("/v1/completions", json=body)).status_code

            async def leave(after_first_token: bool) -> None:
                body = {"model": MODEL, "prompt": list(range(16_000)), "max_tokens": 500, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if not after_first_token or line.startswith("data: "):
                            return  # the client goes away, before its first token or after it

            # completed, on both routes (sl:2000: deflected up to 2,000 tokens, disaggregated past it)
            done = await asyncio.gather(*(complete(p, s) for p in (100, 3000) for s in (False, True)))
            # clients gone before and after their first token
            await asyncio.gather(*(leave(after) for after in (False, True, False, True)))
            # shed: more at once than the ingress admits (max_in_flight) are refused with 429
            burst = [complete(4000, False, max_tokens=300) for _ in range(LIMITS["max_in_flight"] + 12)]
            shed = await asyncio.gather(*burst)
            return done, shed

    done, shed = asyncio.run(every_ending())
    assert done == [200] * 4 and 429 in shed and set(shed) <= {200, 429}
    # migrated (its decode replica killed mid-stream) and failed over (a prefill replica killed with work queued)
    kill = AfterTokens(3, lambda node: faults.kill_replica("kairos", node))
    status, _, _, finished = stream_events(url, {"prompt": list(range(500)), "max_tokens": 40}, kill)
    assert status == 200 and finished and kill.done
    assert {r.status_code for r in kill_a_busy_prefill_node(url)} == {200}

    wait_until(lambda: idle(node_states()), what="an idle app again")
    assert len(wait_for_no_residue()) == 6  # the ingress, the router and the four nodes were all asked


def test_a_soak_samples_every_router_shard_s_actor(app):
    """``kairos soak`` finds each shard's RouterActor, each its own role (a replacement pairs with its shard's)."""

    def both() -> list | None:
        found = Finder("secured").find()  # a replica asked before it answers is asked again next time
        return found if sum(x.role.startswith("router-actor") for x in found) == 2 else None

    found = wait_until(both, what="both shards' actors found")
    actors = {x.role: x for x in found if x.role.startswith("router-actor")}
    assert set(actors) == {"router-actor", "router-actor-1"}
    for role, shard in (("router-actor", "Router"), ("router-actor-1", "Router-1")):
        assert actors[role].pid == faults.replica_pid(faults.router_actor("secured", shard))
        assert actors[role].label.startswith(f"{role}#")
    assert {x.role for x in found} >= {"Ingress", "Router", "Router-1", "prefill", "controller", "proxy"}

    def environ(role: str) -> set[str]:
        pid = next(x.pid for x in found if x.role == role)
        return set(Path(f"/proc/{pid}/environ").read_text().split("\0"))

    # glibc's malloc arenas capped in the ingress (INGRESS_ENV); the engines keep the default
    assert {f"{name}={value}" for name, value in INGRESS_ENV.items()} <= environ("Ingress")
    assert not any(v.startswith("MALLOC_ARENA_MAX=") for v in environ("prefill"))


def test_a_router_shard_killed_under_load_loses_no_request_and_the_other_shard_decides_at_once(app):
    url, metrics_url = app
    body = {"model": MODEL, "prompt": list(range(300)), "max_tokens": 8}
    wait_until(lambda: secured_post(url, body, ADMIN).headers.get("x-kairos-fallback") == "0", what="decisions")
    pid = faults.replica_pid(faults.router_actor("secured", "Router-1"))
    sent: list[tuple[float, httpx.Response]] = []

    def load(stop: float) -> None:  # a request at a time per thread, until ``stop``
        while time.monotonic() < stop:
            sent.append((time.monotonic(), secured_post(url, body, ADMIN)))

    start = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(load, start + 20) for _ in range(4)]
        wait_until(lambda: len(sent) >= 8, what="requests under way")
        killed = time.monotonic()
        faults.kill_replica("secured", "Router-1")  # its actor goes with it; Serve starts a new replica
        for thread in running:
            thread.result()
    assert len(sent) > 20 and [r.status_code for _, r in sent] == [200] * len(sent)  # none lost
    after = sorted((t, r.headers["x-kairos-fallback"]) for t, r in sent if t > killed)
    decided = [t for t, fallback in after if fallback == "0"]
    assert decided and decided[0] - killed < 15  # the other shard decides (recovery within the chaos table's bound)
    later = [fallback for t, fallback in after if t > decided[0] + 2]  # and goes on deciding, the new Router-1
    assert len(later) > 20 and later.count("1") <= 2  # skipped until every node has reported to it
    states = serve.get_deployment_handle("Router", app_name="secured").snapshot.remote().result()
    assert sum(s.role is Role.DECODE for s in states.values()) == 2  # shard 0 has every node's state

    def replaced() -> bool:
        with contextlib.suppress(Exception):  # no replica yet
            return faults.replica_pid(faults.router_actor("secured", "Router-1")) != pid
        return False

    wait_until(replaced, timeout_s=180, what="a new Router-1 replica")
    text = wait_for_series(metrics_url, ["ray_kairos_router_shard_failovers"])  # the ingress counted leaving it out
    assert re.search(r'ray_kairos_router_shard_failovers(_total)?\{[^}]*shard="1"[^}]*\} [1-9]', text), text[-2000:]


def test_a_soak_with_a_replica_kill_finds_every_process_counts_every_request_and_the_replacement(app, tmp_path, capsys):
    """``kairos soak`` against the app: every request counted, every process sampled, the killed decode replica
    paired with the one Serve starts in its place."""
    url, _ = app
    report_path, plot_path = tmp_path / "soak.json", tmp_path / "soak.png"
    code = cli.main(
        ["soak", "--url", url, "--rps", "3", "--duration-s", "28", "--skip-s", "4", "--sample-s", "1",
         "--fault-every-s", "14", "--faults", "decode-replica-kill", "--hang-s", "120",
         "--json", str(report_path), "--plot", str(plot_path)]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    report = json.loads(report_path.read_text())
    assert plot_path.read_bytes()[:4] == b"\x89PNG"

    requests = report["requests"]
    assert requests["sent"] > 0 and requests["completed"] > 0
    assert requests["sent"] == sum(requests[o] for o in ("completed", "failed", "hung", "lost"))
    assert requests["lost"] == requests["hung"] == 0
    assert report["in_flight_after"] == 0
    assert report["residue"] and not any(report["residue"])  # every process read, none holding anything

    processes = report["processes"]
    roles = {p["role"] for p in processes}
    assert {"Ingress", "Router", "router-actor", "prefill", DECODERS, "controller", "proxy"} <= roles
    assert all(p["rss_start_mib"] > 0 and p["fds_start"] > 0 for p in processes)
    assert all(p["rss_mib_per_hour"] is not None for p in processes if p["last_s"] - p["first_s"] >= 2)

    (fault,) = report["faults"]
    assert report["num_faults"] == 1 and fault["fault"] == "decode-replica-kill"
    killed = f"{DECODERS}#" + fault["note"].removeprefix("ray.kill decode-")
    (old,) = [p for p in processes if p["label"] == killed]
    assert old["ended_s"] is not None and old["replaced_by"] is not None
    (new,) = [p for p in processes if p["label"] == old["replaced_by"]]
    assert new["role"] == DECODERS and new["replaces"] == killed and new["pid"] != old["pid"]
    assert f"replaced by {new['label']}" in printed and f"replaces {killed}" in printed


def test_a_soak_of_an_app_that_is_not_there_names_the_ones_that_are(app, capsys):
    code = cli.main(["soak", "--url", app[0], "--app", "nope", "--duration-s", "5", "--skip-s", "1"])
    said = capsys.readouterr().err
    assert code == 2 and "no Serve application 'nope'" in said and "kairos" in said
