import json

import pytest

from kairos_ray.config import resolve_profile
from kairos_ray.core import StepLatencyModel
from kairos_ray.emulation import ClusterHardware, GroundTruth

SHIPPED = resolve_profile("a100-deepseek-v2-lite")


def test_shipped_profile_meets_the_papers_statements():
    model = StepLatencyModel.load(SHIPPED)
    added = lambda b, k, chi: model.step_s(b, k, chi) - model.step_s(b, k, 0)  # noqa: E731
    # chunks up to 512 tokens add at most ~30 ms to a decode step (across batch sizes, KV up to 150K)
    assert max(added(b, k, 512) for b in (1, 64, 256) for k in (0, 50_000, 150_000)) <= 0.035
    # 2048-token chunks add up to ~250 ms by the fifth chunk
    assert 0.15 <= added(128, 300_000 + 4 * 2048, 2048) <= 0.26


def test_ground_truth_departs_from_the_predictor():
    model = StepLatencyModel.load(SHIPPED)
    truth = GroundTruth(model, ClusterHardware.from_profile(SHIPPED))
    assert truth.step_s(0, 0, 128) == pytest.approx(model.step_s(0, 0, 128))  # a whole tile
    assert truth.step_s(0, 0, 129) > model.step_s(0, 0, 129) + 100 * model.c_chunk  # a padded tile
    assert truth.step_s(200, 0, 0) > model.step_s(200, 0, 0)  # batch crowding


def test_transfer_time_and_profile_errors(tmp_path):
    hw = ClusterHardware(kv_bytes_per_token=1000, kv_link_gbytes_per_s=1.0, kv_link_setup_s=0.5)
    assert hw.transfer_s(1_000_000) == pytest.approx(1.5)
    data = json.loads(SHIPPED.read_text())
    data["cluster"]["kv_link_bandwidth"] = 5
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown cluster field"):
        ClusterHardware.from_profile(bad)
    data["cluster"].pop("kv_link_bandwidth")
    data["cluster"]["max_batch_size"] = 0
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="max_batch_size must be > 0"):
        ClusterHardware.from_profile(bad)
