"""The prefix-caching table of ``python -m kairos_ray.sim.report``."""

from kairos_ray.sim.report import cache_table, main

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


def test_report_prints_a_cache_table_per_multiturn_cluster(tmp_path, capsys):
    for name, rps in (("multiturn", "12"), ("multiturn-1p3d", "20")):
        (tmp_path / name).mkdir()
        row = ",".join({**ROW, "rps": rps}.values())
        (tmp_path / name / "summary.csv").write_text(",".join(ROW) + "\n" + row + "\n")
    assert main([str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert text.index("### multiturn\n") < text.index("| 12 | pd+blind") < text.index("### multiturn-1p3d\n")
    assert text.index("### multiturn-1p3d\n") < text.index("| 20 | pd+blind")
    assert "| workload" not in text  # no paper workload: no Table 3
