"""The shipped Serve configs validate; the router's state keeping, without Serve."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from kairos_ray.config import KairosConfig
from kairos_ray.core import Route
from kairos_ray.serve import build_app
from kairos_ray.serve.args import AppArgs
from kairos_ray.serve.router import MissingState, RouterState

CONFIGS = Path(__file__).resolve().parents[2] / "serve_configs"


def args_of(name: str) -> dict:
    (app,) = yaml.safe_load((CONFIGS / name).read_text())["applications"]
    assert app["import_path"] == "kairos_ray.serve:build_app"
    return app["args"]


@pytest.mark.parametrize(
    "name, nodes", [("2p2d-emulated.yaml", 2), ("2p2d-cpu.yaml", 2), ("2p2d.yaml", 2), ("1p1d.yaml", 1)]
)
def test_shipped_configs_validate(name, nodes):
    args = AppArgs.model_validate(args_of(name))
    assert args.prefill_config.deployment_config.num_replicas == nodes
    assert args.decode_config.deployment_config.num_replicas == nodes
    assert args.prefill_config.deployment_config.ray_actor_options["resources"] == {"prefill_node": 1}
    assert args.decode_config.deployment_config.ray_actor_options["resources"] == {"decode_node": 1}


@pytest.mark.parametrize("name", ["2p2d.yaml", "1p1d.yaml"])
def test_production_configs_name_a100_nodes_and_build(name):
    args = AppArgs.model_validate(args_of(name))
    for pool in (args.prefill_config, args.decode_config):
        assert pool.engine == "vllm" and pool.accelerator_type == "A100"
        assert pool.engine_kwargs["tensor_parallel_size"] == 8
        assert pool.deployment_config.ray_actor_options["num_gpus"] == 8
    assert build_app(args) is not None  # the application graph builds; its replicas need the GPU nodes


def test_cpu_config_runs_the_shipped_tiny_model():
    args = AppArgs.model_validate(args_of("2p2d-cpu.yaml"))
    source = Path(args.decode_config.model_loading_config.source)
    assert (source / "config.json").is_file() and (source / "tokenizer.json").is_file()
    assert args.kairos.predictor.profile == "cpu-tiny-llama"


def test_pools_must_share_engine_and_model():
    args = args_of("2p2d-cpu.yaml")
    args["prefill_config"]["model_loading_config"] = {"model_id": "other"}
    with pytest.raises(ValidationError, match="one model"):
        AppArgs.model_validate(args)
    args = args_of("2p2d-emulated.yaml")
    args["decode_config"]["engine"] = "vllm"
    with pytest.raises(ValidationError, match="differ"):
        AppArgs.model_validate(args)


def test_the_kv_channel_is_for_vllm_engines_and_known_backends():
    emulated = args_of("2p2d-emulated.yaml")
    for knob, value in (("kv_channel", "gloo"), ("kv_hold_blocks", True)):
        with pytest.raises(ValidationError, match=f"{knob} is for vLLM engines' KV"):
            AppArgs.model_validate({**emulated, "serving": {knob: value}})
    cpu = args_of("2p2d-cpu.yaml")
    with pytest.raises(ValidationError, match="kv_channel"):
        AppArgs.model_validate({**cpu, "serving": {**cpu["serving"], "kv_channel": "mpi"}})
    assert AppArgs.model_validate(cpu).serving.kv_channel == "gloo"


def test_unknown_args_are_rejected():
    args = args_of("2p2d-emulated.yaml")
    args["decode_config"]["replicas"] = 3
    with pytest.raises(ValidationError, match="replicas"):
        AppArgs.model_validate(args)


def prefill_state(node, queued, accepted=()):
    return {"node_id": node, "role": "prefill", "queued": queued, "head_prefilled": 0, "accepted": list(accepted)}


def decode_state(node, batch=0, accepted=()):
    return {
        "node_id": node,
        "role": "decode",
        "batch_size": batch,
        "kv_tokens": 0,
        "free_kv_tokens": 1_000_000,
        "committed": [],
        "accepted": list(accepted),
    }


def fresh_router(ttl=2.0):
    return RouterState(KairosConfig().build_policy("pd"), pending_ttl_s=ttl, node_timeout_s=5.0)


def test_router_needs_both_pools_before_deciding():
    router = fresh_router()
    router.report(prefill_state("p0", []), now=0.0)
    with pytest.raises(MissingState, match="1 prefill and 0 decode"):
        router.decide(1, 100, now=0.1)
    with pytest.raises(ValueError, match="unknown role"):
        router.report({"node_id": "x", "role": "cook"}, now=0.1)


def test_nodes_join_by_reporting_and_leave_when_silent():
    router = fresh_router()
    router.report(prefill_state("p0", [100]), now=0.0)
    router.report(prefill_state("p1", []), now=0.0)
    router.report(decode_state("d0"), now=0.0)
    assert router.decide(1, 500, now=1.0)[0].prefill_node == "p1"  # the idle one
    for t in (3.0, 6.0):  # p1 falls silent
        router.report(prefill_state("p0", [100]), now=t)
        router.report(decode_state("d0"), now=t)
    view, _ = router.view(now=6.5)
    assert [n.node_id for n in view.prefill] == ["p0"]
    assert router.decide(2, 500, now=6.5)[0].prefill_node == "p0"


def test_ledger_shows_undelivered_decisions_until_acknowledged_or_expired():
    router = fresh_router()
    router.report(prefill_state("p0", []), now=0.0)
    router.report(decode_state("d0"), now=0.0)
    decision, staleness = router.decide(1, 500, now=0.5)
    assert decision.route is Route.PREFILL and staleness == pytest.approx(0.5)
    view, _ = router.view(now=0.6)
    assert view.prefill[0].queued_prompt_tokens == (500,)  # the engine has not said it has it yet
    router.report(prefill_state("p0", [500], accepted=[1]), now=0.7)
    router.report(decode_state("d0"), now=0.7)
    view, _ = router.view(now=0.8)
    assert view.prefill[0].queued_prompt_tokens == (500,)  # now from the engine, not twice
    router.decide(2, 300, now=1.0)
    router.report(prefill_state("p0", [500]), now=3.5)
    router.report(decode_state("d0"), now=3.5)
    view, _ = router.view(now=3.6)  # never acknowledged: dropped after the TTL
    assert view.prefill[0].queued_prompt_tokens == (500,)
