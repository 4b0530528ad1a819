"""One real local Ray cluster with the two node-group resources, and a Kairos app on it, per module."""

import contextlib
import socket
import time

import httpx
import pytest
import ray
from ray import serve

from kairos_ray.serve import build_app

MODEL = "deepseek-v2-lite"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        "serving": {"max_in_flight": 48, "refit_every_steps": 200, **serving},
    }


@contextlib.contextmanager
def running_app(args: dict, model: str, ready_within_s: float):
    """(base URL, metrics URL) of the app ``args`` on a fresh local Ray; everything is shut down afterwards."""
    http_port, metrics_port = free_port(), free_port()
    ray.init(
        address="local",  # a Ray of its own, even where `ray start` runs another on this machine
        num_cpus=2,
        resources={"prefill_node": 2, "decode_node": 2},
        include_dashboard=False,
        _metrics_export_port=metrics_port,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        serve.run(build_app(args), name="kairos", route_prefix="/")
        url = f"http://127.0.0.1:{http_port}"
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
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def live_app():
    """The emulated 2P2D app: (base URL, metrics URL)."""
    with running_app(app_args(), MODEL, ready_within_s=120) as urls:
        yield urls
