import json
from dataclasses import replace

import pytest

from kairos_ray.config import resolve_profile
from kairos_ray.core import PolicyParams, StepLatencyModel, tbt_safe_schedule
from kairos_ray.core.policy import chunk_guard
from kairos_ray.emulation import ClusterHardware, GroundTruth

SHIPPED = resolve_profile("a100-deepseek-v2-lite")


def test_shipped_profile_meets_the_papers_statements():
    model = StepLatencyModel.load(SHIPPED)

    def added(b, k, chi, prefix):  # the i-th chunk of one request: its prefix is resident KV too
        return model.step_s(b, k + prefix, chi, prefix) - model.step_s(b, k, 0)

    # chunks up to 512 tokens add at most ~30 ms to a decode step, whatever the batch and the node's KV
    fifth = 4 * 512
    assert max(added(b, k, 512, fifth) for b in (1, 64, 256) for k in (0, 50_000, 300_000)) <= 0.030
    # 2048-token chunks add up to ~250 ms by the fifth chunk
    assert 0.15 <= added(128, 300_000, 2048, 4 * 2048) <= 0.26
    # a request's own context makes its later chunks slower (the roofline: 34.7 -> 59.9 ms for 1024)
    assert added(0, 0, 1024, 4 * 1024) - added(0, 0, 1024, 0) == pytest.approx(0.025, abs=0.002)


def test_a_32k_prompt_on_an_idle_node_gets_a_shrinking_schedule():
    model = StepLatencyModel.load(SHIPPED)
    candidates = PolicyParams().chunk_candidates
    at_70ms = tbt_safe_schedule(model, 0, 0, 32_768, candidates, 0.9 * 0.07)
    assert at_70ms is not None and len(set(at_70ms)) >= 2 and 2048 not in at_70ms
    assert at_70ms[:4] == (1024, 1024, 1024, 512)  # the fourth 1024 would take 67.7 ms > 63 ms
    # a 2048-token chunk fits from tau = 100 ms (its first step: 14 + 75.7 ms), then the schedule shrinks
    at_100ms = tbt_safe_schedule(model, 0, 0, 32_768, candidates, 0.9 * 0.1)
    assert at_100ms is not None and at_100ms[:2] == (2048, 1024)


def test_ground_truth_has_tiles_and_crowding_and_the_shipped_predictor_knows_them():
    model = StepLatencyModel.load(SHIPPED)
    hardware = ClusterHardware.from_profile(SHIPPED)
    truth = GroundTruth(model, hardware)
    linear = replace(model, c_batch_sq=0.0, tile_tokens=1)  # the profile before: Eq. 4 linear in B and chi
    assert truth.step_s(0, 0, 128) == pytest.approx(linear.step_s(0, 0, 128))  # a whole tile
    assert truth.step_s(0, 0, 129) > linear.step_s(0, 0, 129) + 100 * model.c_chunk  # a padded tile
    assert truth.step_s(200, 0, 0) > linear.step_s(200, 0, 0)  # batch crowding
    # the shipped predictor describes this hardware: crowding c_batch / batch_crowding, the same tiles
    assert model.c_batch_sq == pytest.approx(model.c_batch / hardware.batch_crowding)
    assert model.tile_tokens == hardware.tile_tokens
    for step in [(0, 0, 129, 0), (200, 0, 0, 0), (125, 600_000, 129, 6000), (64, 300_000, 1000, 3000)]:
        assert truth.step_s(*step) == pytest.approx(model.step_s(*step))


def test_a_deflected_chunk_the_linear_model_let_through_is_now_priced_over_the_budget():
    """A loaded step: a 129-token suffix chunk, 6,000 tokens of cached history, on a decode node with 119
    requests and 600K KV tokens. In ms:

        c0 14 + c_batch * B 26.775 + c_kv * K 13.332 + chi^2 0.0501 + chi * P 4.6641
        + c_chunk * chi: 129 tokens 3.9693 (linear), 256 tokens 7.8771 (two tiles)
        + c_batch_sq * B^2: 0 (linear), 6.2231 (crowding)
    """
    model = StepLatencyModel.load(SHIPPED)
    linear = replace(model, c_batch_sq=0.0, tile_tokens=1)
    params = PolicyParams()
    assert params.tbt_budget_s == pytest.approx(0.063)  # beta * tau
    step = (119, 600_000, 129, 6000)
    assert linear.step_s(*step) == pytest.approx(0.0627906, abs=1e-6)  # within the budget: the guard let it run
    assert model.step_s(*step) == pytest.approx(0.0729215, abs=1e-6)  # over it
    truth = GroundTruth(model, ClusterHardware.from_profile(SHIPPED))
    assert truth.step_s(*step) == pytest.approx(model.step_s(*step))  # what the simulated engine takes
    assert chunk_guard(linear, params)(*step) == 129
    # 64 tokens would still take 14 + 26.775 + 6.2231 + 13.332 + 3.9386 + 0.0123 + 2.3140 = 66.6 ms: nothing fits
    assert chunk_guard(model, params)(*step) == 0
    # with 100 requests (crowding 4.3945) the decode part is 54.2265 ms; the planned 129 tokens pay two tiles,
    # 54.2265 + 7.8771 + 0.0501 + 4.6641 = 66.8 ms, one token fewer pays one: 54.2265 + 3.9386 + 0.0494 + 4.6280
    assert model.step_s(100, 600_000, 129, 6000) == pytest.approx(0.0668179, abs=1e-6)
    assert model.step_s(100, 600_000, 128, 6000) == pytest.approx(0.0628424, abs=1e-6)
    assert chunk_guard(model, params)(100, 600_000, 129, 6000) == 128
    assert chunk_guard(linear, params)(100, 600_000, 129, 6000) == 129


def test_ground_truth_prices_a_chunk_by_its_own_prefix_whatever_the_predictors_form():
    """A profile in the paper's form prices a chunk by all resident KV; the simulated engine does not."""
    paper = StepLatencyModel(0.02, 0.0, 0.0, 1e-5, 1e-9, 0.0)
    truth = GroundTruth(paper, ClusterHardware(tile_tokens=1))
    # 512 tokens 1000 tokens into their prompt, on a node holding 300K other KV tokens: 1e-9 x 512 x 1000, not 301K
    assert truth.step_s(0, 301_000, 512, 1000) == pytest.approx(0.02 + 512 * (1e-5 + 1e-9 * 1000))
    assert paper.step_s(0, 301_000, 512, 1000) == pytest.approx(0.02 + 512 * (1e-5 + 1e-9 * 301_000))


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
