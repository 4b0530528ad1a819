"""The prefix-caching table of ``python -m kairos_ray.sim.report``."""

from kairos_ray.sim.report import cache_table

ROW = {
    "rps": "12",
    "policy": "pd+blind",
    "p95_ttft_s": "4.70777",
    "tbt_violation_pct": "0",
    "slo_attainment_pct": "89.9",
    "deflections": "0",
    "prefill_hit_pct": "60.2368",
    "deflect_hit_pct": "nan",
    "kv_transfer_gb": "77.9582",
}


def test_cache_table_rows_by_hand():
    header, rule, row = cache_table([ROW])
    assert header.startswith("| req/s | policy | P95 TTFT (s)") and rule.count("|") == header.count("|")
    assert row == "| 12 | pd+blind | 4.71 | 0.00 | 89.9 | 0 | 60.2 | - | 78.0 |"
