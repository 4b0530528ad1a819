"""The shipped Serve configs validate, and bad app arguments fail with a message naming the field."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from kairos_ray.serve import build_app
from kairos_ray.serve.args import AppArgs

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


def test_the_oracle_is_refused_on_live_engines():
    args = args_of("2p2d-emulated.yaml")
    args["kairos"]["policy"]["name"] = "oracle"
    with pytest.raises(ValidationError, match="the simulator only"):
        AppArgs.model_validate(args)


def test_engines_come_from_the_registry():
    args = args_of("2p2d-emulated.yaml")
    args["decode_config"]["engine"] = args["prefill_config"]["engine"] = "tgi"
    with pytest.raises(ValidationError, match="unknown engine; known: emulated, vllm"):
        AppArgs.model_validate(args)
