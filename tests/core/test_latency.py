import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kairos_ray.core import FEATURE_NAMES, StepLatencyModel, StepwiseLatency

from .strategies import OWN, SIMPLE, models


class Stepwise(StepwiseLatency):
    """The same linear model, but with the generic step-by-step run_s / safe_steps."""

    def __init__(self, model: StepLatencyModel) -> None:
        self.model = model

    def step_s(self, batch_size: int, kv_tokens: float, chunk_tokens: float, prefix_tokens: float = 0) -> float:
        return self.model.step_s(batch_size, kv_tokens, chunk_tokens, prefix_tokens)


def test_step_time_by_hand():
    # 0.01 + 0.001 * 10 + 100 * (1e-4 + 1e-7 * 1000)
    assert SIMPLE.step_s(10, 1000, 100) == pytest.approx(0.04)
    # chi = 0 leaves the pure decode step T0(B, K)
    assert SIMPLE.step_s(10, 1000, 0) == pytest.approx(0.02)


def test_own_prefix_step_time_by_hand():
    # 0.01 + 0.001 * 10 + 100 * (1e-4 + 1e-7 * 1000): the chunk pays for its own 1000-token prefix...
    assert OWN.step_s(10, 1000, 100, 1000) == pytest.approx(0.04)
    # ... and not for the other requests' KV
    assert OWN.step_s(10, 300_000, 100, 1000) == pytest.approx(0.04)
    assert OWN.step_s(10, 300_000, 100) == pytest.approx(0.03)


def test_every_feature_has_its_coefficient():
    model = StepLatencyModel(1.0, 2.0, 3.0, 5.0, 7.0, 11.0, 13.0, 17.0, 19.0)
    b, k, chi, p = 2, 3, 4, 6
    expected = 1 + 2 * b + 3 * k + 5 * chi + 7 * chi * k + 11 * chi * chi + 13 * chi * p + 17 * p + 19 * b * b
    assert model.step_s(b, k, chi, p) == expected
    assert model.step_s(b, k, 0, p) == 1 + 2 * b + 3 * k + 19 * b * b  # no chunk, no prefix to read
    assert list(FEATURE_NAMES) == ["1", "B", "K", "tiles(chi)", "chi*K", "chi^2", "chi*P", "P", "B^2"]
    assert model.coefficients.tolist() == [1, 2, 3, 5, 7, 11, 13, 17, 19]
    assert StepLatencyModel.from_coefficients(model.coefficients) == model
    tiled = StepLatencyModel.from_coefficients(model.coefficients, tile_tokens=8)
    # the 4-token chunk pays a whole 8-token tile in its linear layers, and only there
    assert tiled.step_s(b, k, chi, p) == expected + 5 * (8 - chi)


def test_crowding_and_tiles_by_hand():
    # T = 0.01 + 0.001 B + 1e-6 B^2 + 1e-4 tiles(chi), tiles of 128
    model = StepLatencyModel(0.01, 0.001, 0.0, 1e-4, 0.0, 0.0, c_batch_sq=1e-6, tile_tokens=128)
    assert model.step_s(100, 0, 0) == pytest.approx(0.01 + 0.1 + 0.01)
    assert model.step_s(0, 0, 128) == pytest.approx(0.01 + 0.0128)
    assert model.step_s(0, 0, 129) == pytest.approx(0.01 + 0.0256)  # a partial tile costs a whole one
    assert model.step_s(0, 0, 1) == model.step_s(0, 0, 128)
    # a run of 129-token chunks: every step pays 256 tokens, and the closed form agrees with the steps
    assert model.run_s(100, 0, 129, 3) == pytest.approx(3 * (0.12 + 0.0256))
    assert model.safe_steps(100, 0, 129, 5, 0.15) == 5
    assert model.safe_steps(100, 0, 129, 5, 0.145) == 0
    with pytest.raises(ValueError, match="tile_tokens"):
        StepLatencyModel(0.01, 0.0, 0.0, 0.0, 0.0, 0.0, tile_tokens=0)


def test_later_chunks_cost_more():
    assert SIMPLE.step_s(8, 4096, 512) > SIMPLE.step_s(8, 2048, 512) > SIMPLE.step_s(8, 0, 512)
    assert OWN.step_s(8, 4096, 512, 4096) > OWN.step_s(8, 2048, 512, 2048) > OWN.step_s(8, 0, 512, 0)


@given(
    models(),
    st.lists(
        st.tuples(st.integers(0, 256), st.integers(0, 10**6), st.integers(0, 4096), st.integers(0, 32_768)),
        min_size=1,
    ),
)
def test_vectorised_matches_scalar(model, rows):
    b, k, chi, p = (np.array(col) for col in zip(*rows, strict=True))
    expected = [model.step_s(*row) for row in rows]
    np.testing.assert_allclose(model.step_s_array(b, k, chi, p), expected, rtol=1e-12)


@given(models())
def test_json_round_trip(model):
    assert StepLatencyModel.from_json(model.to_json()) == model


