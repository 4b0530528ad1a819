"""The shipped Serve configs validate, and bad app arguments fail with a message naming the field."""

from pathlib import Path

import pytest
import ray
import yaml
from pydantic import ValidationError
from ray.llm._internal.serve.constants import DEFAULT_MAX_TARGET_ONGOING_REQUESTS

from kairos_ray.core import AdmissionMode
from kairos_ray.messages import NodeId, Role
from kairos_ray.serve import REQUEST_TIMEOUT_S, build_app, pool_options
from kairos_ray.serve.app import INGRESS_ENV, ingress_options
from kairos_ray.serve.args import AppArgs
from kairos_ray.serve.delivery import replica_of

from .conftest import CONFIGS, args_of


@pytest.mark.parametrize(
    "name, nodes",
    [("2p2d-emulated.yaml", 2), ("2p2d-cpu.yaml", 2), ("2p2d.yaml", 2), ("2p2d-h100.yaml", 2), ("1p1d.yaml", 1)],
)
def test_shipped_configs_validate(name, nodes):
    args = AppArgs.model_validate(args_of(name))
    assert args.prefill_config.deployment_config.num_replicas == nodes
    assert args.decode_config.deployment_config.num_replicas == nodes
    assert args.prefill_config.deployment_config.ray_actor_options["resources"] == {"prefill_node": 1}
    assert args.decode_config.deployment_config.ray_actor_options["resources"] == {"decode_node": 1}


@pytest.mark.parametrize(
    "name, exposed",
    [
        ("2p2d-emulated.yaml", True),
        ("2p2d-cpu.yaml", True),
        ("2p2d.yaml", False),
        ("2p2d-h100.yaml", False),
        ("2p2d-mixed.yaml", False),
        ("1p1d.yaml", False),
    ],
)
def test_shipped_configs_bound_every_request_and_show_routes_only_locally(name, exposed):
    config = yaml.safe_load((CONFIGS / name).read_text())
    assert config["http_options"]["request_timeout_s"] == REQUEST_TIMEOUT_S
    args = AppArgs.model_validate(args_of(name))
    serving = args.serving
    assert serving.expose_routing is exposed and serving.require_api_key is not exposed
    assert args.kairos.admission.mode is AdmissionMode.SHED  # past capacity, a fast 429 rather than a queue


@pytest.mark.parametrize(
    "name, accelerator, profile",
    [
        ("2p2d.yaml", "A100", "a100-deepseek-v2-lite"),
        ("1p1d.yaml", "A100", "a100-deepseek-v2-lite"),
        ("2p2d-h100.yaml", "H100", "h100-deepseek-v2-lite"),
    ],
)
def test_production_configs_name_their_gpus_and_profile_and_build(name, accelerator, profile):
    args = AppArgs.model_validate(args_of(name))
    assert args.kairos.predictor.profile == profile
    for pool in (args.prefill_config, args.decode_config):
        assert pool.engine == "vllm" and pool.accelerator_type == accelerator
        assert pool.engine_kwargs["tensor_parallel_size"] == 8
        placement = pool.placement()  # as Ray Serve LLM places it: a GPU bundle per tensor-parallel worker
        assert placement.gpu and placement.strategy == "STRICT_PACK" and len(placement.bundles) == 8
        assert all(b["GPU"] == 1 and b[f"accelerator_type:{accelerator}"] > 0 for b in placement.bundles)
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


def test_the_mixed_config_is_a_decode_pool_of_two_node_groups_each_with_its_deployment_and_profile():
    args = AppArgs.model_validate(args_of("2p2d-mixed.yaml"))
    a100, h100 = args.groups(Role.DECODE)
    assert (a100.accelerator_type, a100.profile, h100.accelerator_type) == ("A100", None, "H100")
    assert h100.profile == "h100-deepseek-v2-lite" and args.kairos.predictor.profile == "a100-deepseek-v2-lite"
    assert [pool_options(Role.DECODE, pool, args.kairos, i)["name"] for i, pool in enumerate((a100, h100))] == [
        "decode",
        "decode-1",
    ]
    assert len(args.groups(Role.PREFILL)) == 1
    assert build_app(args) is not None  # a deployment per group; the replicas need the GPU nodes


def test_node_groups_must_serve_one_model_one_way_under_names_of_their_own():
    args = args_of("2p2d-emulated.yaml")
    group = args["decode_config"]
    assert AppArgs.model_validate({**args, "decode_config": [group, {**group, "profile": "h100-deepseek-v2-lite"}]})
    cases = [
        ([], "at least 1"),
        ([group, {**group, "profile": "no-such-profile"}], "no profile file"),
        ([group, {**group, "model_loading_config": {"model_id": "other"}}], "one model"),
        ([group, {**group, "deployment_config": {"name": "decode"}}], "deployment names must differ"),
        ([group, {**group, "deployment_config": {"name": "Router"}}], "deployment names must differ"),
    ]
    for groups, message in cases:
        with pytest.raises(ValidationError, match=message):
            AppArgs.model_validate({**args, "decode_config": groups})
    with pytest.raises(ValidationError, match=r"prefill_config.engine \(emulated\) and decode_config\[1\].engine"):
        AppArgs.model_validate({**args, "decode_config": [group, {**group, "engine": "vllm"}]})


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


