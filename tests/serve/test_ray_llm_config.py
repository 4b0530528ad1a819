"""A Ray Serve LLM prefill/decode config, as Ray's documentation writes it, served by changing ``import_path`` alone.

``configs/ray_pd_nixl.yaml`` has the shape of Ray's "Prefill/decode disaggregation"
guide: a prefill and a decode ``LLMConfig``, vLLM's NixlConnector moving the KV, Serve
autoscaling per pool, ``import_path: ray.serve.llm:build_pd_openai_app``. With only
``import_path`` changed it validates and builds as it is. To serve it on this 2-core CPU
machine, the test changes what the machine forces, and nothing else:

- the weights: ``model_source: tiny-llama`` (the shipped random-weight model; no
  download, no GPU) and vLLM's CPU arguments for it in ``engine_kwargs`` (``load_format:
  dummy``, float32, eager, a 4096-token context, a 256 MB KV cache); the served
  ``model_id`` stays the documented one;
- NIXL on a CPU: ``kv_transfer_config.kv_buffer_device: cpu``;
- CPU bundles: ``accelerator_config: {kind: cpu}`` (Ray Serve LLM's default accelerator is a GPU);
- fewer nodes: autoscaling between 1 and 2 replicas per pool instead of 2-4 and 6-10
  (an engine takes about 3 GB here; with Ray Serve LLM's default target each pool stays at 1);
- ``serving.expose_routing``, off by default, on: the test reads each request's route in its headers.
"""

import copy
import re
import time
from pathlib import Path

import openai
import pytest
import yaml
from ray import serve
from ray.llm._internal.serve.serving_patterns.prefill_decode.builder import PDServingArgs
from transformers import AutoTokenizer

from kairos_ray.messages import Role
from kairos_ray.serve import build_app, pool_options
from kairos_ray.serve.args import AppArgs
from tests.engines.tiny import TINY_KWARGS

from .conftest import dashboard_series, running_app, wait_for_series

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.own_ray]  # a config deployed: the shared Ray stops after

CONFIG = Path(__file__).parent / "configs" / "ray_pd_nixl.yaml"
RAY_BUILDER = "ray.serve.llm:build_pd_openai_app"
KAIROS_BUILDER = "kairos_ray.serve:build_app"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the documented model_id, served here by the tiny model
APP = "pd-disaggregation-nixl"


def switched() -> dict:
    """The documented Serve config with ``import_path`` changed, and nothing else."""
    config = yaml.safe_load(CONFIG.read_text())
    (app,) = config["applications"]
    assert app["import_path"] == RAY_BUILDER
    app["import_path"] = KAIROS_BUILDER
    return config


def test_the_documented_config_validates_and_builds_with_only_import_path_changed():
    (app,) = switched()["applications"]
    PDServingArgs.model_validate(copy.deepcopy(app["args"]))  # Ray Serve LLM's own P/D model takes it too
    args = AppArgs.model_validate(app["args"])
    for role, pool, low, high in ((Role.PREFILL, args.prefill_config, 2, 4), (Role.DECODE, args.decode_config, 6, 10)):
        assert pool.engine == "vllm" and pool.kv_connector == "NixlConnector"
        options = pool_options(role, pool, args.kairos)
        assert options["autoscaling_config"]["min_replicas"] == low
        assert options["autoscaling_config"]["max_replicas"] == high
        assert options["placement_group_bundles"] == [{"GPU": 1}]  # Ray Serve LLM's default: a GPU per worker
    assert build_app(args) is not None


def on_this_cpu(config: dict) -> dict:
    """What this CPU machine forces on the documented config (the module docstring lists it)."""
    (app,) = config["applications"]
    for pool in (app["args"]["prefill_config"], app["args"]["decode_config"]):
        pool["model_loading_config"]["model_source"] = "tiny-llama"
        pool["engine_kwargs"].update(TINY_KWARGS)
        pool["engine_kwargs"]["kv_transfer_config"]["kv_buffer_device"] = "cpu"
        pool["accelerator_config"] = {"kind": "cpu"}
        pool["deployment_config"]["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 2}
    app["args"]["serving"] = {"expose_routing": True}
    return config


@pytest.fixture(scope="module")
def ray_pd_app():
    pytest.importorskip("nixl", reason="the documented config moves KV with vLLM's NixlConnector (pip install nixl)")
    with running_app(None, MODEL, ready_within_s=600, config=on_this_cpu(switched())) as urls:
        yield urls


def test_the_documented_config_serves_on_vllm_cpu_engines(ray_pd_app):
    url, _ = ray_pd_app
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300)
    (app,) = on_this_cpu(switched())["applications"]
    source = AppArgs.model_validate(app["args"]).decode_config.model_loading_config.tokenizer
    tokenizer = AutoTokenizer.from_pretrained(source)
    routes = set()
    for words in (20, 400):
        prompt = " ".join(["seven wise owls count stars"] * (words // 5))
        response = client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True}
        )
        completion = response.parse()
        assert completion.usage.completion_tokens == 6
        assert completion.usage.prompt_tokens == len(tokenizer.encode(prompt))  # tokenized as vLLM's model does
        route = response.headers["x-kairos-route"]
        routes.add(route)
        if route == "prefill":  # the KV travelled over the documented connector
            assert response.headers["x-kairos-kv-transport"] == "NixlConnector"
    assert "prefill" in routes and routes <= {"prefill", "deflect"}  # idle nodes disaggregate (alpha 1.2): via NIXL
    messages = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 4


def test_every_vllm_node_exports_the_dashboards_vllm_series(ray_pd_app):
    _, metrics_url = ray_pd_app
    queried = dashboard_series("ray_vllm_")
    assert len(queried) >= 6
    text = wait_for_series(metrics_url, queried)
    router = serve.get_deployment_handle("Router", app_name=APP)
    nodes = router.snapshot.remote().result()
    assert {n.split("-")[0] for n in nodes} == {"prefill", "decode"}
    deadline = time.monotonic() + 60
    while True:  # every node's own replica id labels its engine's series
        replicas = set(re.findall(r'^ray_vllm_num_requests_running\{[^}]*ReplicaId="([^"]+)"', text, re.M))
        if {n.split("-", 1)[1] for n in nodes} <= replicas or time.monotonic() > deadline:
            break
        time.sleep(2)
        text = wait_for_series(metrics_url, queried)
    assert {n.split("-", 1)[1] for n in nodes} <= replicas
