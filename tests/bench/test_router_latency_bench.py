"""``python -m kairos_ray.bench.router_latency`` against a real Router deployment, briefly."""

import re
import subprocess
import sys

import pytest

# ``make test`` runs it beside the vLLM app's modules: it starts a Ray of its own, and the other live layer took
# longer than the vLLM app layer
pytestmark = [pytest.mark.ray, pytest.mark.in_vllm_layer]


def test_router_latency_bench_prints_latency_and_ceilings():
    result = subprocess.run(
        [sys.executable, "-m", "kairos_ray.bench.router_latency", "--decisions", "8", "--rps", "20", "--seconds", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    latency = re.search(r"latency at 20 decisions/s, 8 decisions: p50 ([\d.]+) ms, p99 ([\d.]+) ms", result.stdout)
    assert latency and 0 < float(latency[1]) <= float(latency[2]), result.stdout
    floor = re.search(r"floor, .* at 20 calls/s: p50 ([\d.]+) ms, p99 ([\d.]+) ms", result.stdout)
    assert floor and 0 < float(floor[1]) <= float(floor[2]), result.stdout
    for calls in ("one decision per call", "16 decisions per call"):
        ceiling = re.search(rf"ceiling, {calls}, 32 callers: ([\d,]+) decisions/s", result.stdout)
        assert ceiling and int(ceiling[1].replace(",", "")) > 0, result.stdout
