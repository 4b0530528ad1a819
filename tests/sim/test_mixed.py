"""Mixed fleets in the simulator: node groups, and the comparison of `python -m kairos_ray.sim.mixed`."""

import pytest

from kairos_ray.config import KairosConfig
from kairos_ray.sim import mixed
from kairos_ray.sim.admission import Source
from kairos_ray.sim.run import SimSetup, parse_groups


def test_a_pool_is_a_count_or_groups_of_profiles():
    assert parse_groups("3") == 3
    assert parse_groups("2:a100-deepseek-v2-lite, 1:h100-deepseek-v2-lite") == [
        (2, "a100-deepseek-v2-lite"),
        (1, "h100-deepseek-v2-lite"),
    ]
    assert parse_groups("2,1:h100-deepseek-v2-lite") == [(2, None), (1, "h100-deepseek-v2-lite")]
    for bad, says in (("0", "at least 1"), ("2:nope", "no profile file"), ("a:b", "N:PROFILE"), ("-1:x", "N:PROFILE")):
        with pytest.raises(ValueError, match=says):
            parse_groups(bad)


def test_a_setup_builds_each_group_from_its_own_profile():
    setup = SimSetup.from_config(KairosConfig(), None, 2, mixed.DECODE)
    assert (setup.num_prefill, setup.num_decode) == (2, 4)
    a100, h100 = setup.decode_groups
    assert a100.model is None and a100.truth is setup.truth  # the setup's own profile: the pool's model
    assert h100.model is not None and h100.model.c0 < setup.model.c0 and h100.truth is not setup.truth


def test_the_scan_stops_at_pds_saturation_and_counts_deflections_per_group():
    setup = SimSetup.from_config(KairosConfig(), mixed.A100, mixed.PREFILL, mixed.DECODE, seed=1)
    rows = mixed.sweep_workload(setup, Source("bursty", 300, 1), step=1.0)
    slo = setup.config.slo.ttft_s
    assert rows[-1].pd.p95_ttft_s > slo and all(r.pd.p95_ttft_s <= slo for r in rows[:-1])
    assert all(r.pd.deflections == (0, 0) for r in rows)
    assert all(sum(r.own.deflections) > 0 and r.own.deflections[1] > r.own.deflections[0] for r in rows)
