"""Pool autoscaling on Kairos's signals: the rule by hand, then a real multi-node Ray cluster."""

import asyncio
import time

import httpx
import pytest
import ray
from pydantic import ValidationError
from ray import serve
from ray.cluster_utils import Cluster

from kairos_ray.bench.local import free_port
from kairos_ray.messages import Role
from kairos_ray.serve import build_app
from kairos_ray.serve.args import AppArgs
from kairos_ray.serve.autoscaling import KV_FREE_SHARE, PREFILL_WAIT, TBT_HEADROOM, KairosPoolPolicy
from tests import shared_ray

from .conftest import MODEL, app_args

PREFILL = KairosPoolPolicy(
    "prefill", ttft_slo_s=4.0, wait_share=0.5, quiet_share=0.1, upscale_after_s=5, downscale_after_s=30, cooldown_s=30
)


def waits(*seconds):
    return {PREFILL_WAIT: {f"r{i}": s for i, s in enumerate(seconds)}}


def test_prefill_pool_scales_out_only_after_pressure_holds():
    target, state = PREFILL.decide(1, 1, 3, waits(3.0), {}, now=100.0)  # 3 s > 0.5 * 4 s: pressure starts
    assert target == 1
    target, state = PREFILL.decide(1, 1, 3, waits(3.0), state, now=104.0)
    assert target == 1
    target, state = PREFILL.decide(1, 1, 3, waits(3.0), state, now=105.0)
    assert target == 2
    # right after a change: the cooldown holds it, however busy
    target, state = PREFILL.decide(2, 1, 3, waits(3.0, 3.0), state, now=111.0)
    target, state = PREFILL.decide(2, 1, 3, waits(3.0, 3.0), state, now=120.0)
    assert target == 2
    target, state = PREFILL.decide(2, 1, 3, waits(3.0, 3.0), state, now=135.0)
    assert target == 3
    target, state = PREFILL.decide(3, 1, 3, waits(9.0, 9.0, 9.0), state, now=500.0)
    assert target == 3  # max_replicas


def test_prefill_pool_scales_in_after_a_quiet_spell_and_not_on_a_blip():
    state = {}
    for now in (0.0, 20.0):
        target, state = PREFILL.decide(2, 1, 3, waits(0.1, 0.2), state, now=now)
        assert target == 2
    target, state = PREFILL.decide(2, 1, 3, waits(1.0, 0.2), state, now=25.0)  # mean 0.6 s: not quiet
    target, state = PREFILL.decide(2, 1, 3, waits(0.1, 0.1), state, now=40.0)  # quiet again from 40 s
    target, state = PREFILL.decide(2, 1, 3, waits(0.1, 0.1), state, now=69.0)
    assert target == 2
    target, state = PREFILL.decide(2, 1, 3, waits(0.1, 0.1), state, now=70.0)
    assert target == 1
    assert PREFILL.decide(1, 1, 3, waits(0.0), {}, now=1e6)[0] == 1  # min_replicas
    assert PREFILL.decide(2, 1, 3, {}, {}, now=0.0)[0] == 2  # no signal, no change


def test_decode_pool_scales_on_tbt_headroom_or_kv():
    policy = KairosPoolPolicy("decode", 4.0, min_tbt_headroom_s=0.01, min_kv_free_share=0.1, upscale_after_s=0)
    roomy = {TBT_HEADROOM: {"a": 0.03}, KV_FREE_SHARE: {"a": 0.5}}
    no_headroom = {TBT_HEADROOM: {"a": 0.005, "b": 0.03}, KV_FREE_SHARE: {"a": 0.5, "b": 0.5}}
    no_kv = {TBT_HEADROOM: {"a": 0.03}, KV_FREE_SHARE: {"a": 0.05}}
    assert policy.decide(1, 1, 4, roomy, {}, now=0.0)[0] == 1
    assert policy.decide(1, 1, 4, no_headroom, {}, now=0.0)[0] == 2
    assert policy.decide(1, 1, 4, no_kv, {}, now=0.0)[0] == 2


def test_autoscaling_args_are_checked():
    args = app_args()
    args["prefill_config"]["autoscaling"] = {"min_replicas": 3, "max_replicas": 2}
    with pytest.raises(ValidationError, match=r"max_replicas \(2\) < min_replicas \(3\)"):
        AppArgs.model_validate(args)
    args["prefill_config"]["autoscaling"] = {"min_replicas": 1, "max_replicas": 2}
    args["prefill_config"]["deployment_config"]["num_replicas"] = 3
    with pytest.raises(ValidationError, match="must lie within autoscaling"):
        AppArgs.model_validate(args)