def test_omitting_engine_gives_vllm_engines_and_emulated_is_chosen_explicitly():
    args = args_of("2p2d-cpu.yaml")
    for pool in ("prefill_config", "decode_config"):
        del args[pool]["engine"]
    parsed = AppArgs.model_validate(args)
    assert parsed.prefill_config.engine == parsed.decode_config.engine == "vllm"
    emulated = args_of("2p2d-emulated.yaml")
    assert {emulated[p]["engine"] for p in ("prefill_config", "decode_config")} == {"emulated"}
    emulated["decode_config"]["engine_kwargs"] = {"max_model_len": 4096}
    with pytest.raises(ValidationError, match="engine_kwargs: for vLLM engines; this pool runs emulated engines"):
        AppArgs.model_validate(emulated)


def ray_llm_pool(**fields) -> dict:
    """A vLLM pool as a Ray Serve LLM LLMConfig writes it, on CPU bundles."""
    return {
        "model_loading_config": {"model_id": "tiny-llama", "model_source": "tiny-llama"},
        "accelerator_config": {"kind": "cpu"},
        **fields,
    }


def pools(**fields) -> dict:
    return {"prefill_config": ray_llm_pool(**fields), "decode_config": ray_llm_pool(**fields)}


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"lora_config": {"max_num_adapters_per_replica": 2}}, "lora_config: LoRA adapters are not served"),
        ({"server_cls": "ray.serve.llm:LLMServer"}, "server_cls: every pool runs Kairos's engine server"),
        ({"experimental_configs": {"num_ingress_replicas": 2}}, "experimental_configs: "),
        ({"deployment_config": {"request_router_config": {"request_router_class": "x:Y"}}}, "request_router_config"),
        ({"deployment_config": {"user_config": {"a": 1}}}, "user_config: the engine servers take no user_config"),
        ({"deployment_config": {"placement_group_bundles": [{"CPU": 1}]}}, "set the pool's placement_group_config"),
        ({"deployment_config": {"autoscaling_config": {"min_replicas": 1, "wrong": 2}}}, r"options \['wrong'\]"),
        ({"deployment_config": {"num_replicas": 2, "autoscaling_config": {"max_replicas": 2}}}, "not both"),
        ({"model_loading_config": {"model_id": "m", "model_source": {"bucket_uri": "s3://b/m"}}}, "cloud mirrors"),
        ({"engine_kwargs": {"model": "other"}}, "model comes from model_loading_config"),
        ({"engine_kwargs": {"disable_log_stats": True}}, "Kairos needs vLLM's per-step stats"),
        ({"engine_kwargs": {"response_role": "bot"}}, r"\['response_role'\]: arguments of vLLM's OpenAI server"),
        ({"engine_kwargs": {"no_such_argument": 1}}, "Unknown engine argument: no_such_argument"),
        ({"accelerator_type": "H999"}, "Unsupported accelerator type: H999"),
        ({"accelerator_type": "A100"}, "cannot be used with CPU-only configurations"),
        ({"accelerator_config": {"kind": "tpu"}}, "kind 'tpu': Kairos-Ray runs vLLM on GPUs or CPUs"),
        ({"llm_engine": "SGLang"}, "llm_engine"),
        ({"replicas": 2}, "replicas"),
    ],
)
def test_what_cannot_be_honoured_is_an_error_naming_it(fields, message):
    args = pools()
    args["decode_config"] = {**args["decode_config"], **fields}
    with pytest.raises(ValidationError, match=message):
        AppArgs.model_validate(args)
    with pytest.raises(ValidationError, match="ingress_cls_config: Kairos-Ray runs its own OpenAI ingress"):
        AppArgs.model_validate({**pools(), "ingress_cls_config": {"ingress_cls": "x:Y"}})


def test_gpu_bundles_run_vllm_workers_in_the_placement_group_on_the_replica_host():
    gpu = {
        "accelerator_config": {"kind": "gpu"},
        "placement_group_config": {"bundle_per_worker": {"GPU": 1}},
        "engine_kwargs": {"tensor_parallel_size": 2},
    }
    with pytest.raises(ValidationError, match=r"strategy PACK: .* must share it \(STRICT_PACK\)"):
        AppArgs.model_validate(pools(**gpu))
    gpu["placement_group_config"]["strategy"] = "STRICT_PACK"
    gpu["engine_kwargs"]["distributed_executor_backend"] = "mp"
    with pytest.raises(ValidationError, match="distributed_executor_backend 'mp': on GPUs"):
        AppArgs.model_validate(pools(**gpu))


