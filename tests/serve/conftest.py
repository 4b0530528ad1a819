"""A Kairos app per module on one real local Ray (the two node-group resources), shared by the modules."""

import contextlib
import re
import time
from pathlib import Path

import httpx
import pytest
import yaml
from ray import serve
from ray.serve._private.api import serve_start
from ray.serve.schema import ServeDeploySchema

from kairos_ray.bench import faults
from kairos_ray.core import block_ids
from kairos_ray.messages import Residue
from kairos_ray.serve import build_app
from tests import shared_ray

MODEL = "deepseek-v2-lite"  # the emulated apps'
CPU_MODEL = "tiny-llama"  # the vLLM CPU apps' (the shipped random-weight model)
TOOL_CALLING = {"enable_auto_tool_choice": True, "tool_call_parser": "pythonic"}  # 2p2d-cpu.yaml's decode pool
CPU_CONTEXT = 1024  # the vLLM CPU app's context: a request without max_tokens, which runs to its end, ends soon
CONFIGS = Path(__file__).resolve().parents[2] / "serve_configs"


def args_of(name: str) -> dict:
    """The app arguments of a shipped Serve config."""
    (app,) = yaml.safe_load((CONFIGS / name).read_text())["applications"]
    assert app["import_path"] == "kairos_ray.serve:build_app"
    return app["args"]


def app_args(kairos=None, **serving):
    """2P2D emulated app args; ``kairos`` (the Kairos configuration) and ``serving`` override their sections."""
    pool = lambda resource: {  # noqa: E731
        "model_loading_config": {"model_id": MODEL},
        "engine": "emulated",
        "deployment_config": {"num_replicas": 2, "ray_actor_options": {"resources": {resource: 0.01}}},
    }
    return {
        "prefill_config": pool("prefill_node"),
        "decode_config": pool("decode_node"),
        "kairos": kairos or {"policy": {"name": "kairos"}},
        "serving": {"max_in_flight": 48, "refit_every_steps": 200, "expose_routing": True, **serving},
    }


@contextlib.contextmanager
def running_app(args: dict | None, model: str, ready_within_s: float, *, config: dict | None = None):
    """(base URL, metrics URL) of the app on the session's shared Ray (``tests/shared_ray.py``), deleted afterwards
    with every other app the module deployed there.

    The app is ``build_app(args)``, or the Serve config ``config`` deployed as ``serve run config.yaml`` does
    (Serve then takes no app deployed the other way: the shared cluster is stopped after it).
    """
    cluster = shared_ray.start()
    try:
        if config is None:
            serve.run(build_app(args), name="kairos", route_prefix="/")
        else:
            serve_start().deploy_apps(ServeDeploySchema.model_validate(config))  # the running Serve's client
        deadline = time.monotonic() + ready_within_s
        while time.monotonic() < deadline:  # until every engine has reported to the router
            try:
                r = httpx.post(
                    f"{cluster.url}/v1/completions",
                    json={"model": model, "prompt": "warm up", "max_tokens": 1},
                    timeout=30,
                )
                if r.status_code == 200 and r.headers["x-kairos-fallback"] == "0":
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"the app did not come up within {ready_within_s} s")
        yield cluster.url, cluster.metrics_url
    finally:
        if config is None:
            for name in list(serve.status().applications):
                serve.delete(name)
        else:
            shared_ray.stop()