def test_a_linear_v1_profile_loads_in_the_papers_form():
    """Profiles written before the own-prefix features: the chunk's context is the node's KV, no prefix terms."""
    v1 = {"model": "linear-v1", "c0": 0.01, "c_batch": 0.001, "c_kv": 0, "c_chunk": 1e-4, "c_chunk_kv": 1e-7}
    assert StepLatencyModel.from_json(json.dumps({**v1, "c_chunk_sq": 0})) == SIMPLE
    assert json.loads(SIMPLE.to_json())["model"] == "linear-v3"


def test_a_linear_v2_profile_loads_without_crowding_or_tiles():
    v2 = json.loads(OWN.to_json())
    for later in ("c_batch_sq", "tile_tokens"):
        del v2[later]
    assert StepLatencyModel.from_json(json.dumps({**v2, "model": "linear-v2"})) == OWN
    assert OWN.c_batch_sq == 0 and OWN.tile_tokens == 1


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"model": "other"}', "not a linear step-latency profile"),
        ('{"model": "linear-v1", "c0": 0.1}', "lacks coefficients: c_batch"),
        (
            '{"model": "linear-v2", "c0": 0.1, "c_batch": 0, "c_kv": 0, "c_chunk": 0, "c_chunk_kv": 0, '
            '"c_chunk_sq": 0}',
            "lacks coefficients: c_chunk_prefix, c_prefix",
        ),
        (
            '{"model": "linear-v1", "c0": "x", "c_batch": 0, "c_kv": 0, "c_chunk": 0, '
            '"c_chunk_kv": 0, "c_chunk_sq": 0}',
            "finite numbers: c0",
        ),
        (
            '{"model": "linear-v3", "c0": 0.1, "c_batch": 0, "c_kv": 0, "c_chunk": 0, "c_chunk_kv": 0, '
            '"c_chunk_sq": 0, "c_chunk_prefix": 0, "c_prefix": 0}',
            "lacks coefficients: c_batch_sq, tile_tokens",
        ),
        (
            '{"model": "linear-v3", "c0": 0.1, "c_batch": 0, "c_kv": 0, "c_chunk": 0, "c_chunk_kv": 0, '
            '"c_chunk_sq": 0, "c_chunk_prefix": 0, "c_prefix": 0, "c_batch_sq": 0, "tile_tokens": 1.5}',
            "tile_tokens must be an integer",
        ),
    ],
)
def test_bad_profile_json_is_named(text, message):
    with pytest.raises(ValueError, match=message):
        StepLatencyModel.from_json(text)


def test_load_names_the_file(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text("{")
    with pytest.raises(ValueError, match=r"profile\.json"):
        StepLatencyModel.load(path)


prefixes = st.integers(0, 32_768)


@given(models(), st.integers(0, 128), st.integers(0, 500_000), st.integers(1, 4096), st.integers(0, 200), prefixes)
def test_closed_form_run_equals_step_sum(model, batch_size, kv_tokens, chunk, steps, prefix):
    stepwise = Stepwise(model).run_s(batch_size, kv_tokens, chunk, steps, prefix)
    assert model.run_s(batch_size, kv_tokens, chunk, steps, prefix) == pytest.approx(stepwise, rel=1e-9, abs=1e-12)


@given(
    models(),
    st.integers(0, 128),
    st.integers(0, 500_000),
    st.integers(1, 4096),
    st.integers(0, 300),
    st.floats(0.001, 0.5),
    prefixes,
)
def test_closed_form_safe_steps_equals_stepwise_check(model, batch_size, kv_tokens, chunk, max_steps, budget, prefix):
    expected = Stepwise(model).safe_steps(batch_size, kv_tokens, chunk, max_steps, budget, prefix)
    assert model.safe_steps(batch_size, kv_tokens, chunk, max_steps, budget, prefix) == expected


def test_safe_steps_exact_at_the_boundary():
    # step j costs 0.01 + 100 * (1e-4 + 1e-7 * 100 j) = 0.02 + 0.001 j: steps 0..5 fit 0.025
    for model in (SIMPLE, OWN):
        assert model.safe_steps(0, 0, 100, 50, 0.025 + 1e-12) == 6
        assert model.safe_steps(0, 0, 100, 50, 0.0199) == 0
        assert model.safe_steps(0, 0, 100, 3, 1.0) == 3
    # a run that starts 1000 tokens into its prompt: step j costs 0.03 + 0.001 j
    assert OWN.safe_steps(0, 1000, 100, 50, 0.035 + 1e-12, prefix_tokens=1000) == 6
    assert OWN.run_s(0, 1000, 100, 3, prefix_tokens=1000) == pytest.approx(0.03 + 0.031 + 0.032)


def test_safe_steps_when_kv_makes_no_difference():
    flat = StepLatencyModel(0.01, 0.0, 0.0, 1e-5, 0.0, 0.0)
    assert flat.safe_steps(0, 0, 100, 10**6, 0.02) == 10**6
    assert math.isclose(flat.run_s(0, 0, 100, 4), 4 * 0.011)