@pytest.fixture
def node_groups(monkeypatch):
    """A head (CPU) plus two prefill-group nodes and one decode-group node, as separate Ray nodes."""
    monkeypatch.setenv("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")  # inherited by replicas
    shared_ray.stop()  # this test's Ray has nodes of its own
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    prefill_nodes = [cluster.add_node(num_cpus=0, resources={"prefill_node": 1}) for _ in range(2)]
    cluster.add_node(num_cpus=0, resources={"decode_node": 1})
    ray.init(address=cluster.address)
    try:
        yield {node.node_id for node in prefill_nodes}
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.ray
@pytest.mark.own_ray
@pytest.mark.in_vllm_layer  # the other live layer takes longer than the vLLM app layer
def test_sustained_burst_adds_a_prefill_replica_and_quiet_removes_it(node_groups):
    port = free_port()
    args = app_args(max_in_flight=1024)  # admission is not under test: the whole burst is admitted, however slow
    args["kairos"]["policy"]["name"] = "pd"  # everything queues on the prefill pool
    for name, resource in (("prefill_config", "prefill_node"), ("decode_config", "decode_node")):
        args[name]["deployment_config"] = {"num_replicas": 1, "ray_actor_options": {"resources": {resource: 1}}}
    args["prefill_config"]["autoscaling"] = {
        "min_replicas": 1, "max_replicas": 2, "wait_share": 0.25, "quiet_share": 0.05,
        "upscale_after_s": 1, "downscale_after_s": 3, "cooldown_s": 2, "look_back_period_s": 2,
    }  # fmt: skip
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="kairos", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    router = serve.get_deployment_handle("Router", app_name="kairos")

    def prefill_nodes():
        states = router.snapshot.remote().result().values()
        return {s.node_id: s.ray_node_id for s in states if s.role is Role.PREFILL}

    async def run():
        responses = []
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            sending, grown, deadline = [], None, time.monotonic() + 120
            while grown is None and time.monotonic() < deadline:  # 6 long prompts a second, until it grows
                # each its own first token: no prompt is in the prefill nodes' prefix caches
                body = {"model": MODEL, "prompt": [len(sending), *range(1, 8000)], "max_tokens": 4}
                sending.append(asyncio.ensure_future(client.post("/v1/completions", json=body)))
                await asyncio.sleep(1 / 6)
                if len(sending) % 6 == 0:
                    nodes = await asyncio.to_thread(prefill_nodes)
                    grown = nodes if len(nodes) == 2 else None
            responses = await asyncio.gather(*sending)
        return grown, responses

    grown, responses = asyncio.run(run())
    assert grown is not None, "the prefill pool never grew"
    assert set(grown.values()) == node_groups  # one replica on each prefill-group node
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4 for r in responses)

    def running_prefill_replicas():
        return serve.status().applications["kairos"].deployments["prefill"].replica_states.get("RUNNING")

    async def trickle_until_shrunk():
        # light traffic keeps flowing while the pool shrinks: none of it may be lost
        responses, deadline = [], time.monotonic() + 120
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            body = {"model": MODEL, "prompt": list(range(300)), "max_tokens": 3}
            while time.monotonic() < deadline:
                responses.append(asyncio.ensure_future(client.post("/v1/completions", json=body)))
                await asyncio.sleep(0.5)
                if len(responses) % 4 == 0 and await asyncio.to_thread(running_prefill_replicas) == 1:
                    break
            return await asyncio.gather(*responses)

    trickle = asyncio.run(trickle_until_shrunk())
    assert running_prefill_replicas() == 1, "the prefill pool never shrank back"
    assert len(trickle) >= 4
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3 for r in trickle)


def test_a_node_reports_its_queue_wait_or_its_tbt_headroom_and_free_kv():
    from kairos_ray.config import KairosConfig
    from kairos_ray.core import DecodeNodeView, PrefillNodeView
    from kairos_ray.serve.autoscaling import KV_FREE_SHARE, PREFILL_WAIT, TBT_HEADROOM, node_signals

    policy = KairosConfig().build_policy()
    idle, queued = (node_signals(policy, PrefillNodeView("p0", q)) for q in ((), (8000, 8000)))
    assert idle == {PREFILL_WAIT: 0.0} and queued[PREFILL_WAIT] > 0.0
    empty = node_signals(policy, DecodeNodeView("d0", 0, 0, 100_000))
    busy = node_signals(policy, DecodeNodeView("d0", 32, 60_000, 40_000))
    assert busy[TBT_HEADROOM] < empty[TBT_HEADROOM] and empty[KV_FREE_SHARE] == 1.0
    assert busy[KV_FREE_SHARE] == pytest.approx(0.4)