def cpu_args() -> dict:
    """``serve_configs/2p2d-cpu.yaml`` on one prefill node and its two decode nodes, a 1,024-token context."""
    args = args_of("2p2d-cpu.yaml")
    # cache-blind, until a module asks for another policy (use_policy): tests that send the same prompts again need
    # their routes fixed, where a prefix-aware policy would deflect a repeated long prompt to the node holding it
    args["kairos"]["policy"]["name"] = "sl:400+blind"
    args["kairos"]["policy"]["static_chunk_tokens"] = 128  # deflections run in several chunks
    # four CPU engines sharing two cores run several times slower than their profile says, and the online refit
    # learns it: admission would then shed these tests' requests, which test routes (admission: the emulated app)
    args["kairos"]["admission"] = {"mode": "off"}
    # a stopped engine core shows within seconds; a busy one on two shared cores can miss a few of its steps
    args["serving"]["engine_stall_timeout_s"] = 15.0
    args["serving"]["context_tokens"] = CPU_CONTEXT
    args["prefill_config"]["deployment_config"]["num_replicas"] = 1
    for pool in ("prefill_config", "decode_config"):
        args[pool]["engine_kwargs"] = {**args[pool]["engine_kwargs"], "max_model_len": CPU_CONTEXT}
    return args


@pytest.fixture(scope="package")
def cpu_app():
    """The vLLM CPU app (``cpu_args``), started once for every module of real vLLM engines (each engine takes tens
    of seconds to start on two cores): (base URL, metrics URL). A module that decides with another policy than
    ``sl:400+blind`` sets it (``use_policy``)."""
    with running_app(cpu_args(), CPU_MODEL, ready_within_s=420) as urls:
        yield urls


def use_policy(spec: str, app_name: str = "kairos") -> str:
    """Make the running app's router decide with the policy ``spec`` names; the spec before."""
    before: str = serve.get_deployment_handle("Router", app_name=app_name).use_policy.remote(spec).result(timeout_s=60)
    return before


def wait_for_prefix(node: str, prompt: list[int], block_tokens: int, tokens: int, within_s: float = 30) -> None:
    """Wait until the router's mirror of ``node``'s prefix cache holds ``tokens`` leading tokens of ``prompt``."""
    router = serve.get_deployment_handle("Router", app_name="kairos")
    ids = {block_tokens: block_ids(prompt, block_tokens)}
    deadline, hits = time.monotonic() + within_s, {}
    while time.monotonic() < deadline:
        hits = router.prefix_hits.remote(ids, len(prompt)).result()
        if hits.get(node, 0) >= tokens:
            return
        time.sleep(0.2)
    pytest.fail(f"the router's mirrors hold {hits} tokens of the prompt, not {tokens} on {node}")


def wait_for_no_residue(within_s: float = 90.0, app_name: str = "kairos") -> list[Residue]:
    """Every process's residue once none holds anything per request (fails naming what is left)."""
    deadline = time.monotonic() + within_s
    while True:
        found = faults.residues(app_name)
        if all(r.idle for r in found):
            return found
        if time.monotonic() > deadline:
            pytest.fail("per-request state left once idle: " + "; ".join(map(str, found)))
        time.sleep(0.5)


DASHBOARD = Path(__file__).resolve().parents[2] / "cluster" / "grafana" / "kairos-dashboard.json"


def dashboard_series(prefix: str) -> list[str]:
    """The series the Grafana dashboard queries whose names start with ``prefix`` (ray_kairos_, ray_vllm_)."""
    return sorted(set(re.findall(rf"{prefix}\w+", DASHBOARD.read_text())))


def wait_for_series(metrics_url: str, names: list[str], within_s: float = 90) -> str:
    """The metrics page once it shows every series of ``names`` (fails naming the missing ones)."""
    deadline, missing = time.monotonic() + within_s, names
    while time.monotonic() < deadline:
        text = httpx.get(metrics_url, timeout=10).text
        missing = [m for m in names if m not in text]
        if not missing:
            return text
        time.sleep(2)
    pytest.fail(f"not on {metrics_url}: {missing}")


@pytest.fixture(scope="module")
def live_app():
    """The emulated 2P2D app, admission on as the shipped configs have it: (base URL, metrics URL)."""
    kairos = {"policy": {"name": "kairos"}, "admission": {"mode": "shed"}}
    with running_app(app_args(kairos), MODEL, ready_within_s=120) as urls:
        yield urls
