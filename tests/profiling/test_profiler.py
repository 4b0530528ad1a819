"""`kairos profile` on a real vLLM CPU engine with the tiny model, then `kairos fit` on what it measured."""

import csv
import json

import pytest

from kairos_ray.core import StepLatencyModel
from tests.test_cli import kairos_process

pytestmark = pytest.mark.vllm


def test_profile_measures_the_grid_and_fits(tmp_path):
    steps, profile = tmp_path / "steps.csv", tmp_path / "profile.json"
    result = kairos_process(
        "profile", "--batch-sizes", "1,4", "--contexts", "64,256", "--chunks", "0,64,256", "--prefixes", "0,128",
        "--repeats", "2", "--engine-arg", "seed=1", "-o", str(steps), "--fit", str(profile),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    with steps.open() as f:
        rows = list(csv.DictReader(f))
    # one row per grid point: batch sizes x contexts x (a decode step + chunks x prefixes)
    assert len(rows) == 2 * 2 * (1 + 2 * 2)
    points = {(int(r["batch_size"]), int(r["chunk_tokens"]), int(r["prefix_tokens"])) for r in rows}
    # a chunk's prefix of 0 is given one token, so that its request's admission is not timed
    assert points == {(b, 0, 0) for b in (1, 4)} | {(b, c, p) for b in (1, 4) for c in (64, 256) for p in (1, 128)}
    for r in rows:  # resident KV: the contexts plus the tokens generated so far, plus the chunk's own prefix
        context = ((int(r["kv_tokens"]) - int(r["prefix_tokens"])) // int(r["batch_size"])) // 64 * 64
        assert context in (64, 256) and float(r["step_s"]) > 0
    model = StepLatencyModel.from_json(profile.read_text())
    assert model.step_s(4, 1000, 256, 128) > 0
    assert "held-out MAPE" in result.stdout and json.loads(profile.read_text())["model"] == "linear-v3"
    assert profile.with_suffix(".png").exists()


def test_shipped_cpu_profile_loads_and_chunks_cost_time():
    from kairos_ray.config import resolve_profile

    model = StepLatencyModel.load(resolve_profile("cpu-tiny-llama"))
    assert model.step_s(4, 2000, 512) > model.step_s(4, 2000, 0) > 0
