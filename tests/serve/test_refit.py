"""Online refit of the step-latency model from reported steps."""

import numpy as np
import pytest

from kairos_ray.config import resolve_profile
from kairos_ray.core import StepLatencyModel
from kairos_ray.messages import DecisionRequest, StepRecord
from kairos_ray.serve.refit import OnlineRefit

SHIPPED = StepLatencyModel.load(resolve_profile("a100-deepseek-v2-lite"))
# the hardware turns out slower than profiled: every coefficient 30 % higher
ACTUAL = StepLatencyModel.from_coefficients(SHIPPED.coefficients * 1.3, SHIPPED.tile_tokens)


def reports(model, n, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        b, k, chi = int(rng.integers(0, 128)), int(rng.integers(0, 400_000)), int(rng.choice([0, 64, 256, 512, 2048]))
        measured = model.step_s(b, k, chi) * (1 + 0.02 * rng.standard_normal())
        yield StepRecord(b, k, chi, measured, 0.0)


def test_refit_adopts_a_model_that_predicts_the_reported_steps_better():
    online = OnlineRefit(every=300)
    for state in reports(ACTUAL, 299):
        online.add([state])
    assert not online.due
    online.add(reports(ACTUAL, 1, seed=9))
    assert online.due
    assert online.mape(SHIPPED) == pytest.approx(0.3 / 1.3, rel=0.05)  # the live prediction error
    result = online.refit(SHIPPED)
    assert not online.due
    assert result.model is not None and result.refit_mape < 0.03 < result.current_mape
    assert result.model.step_s(64, 200_000, 512) == pytest.approx(ACTUAL.step_s(64, 200_000, 512), rel=0.05)


def test_refit_keeps_the_current_model_when_it_is_already_right():
    online = OnlineRefit(every=200)
    for state in reports(SHIPPED, 200):
        online.add([state])
    result = online.refit(SHIPPED)
    assert result.current_mape < 0.03
    if result.model is not None:  # adopted only if strictly better on the window
        assert result.refit_mape < result.current_mape


def test_steps_without_a_measured_time_are_ignored():
    online = OnlineRefit(every=2)
    online.add([])  # a heartbeat: no step
    online.add([StepRecord(1, 10, 0, 0.0, 0.0)])
    assert not online.due and online.num_samples == 0
    online.add([StepRecord(1, 10, 0, 0.01, 0.0), StepRecord(2, 20, 64, 0.02, 0.0)])  # a report with two steps
    assert online.due and online.num_samples == 2
    with pytest.raises(ValueError, match="every <= window"):
        OnlineRefit(every=10, window=5)


def test_the_router_adopts_a_refit_into_its_policy_keeping_the_configs_knobs():
    from kairos_ray.config import KairosConfig
    from kairos_ray.core import DecodeNodeView
    from kairos_ray.messages import NodeState
    from kairos_ray.serve.router import RouterActor
    from kairos_ray.serve.types import RouterOptions

    router = RouterActor(KairosConfig(), RouterOptions(refit_every_steps=300))
    before = router.state.policy
    router.report(NodeState(DecodeNodeView("d0", 0, 0, 1_000_000), "host", 0.0, tuple(reports(ACTUAL, 300))))
    after = router.state.policy
    assert after is not before and after.spec == before.spec and after.params == before.params
    assert after.decode_model is router.model  # the refit model, not the shipped one
    assert router.model.step_s(64, 200_000, 512) == pytest.approx(ACTUAL.step_s(64, 200_000, 512), rel=0.05)


def test_the_window_keeps_the_latest_steps():
    online = OnlineRefit(every=2, window=4)
    online.add([StepRecord(1, 10, 0, 0.001 * (i + 1), 0.0) for i in range(6)])
    assert online.num_samples == 4
    assert sorted(online.table().step_s) == pytest.approx([0.003, 0.004, 0.005, 0.006])  # the first two overwritten


def test_reported_steps_are_priced_with_the_model_the_router_uses_in_the_live_view():
    import time

    from kairos_ray.config import KairosConfig
    from kairos_ray.core import DecodeNodeView
    from kairos_ray.messages import NodeState
    from kairos_ray.serve.router import RouterActor
    from kairos_ray.serve.types import RouterOptions

    router = RouterActor(KairosConfig(), RouterOptions(refit_every_steps=300))
    view = DecodeNodeView("d0", 0, 0, 1_000_000)
    first = tuple(reports(ACTUAL, 99))  # the engine priced none of them (predicted_s 0.0); nothing refit yet
    router.report(NodeState(view, "host", 0.0, first))
    (node,) = router.live().nodes
    shipped = [SHIPPED.step_s(s.batch_size, s.kv_tokens, s.chunk_tokens) for s in first]
    assert node.step_predicted_s == pytest.approx(np.mean(shipped))
    assert node.step_error == pytest.approx(0.3 / 1.3, rel=0.1)  # the shipped profile, 30 % slow hardware

    def priced(count, seed):
        router.report(NodeState(view, "host", 0.0, tuple(reports(ACTUAL, count, seed=seed))))
        return router.metrics.window.steps.values(time.monotonic(), "d0")[-count:]

    priced(1, 1)  # the node's 100th step: calibrated on its own steps
    assert router.scales is not None
    model = router.scales.model_for("d0", "decode", router.model)
    assert model is not router.model
    later = priced(50, 2)
    assert [s.predicted_s for s in later] == [model.step_s(s.batch_size, s.kv_tokens, s.chunk_tokens) for s in later]
    assert np.mean([abs(s.predicted_s - s.measured_s) / s.measured_s for s in later]) < 0.03
    # at 300 steps the pool's model is refit; the node's scale, fitted against the old one, is dropped
    priced(150, 3)
    assert not router.scales.scale
    assert router.model.step_s(64, 200_000, 512) == pytest.approx(ACTUAL.step_s(64, 200_000, 512), rel=0.05)
    last = priced(20, 4)
    assert [s.predicted_s for s in last] == [
        router.model.step_s(s.batch_size, s.kv_tokens, s.chunk_tokens) for s in last
    ]


def test_a_node_slower_than_its_pool_is_calibrated_and_decided_on_with_its_own_scale():
    from kairos_ray.config import KairosConfig
    from kairos_ray.core import DecodeNodeView, PrefillNodeView
    from kairos_ray.messages import NodeState
    from kairos_ray.serve.router import RouterActor
    from kairos_ray.serve.types import RouterOptions

    router = RouterActor(KairosConfig(), RouterOptions(refit_every_steps=1000))  # the pool's refit not yet due
    slow, usual = DecodeNodeView("slow", 0, 0, 1_000_000), DecodeNodeView("usual", 0, 0, 1_000_000)
    router.report(NodeState(PrefillNodeView("p0"), "host", 0.0))
    for i in range(4):  # each node recalibrated every 100 of its steps
        router.report(NodeState(slow, "host", 0.0, tuple(reports(ACTUAL, 100, seed=i))))
        router.report(NodeState(usual, "host", 0.0, tuple(reports(SHIPPED, 100, seed=10 + i))))
    assert router.scales is not None and router.scales.scale["slow"] == pytest.approx(1.3, rel=0.02)
    # its pool's model fits it: it keeps its own scale of about 1, not its slow sibling's
    assert router.scales.scale["usual"] == pytest.approx(1.0, rel=0.02)
    views = {n.node_id: n for n in router.state.view(0.0)[0].decode}
    assert views["usual"].model.step_s(64, 200_000, 512) == pytest.approx(SHIPPED.step_s(64, 200_000, 512), rel=0.02)
    slow_model = views["slow"].model
    assert slow_model.step_s(64, 200_000, 512) == pytest.approx(1.3 * SHIPPED.step_s(64, 200_000, 512), rel=0.02)
    # a decision names the model it priced its decode node with: the node's run-time guards check with it
    from kairos_ray.messages import DecisionRequest

    (reply,) = router.decide_many([DecisionRequest(1, 2000, 8)])
    assert reply.decision.decode_node in views
    assert reply.decode_model == views[reply.decision.decode_node].model
    # a node that leaves takes its calibration with it
    router.state.forget_silent_nodes(float("inf"))
    router.report(NodeState(usual, "host", 0.0, tuple(reports(SHIPPED, 1))))
    assert router.scales.nodes() == ["usual"] and not router.scales.scale


def test_a_calibration_is_adopted_only_when_it_predicts_the_nodes_steps_better():
    from kairos_ray.serve.refit import NodeScales

    scales = NodeScales(every=50, window=100)
    assert scales.add("d0", "decode", reports(SHIPPED, 49), SHIPPED) is None  # not due yet
    result = scales.add("d0", "decode", reports(SHIPPED, 1, seed=3), SHIPPED)
    assert result is not None and result.model is None and "d0" not in scales.scale  # already right: kept
    # the window now holds the slow steps only
    result = scales.add("d0", "decode", reports(ACTUAL, 100, seed=4), SHIPPED)
    assert result is not None and result.model is not None and scales.scale["d0"] == pytest.approx(1.3, rel=0.02)
    model = scales.model_for("d0", "decode", SHIPPED)
    assert scales.model_for("d0", "decode", SHIPPED) is model  # one object while nothing changes


def test_a_nodes_scale_follows_when_its_steps_slow_down():
    from kairos_ray.serve.refit import NodeScales

    scales = NodeScales(every=100, window=100)
    scales.add("d0", "decode", reports(ACTUAL, 100), SHIPPED)
    assert scales.scale["d0"] == pytest.approx(1.3, rel=0.02)
    slower = StepLatencyModel.from_coefficients(SHIPPED.coefficients * 1.8, SHIPPED.tile_tokens)  # neighbours moved in
    result = scales.add("d0", "decode", reports(slower, 100, seed=5), SHIPPED)
    assert result is not None and result.model is not None and scales.scale["d0"] == pytest.approx(1.8, rel=0.02)


def test_a_node_without_its_own_scale_is_priced_with_its_groups_calibrated_nodes():
    from kairos_ray.serve.refit import NodeScales

    scales = NodeScales(every=100, window=100)
    slower = StepLatencyModel.from_coefficients(SHIPPED.coefficients * 2.0, SHIPPED.tile_tokens)
    scales.add("d0", "decode", reports(ACTUAL, 100), SHIPPED)
    scales.add("d1", "decode", reports(slower, 100, seed=1), SHIPPED)
    assert scales.add("d2", "decode", reports(slower, 10, seed=2), SHIPPED) is None  # too few steps of its own
    # d2 shares its siblings' hosts: priced at their median (1.3 and 2.0), not at the profile's speed
    assert scales.scale_of("d2", "decode") == pytest.approx(1.65, rel=0.02)
    assert scales.model_for("d2", "decode", SHIPPED).step_s(8, 4096, 0) == pytest.approx(
        1.65 * SHIPPED.step_s(8, 4096, 0), rel=0.02
    )
    assert scales.model_for("p0", "prefill", SHIPPED) is SHIPPED  # another group borrows nothing
    # a node at the profile's speed among slow siblings adopts its own scale of about 1
    result = scales.add("d3", "decode", reports(SHIPPED, 100, seed=3), SHIPPED)
    assert result is not None and result.model is not None
    assert scales.scale["d3"] == pytest.approx(1.0, rel=0.02)
    assert scales.scale_of("d2", "decode") == pytest.approx(1.3, rel=0.02)  # median of 1.0, 1.3 and 2.0
    scales.forget("d0")
    assert scales.scale_of("d2", "decode") == pytest.approx(1.5, rel=0.02)  # median of 1.0 and 2.0
    scales.reset()
    assert scales.model_for("d2", "decode", SHIPPED) is SHIPPED


def test_a_calibration_or_a_refit_reprices_the_nodes_that_have_not_reported_since():
    """A node is ranked against its siblings on models fitted against the same pool model: one that has not
    reported since a calibration moved its group's scale, or since a refit replaced the pool's model, is not left
    priced with the model of before (the holder of a conversation's history ranked below an idle sibling)."""
    from kairos_ray.config import KairosConfig
    from kairos_ray.core import DecodeNodeView, PrefillNodeView
    from kairos_ray.messages import NodeState
    from kairos_ray.serve.router import RouterActor
    from kairos_ray.serve.types import RouterOptions

    router = RouterActor(KairosConfig(), RouterOptions(refit_every_steps=300))
    busy, idle = DecodeNodeView("busy", 0, 0, 1_000_000), DecodeNodeView("idle", 0, 0, 1_000_000)
    router.report(NodeState(PrefillNodeView("p0"), "host", 0.0))
    router.report(NodeState(idle, "host", 0.0))

    def models():
        return {n.node_id: n.model for n in router.state.view(0.0)[0].decode}

    assert models()["idle"] is None  # nothing calibrated yet: the pool's model
    router.report(NodeState(busy, "host", 0.0, tuple(reports(ACTUAL, 100))))  # calibrated at x 1.3
    assert router.scales is not None and router.scales.scale["busy"] == pytest.approx(1.3, rel=0.02)
    idle_model = models()["idle"]
    assert idle_model is not None  # its group's scale, though it has not reported since
    assert idle_model.step_s(64, 200_000, 512) == pytest.approx(1.3 * SHIPPED.step_s(64, 200_000, 512), rel=0.02)
    router.report(NodeState(busy, "host", 0.0, tuple(reports(ACTUAL, 200, seed=1))))  # the pool's refit is due
    assert router.model is not router.config.predictor.load() and not router.scales.scale
    assert models() == {"busy": None, "idle": None}  # both on the refit model, the policy's


def test_use_policy_starts_the_router_over_without_the_nodes_calibrations():
    from kairos_ray.config import KairosConfig
    from kairos_ray.core import DecodeNodeView, PrefillNodeView
    from kairos_ray.messages import NodeState
    from kairos_ray.serve.router import RouterActor
    from kairos_ray.serve.types import RouterOptions

    router = RouterActor(KairosConfig(), RouterOptions(refit_every_steps=1000))
    router.report(NodeState(PrefillNodeView("p0"), "host", 0.0))
    router.report(NodeState(DecodeNodeView("d0", 0, 0, 1_000_000), "host", 0.0, tuple(reports(ACTUAL, 100))))
    assert router.scales is not None and router.scales.scale["d0"] == pytest.approx(1.3, rel=0.02)
    router.use_policy(router.state.policy.spec)
    assert router.scales is not None and not router.scales.scale and not router.scales.nodes()
    assert router.state.view(0.0)[0].decode[0].model is None  # d0 too, before it reports again
    router.report(NodeState(DecodeNodeView("d1", 0, 0, 1_000_000), "host", 0.0))
    views = {n.node_id: n for n in router.state.view(0.0)[0].decode}
    assert views["d1"].model is None  # priced with the pool's model again


def test_a_node_group_with_its_own_profile_is_priced_with_it_and_kept_out_of_the_pools_refit():
    from kairos_ray.config import KairosConfig
    from kairos_ray.core import DecodeNodeView, PrefillNodeView
    from kairos_ray.messages import NodeState
    from kairos_ray.serve.router import RouterActor
    from kairos_ray.serve.types import RouterOptions

    h100 = StepLatencyModel.load(resolve_profile("h100-deepseek-v2-lite"))
    options = RouterOptions(refit_every_steps=300, group_profiles=(("decode-1", "h100-deepseek-v2-lite"),))
    router = RouterActor(KairosConfig(), options)
    fast, usual = DecodeNodeView("decode-1-hhhh", 0, 0, 1_000_000), DecodeNodeView("decode-aaaa", 0, 0, 1_000_000)
    router.report(NodeState(PrefillNodeView("prefill-pppp"), "host", 0.0))
    router.report(NodeState(usual, "host", 0.0))
    router.report(NodeState(fast, "host", 0.0, tuple(reports(h100, 1))))
    views = {n.node_id: n for n in router.state.view(0.0)[0].decode}
    assert views["decode-1-hhhh"].model is router.group_models["decode-1"]  # its group's profile, from its first report
    assert views["decode-aaaa"].model is None  # the pool's: the policy's own
    assert router.model.step_s(64, 200_000, 512) > 1.2 * h100.step_s(64, 200_000, 512)  # the A100 profile
    # 400 steps at the H100's speed: they calibrate that node on its own profile (about x1), not the A100 model
    for i in range(4):
        router.report(NodeState(fast, "host", 0.0, tuple(reports(h100, 100, seed=i))))
    assert router.refit is not None and router.refit.num_samples == 0  # not one refits the predictor's model
    assert router.scales is not None and router.scales.scale_of("decode-1-hhhh", "decode-1") == pytest.approx(1.0)
    (node,) = [n for n in router.live().nodes if n.node_id == "decode-1-hhhh"]
    assert node.step_error < 0.05  # its steps are priced with the model that fits them
    (reply,) = router.decide_many([DecisionRequest(1, 2000, 8)])
    if reply.decision.decode_node == "decode-1-hhhh":
        assert reply.decode_model == router.state.policy.model_of(views["decode-1-hhhh"])
