import math

import pytest
import yaml

from kairos_ray.config import ConfigError, KairosConfig, load_config, parse_config, resolve_profile
from kairos_ray.core import AdmissionMode, AdmissionParams, PolicyParams, Route, Thresholds
from kairos_ray.scenarios import burst_view
from tests.test_cli import kairos


def test_defaults_are_the_cores_and_build_the_kairos_policy():
    config = KairosConfig()
    # a KV transfer's 0.1 s setup on the profile's 2 GB/s link is 6,430 tokens of 31,104 bytes
    expected = PolicyParams(handoff_setup_tokens=6430, handoff_tokens_per_s=2e9 / 31_104)
    assert config.policy_params() == expected and config.thresholds() == Thresholds()
    assert config.slo.tbt_s == 0.07 and config.slo.ttft_s == 4.0
    policy = config.build_policy()
    assert policy.spec == "kairos" and policy.guards_chunks and policy.chunk_guard() is not None
    # a burst has queued 19 K tokens on the prefill nodes: a short prompt goes to the light decode node
    decision = policy.decide(1000, burst_view())
    assert decision.route is Route.DEFLECT and decision.decode_node == "decode-0"
    assert sum(decision.chunk_schedule) == 1000
    assert config.build_policy("pd").decide(1000, burst_view()).route is Route.PREFILL


def test_the_oracle_needs_the_ground_truth_and_static_baselines_guard_nothing():
    config = KairosConfig()
    with pytest.raises(ValueError, match="ground truth: the simulator only"):
        config.build_policy("oracle")
    model = config.predictor.load()
    oracle = config.build_policy("oracle", truth=model)
    assert oracle.spec == "oracle" and oracle.guards_chunks
    assert config.build_policy("sl:512").chunk_guard() is None


def test_params_carry_the_config_through():
    params = parse_config(
        {"slo": {"tbt_s": 0.05}, "policy": {"alpha": 1.5, "beta": 0.8, "chunk_candidates": [512, 128]}}
    ).policy_params()
    assert params.tbt_budget_s == pytest.approx(0.04)
    assert params.alpha == 1.5 and params.chunk_candidates == (512, 128)
    assert parse_config({"policy": {"handoff_setup_tokens": 0}}).policy_params().handoff_setup_tokens == 0


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"slo": {"ttft_s": -1}}, "slo.ttft_s = -1: Input should be greater than 0"),
        ({"slo": {"tbt_s": 0}}, "slo.tbt_s = 0: Input should be greater than 0"),
        ({"policy": {"alpha": 0.5}}, "policy.alpha = 0.5: Input should be greater than or equal to 1"),
        ({"policy": {"beta": 0}}, "policy.beta = 0: Input should be greater than 0"),
        ({"policy": {"beta": 1.5}}, "policy.beta = 1.5: Input should be less than or equal to 1"),
        ({"policy": {"chunk_candidates": []}}, "policy.chunk_candidates = []: chunk_candidates must not be empty"),
        (
            {"policy": {"chunk_candidates": [256, 512]}},
            "policy.chunk_candidates = [256, 512]: chunk_candidates must be strictly decreasing, got [256, 512]",
        ),
        ({"policy": {"chunk_candidates": [512, 0]}}, "chunk_candidates must all be >= 1, got [512, 0]"),
        ({"policy": {"name": "fastest"}}, "policy.name = 'fastest': unknown policy 'fastest'"),
        ({"policy": {"name": "sq:0"}}, "policy.name = 'sq:0': policy sq: threshold must be >= 1, got 0"),
        ({"policy": {"prefill_estimator": "guess"}}, "policy.prefill_estimator = 'guess'"),
        ({"prefill_chunk_tokens": 0}, "prefill_chunk_tokens = 0"),
        ({"predictor": {"profile": "no-such-gpu"}}, "predictor.profile = 'no-such-gpu': no profile file"),
        ({"polciy": {}}, "polciy: unknown field"),
        ({"slo": {"ttft_ms": 4000}}, "slo.ttft_ms: unknown field"),
        ({"admission": {"mode": True}}, "admission.mode = True: Input should be 'off' or 'shed'"),
        ({"admission": {"mode": "drop"}}, "admission.mode = 'drop'"),
        ({"admission": {"slack": 0}}, "admission.slack = 0: Input should be greater than 0"),
        ({"admission": {"priority_reserve": 1}}, "admission.priority_reserve = 1: Input should be less than 1"),
        ({"admission": {"kv_wait_max_s": 0}}, "admission.kv_wait_max_s = 0"),
        ({"admission": {"retry_after_min_s": 9, "retry_after_max_s": 5}}, "must not exceed retry_after_max_s (5.0)"),
        ({"admission": {"drop": True}}, "admission.drop: unknown field"),
    ],
)
def test_invalid_values_name_the_field_and_the_value(data, expected):
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert expected in str(info.value)


