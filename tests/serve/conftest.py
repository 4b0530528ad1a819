"""One real local Ray cluster with the two node-group resources, and a Kairos app on it, per module."""

import contextlib
import re
import time
from pathlib import Path

import httpx
import pytest
from ray import serve
from ray.serve._private.api import serve_start
from ray.serve.schema import ServeDeploySchema

from kairos_ray.bench import faults
from kairos_ray.bench.local import free_port, local_serve
from kairos_ray.core import block_ids
from kairos_ray.messages import Residue
from kairos_ray.serve import build_app

MODEL = "deepseek-v2-lite"


def app_args(**serving):
    """2P2D emulated app args; ``serving`` overrides the serving section."""
    pool = lambda resource: {  # noqa: E731
        "model_loading_config": {"model_id": MODEL},
        "engine": "emulated",
        "deployment_config": {"num_replicas": 2, "ray_actor_options": {"resources": {resource: 0.01}}},
    }
    return {
        "prefill_config": pool("prefill_node"),
        "decode_config": pool("decode_node"),
        "kairos": {"policy": {"name": "kairos"}},
        "serving": {"max_in_flight": 48, "refit_every_steps": 200, "expose_routing": True, **serving},
    }


@contextlib.contextmanager
def running_app(
    args: dict | None,
    model: str,
    ready_within_s: float,
    *,
    config: dict | None = None,
    dashboard_port: int | None = None,
    num_cpus: int = 2,
):
    """(base URL, metrics URL) of the app on a fresh local Ray; everything is shut down afterwards.

    The app is ``build_app(args)``, or the Serve config ``config`` deployed as ``serve run config.yaml`` does.
    With ``dashboard_port``, Ray's dashboard listens there on 127.0.0.1.
    """
    metrics_port = free_port()
    with local_serve(num_cpus=num_cpus, dashboard_port=dashboard_port, metrics_port=metrics_port) as url:
        if config is None:
            serve.run(build_app(args), name="kairos", route_prefix="/")
        else:
            serve_start().deploy_apps(ServeDeploySchema.model_validate(config))  # the running Serve's client
        deadline = time.monotonic() + ready_within_s
        while time.monotonic() < deadline:  # until every engine has reported to the router
            try:
                r = httpx.post(
                    f"{url}/v1/completions", json={"model": model, "prompt": "warm up", "max_tokens": 1}, timeout=30
                )
                if r.status_code == 200 and r.headers["x-kairos-fallback"] == "0":
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"the app did not come up within {ready_within_s} s")
        yield url, f"http://127.0.0.1:{metrics_port}/metrics"


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
    """The emulated 2P2D app: (base URL, metrics URL)."""
    with running_app(app_args(), MODEL, ready_within_s=120) as urls:
        yield urls