def test_llm_config_fields_map_to_what_they_mean_in_ray_serve_llm():
    args = AppArgs.model_validate(
        {
            "prefill_config": ray_llm_pool(
                placement_group_config={"bundle_per_worker": {"CPU": 1}, "strategy": "SPREAD"},
                engine_kwargs={"tensor_parallel_size": 2},
                runtime_env={"env_vars": {"A": "1"}},
                deployment_config={
                    "name": "P",
                    "autoscaling_config": {"min_replicas": 1, "max_replicas": 3},
                    "ray_actor_options": {"num_cpus": 1, "resources": {"prefill_node": 1}, "runtime_env": {"pip": []}},
                    "health_check_period_s": 3,
                    "max_queued_requests": 16,
                },
            ),
            "decode_config": ray_llm_pool(
                log_engine_metrics=False, model_loading_config={"model_id": "tiny-llama", "tokenizer_source": "tok"}
            ),
        }
    )
    prefill = pool_options(Role.PREFILL, args.prefill_config, args.kairos)
    assert prefill["name"] == "P"
    # a bundle per tensor-parallel worker, the replica's own resources added to the first (Ray Serve LLM's rule)
    assert prefill["placement_group_bundles"] == [{"CPU": 2, "prefill_node": 1}, {"CPU": 1}]
    assert prefill["placement_group_strategy"] == "SPREAD"
    assert prefill["ray_actor_options"]["runtime_env"] == {"pip": [], "env_vars": {"A": "1"}}
    # Serve's request-based autoscaling, with Ray Serve LLM's default target
    assert prefill["autoscaling_config"]["max_replicas"] == 3
    assert prefill["autoscaling_config"]["target_ongoing_requests"] == DEFAULT_MAX_TARGET_ONGOING_REQUESTS
    assert "num_replicas" not in prefill
    assert prefill["health_check_period_s"] == 3 and prefill["max_queued_requests"] == 16
    decode = args.decode_config
    assert not decode.log_engine_metrics and args.prefill_config.log_engine_metrics  # on by default, as in Ray
    assert decode.vllm_engine_kwargs() == {"served_model_name": "tiny-llama", "tokenizer": "tok"}
    assert decode.model_loading_config.tokenizer == "tok"
    assert pool_options(Role.DECODE, decode, args.kairos)["num_replicas"] == 1


def test_the_serving_section_sets_the_routers_hand_off_ttl_and_refit():
    from kairos_ray.serve.router import RouterActor

    args = args_of("2p2d-emulated.yaml")
    args["serving"] = {"handoff_ttl_s": 7.5, "refit_every_steps": 40}
    app = AppArgs.model_validate(args)
    ray_before = ray.is_initialized()  # the whole suite's shared Ray may be up (tests/shared_ray.py)
    router = RouterActor(app.kairos, app.serving.router_options())
    assert router.state.handoff_ttl_s == 7.5 and router.refit is not None
    assert ray.is_initialized() == ray_before  # built outside an actor, it starts no Ray (later tests would join it)
    args["serving"] = {"handoff_ttl_s": 0}
    with pytest.raises(ValidationError, match=r"serving\.handoff_ttl_s"):
        AppArgs.model_validate(args)


def test_a_node_id_names_its_role_and_replica_and_nothing_else_reads_as_one():
    node = NodeId(Role.DECODE, "ab12cd34")
    assert str(node) == "decode-ab12cd34" and NodeId.parse(str(node)) == node
    second = NodeId(Role.DECODE, "ab12cd34", group=1)  # of the second decode group
    assert str(second) == "decode-1-ab12cd34" and NodeId.parse(str(second)) == second
    assert second.group_name == "decode-1" and node.group_name == "decode"
    for junk in ("Router", "decode-", "prefill-a-b", "gpu-ab12", "decode-0-ab12", "decode--ab12", "decode-1-", ""):
        with pytest.raises(ValueError, match="no node id"):
            NodeId.parse(junk)
    assert replica_of("decode-ab12cd34") == "ab12cd34" and replica_of("Router") == ""


def test_the_ingress_runs_with_malloc_arenas_capped_unless_its_options_say_otherwise():
    assert ingress_options({}) == {"ray_actor_options": {"num_cpus": 0, "runtime_env": {"env_vars": INGRESS_ENV}}}
    own = {"env_vars": {"MALLOC_ARENA_MAX": "4", "OTHER": "1"}, "pip": ["x"]}
    options = ingress_options({"num_replicas": 2, "ray_actor_options": {"num_cpus": 1, "runtime_env": own}})
    assert options == {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1, "runtime_env": own}}
    plain = ingress_options({"ray_actor_options": {"runtime_env": {"pip": ["x"]}}})["ray_actor_options"]
    assert plain["runtime_env"] == {"pip": ["x"], "env_vars": INGRESS_ENV}