def test_yaml_file_round_trip_and_errors(tmp_path):
    good = tmp_path / "kairos.yaml"
    good.write_text("slo:\n  tbt_s: 0.05\npolicy:\n  name: sl:2048\n")
    config = load_config(good)
    assert config.slo.tbt_s == 0.05 and config.build_policy().spec == "sl:2048"

    bad = tmp_path / "bad.yaml"
    bad.write_text("policy:\n  alpha: 0.2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\npolicy.alpha = 0.2"):
        load_config(bad)

    not_a_mapping = tmp_path / "list.yaml"
    not_a_mapping.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(not_a_mapping)


def test_admission_is_off_by_default_and_a_bare_yaml_off_reads_as_off(tmp_path):
    assert KairosConfig().policy_params().admission == AdmissionParams()  # the paper's behaviour
    path = tmp_path / "kairos.yaml"
    path.write_text("slo:\n  ttft_s: 2.5\nadmission:\n  mode: off\n")  # YAML reads a bare off as false
    assert load_config(path).admission.mode is AdmissionMode.OFF
    path.write_text("slo:\n  ttft_s: 2.5\nadmission:\n  mode: shed\n  slack: 0.8\n  never_shed_priorities: [-1, 0]\n")
    params = load_config(path).policy_params().admission
    assert params.on and params.ttft_slo_s == 2.5 and params.slack == 0.8
    assert params.never_shed_priorities == frozenset({-1, 0})
    assert params.threshold_s(0) == math.inf and params.threshold_s(1) == pytest.approx(2.5 * 0.8 * 0.75)


def test_config_show_prints_the_admission_section_and_reads_back():
    result = kairos("config", "show")
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["admission"]["mode"] == "off" and shown["admission"]["slack"] == AdmissionParams().slack
    assert parse_config(shown) == KairosConfig()


def test_profiles_resolve_by_name_or_path(tmp_path):
    shipped = resolve_profile("a100-deepseek-v2-lite")
    assert shipped.is_file()
    copy = tmp_path / "mine.json"
    copy.write_text(shipped.read_text())
    assert resolve_profile(str(copy)) == copy
    config = parse_config({"predictor": {"profile": str(copy)}})
    assert config.predictor.load() == parse_config({}).predictor.load()
    with pytest.raises(ConfigError, match=r"predictor\.prefill_profile: unknown field"):
        parse_config({"predictor": {"prefill_profile": "a100-deepseek-v2-lite"}})


def test_a_serve_config_gives_its_apps_kairos_section(tmp_path):
    serve_config = tmp_path / "app.yaml"
    serve_config.write_text(
        "applications:\n  - name: a\n    args:\n      kairos: {slo: {tbt_s: 0.05}, policy: {name: pd}}\n"
    )
    config = load_config(serve_config)
    assert config.slo.tbt_s == 0.05 and config.policy.name == "pd"
    serve_config.write_text("applications:\n  - name: a\n    args: {}\n")
    with pytest.raises(ConfigError, match="no application that has a kairos section"):
        load_config(serve_config)
