from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kairos_ray.config import SLOConfig
from kairos_ray.metrics import RequestRecord, gap_stats, record_rows, summarize

SLO = SLOConfig(ttft_s=1.0, tbt_s=0.05)


def record(i, ttft, gaps, route="prefill", output=None, finish=10.0):
    gaps = np.array(gaps, dtype=float)
    return RequestRecord(
        request_id=i,
        arrival_s=0.0,
        prompt_tokens=100,
        output_tokens=output or len(gaps) + 1,
        route=route,
        prefill_node="prefill-0" if route == "prefill" else "",
        decode_node="decode-0",
        ttft_s=ttft,
        prefill_queue_s=ttft / 4,
        prefill_exec_s=ttft / 4,
        kv_transfer_s=ttft / 4,
        decode_queue_s=ttft / 4,
        finish_s=finish,
        tbt_gaps_s=gaps,
    )


def test_per_request_attainment_allows_five_percent_of_gaps_over():
    ok = record(0, 0.5, [0.01] * 19 + [0.09])  # 1 of 20 gaps over: exactly 5 %
    late = record(1, 1.5, [0.01])
    jittery = record(2, 0.5, [0.01] * 18 + [0.09, 0.09])  # 2 of 20: 10 %
    single = record(3, 0.9, [])
    assert ok.attains(SLO) and single.attains(SLO)
    assert not late.attains(SLO) and not jittery.attains(SLO)


def test_summary_by_hand():
    records = [
        record(0, 0.2, [0.01, 0.02, 0.03]),
        record(1, 0.4, [0.06], route="deflect"),
        record(2, 2.0, [], finish=5.0),
    ]
    row = summarize(records, SLO, "kairos", 3.0, prefill_util=0.5, decode_util=0.25)
    assert row["requests"] == 3 and row["deflections"] == 1
    assert row["p50_ttft_s"] == pytest.approx(0.4)
    assert row["p95_ttft_s"] == pytest.approx(np.percentile([0.2, 0.4, 2.0], 95))
    assert row["tbt_violation_pct"] == pytest.approx(25.0)  # 1 of 4 gaps over 50 ms
    assert row["slo_attainment_pct"] == pytest.approx(100 / 3)  # only the first attains
    assert row["throughput_tok_s"] == pytest.approx((4 + 2 + 1) / 10.0)
    assert row["p95_kv_transfer_s"] == pytest.approx(np.percentile([0.05, 0.1, 0.5], 95))
    assert (row["prefill_util_pct"], row["decode_util_pct"]) == (50.0, 25.0)
    assert row["slo_met"] is False


def test_shed_requests_count_as_offered_and_missed_and_nowhere_else():
    shed = replace(
        record(2, float("nan"), [], route="shed", finish=float("nan")), prefill_node="", decode_node="", shed_reason="x"
    )
    records = [
        record(0, 0.2, [0.01]),
        record(1, 2.0, [0.01], route="deflect"),
        replace(shed, would_attain=True),
        replace(shed, request_id=3, would_attain=False),
        replace(shed, request_id=4),
    ]
    row = summarize(records, SLO, "kairos", 5.0, admission="shed")
    assert row["admission"] == "shed" and row["requests"] == 5 and row["deflections"] == 1
    assert row["goodput_rps"] == pytest.approx(5.0 * 1 / 5)  # one of five offered attains
    assert row["shed_pct"] == pytest.approx(60.0)
    assert row["slo_attainment_pct"] == pytest.approx(20.0)
    assert row["admitted_slo_attainment_pct"] == pytest.approx(50.0)
    assert row["p50_ttft_s"] == pytest.approx(1.1)  # the admitted requests' TTFTs only
    assert row["throughput_tok_s"] == pytest.approx(4 / 10.0)
    assert (row["shed_probed"], row["shed_would_attain_pct"]) == (2, 50.0)
    rows = record_rows(records, SLO, "kairos", 5.0)
    assert (rows[2]["route"], rows[2]["shed_reason"], rows[2]["would_attain"], rows[2]["attains_slo"]) == (
        "shed",
        "x",
        True,
        False,
    )
    assert rows[4]["would_attain"] == "" and rows[0]["shed_reason"] == ""


def test_goodput_counts_failed_requests_as_offered():
    row = summarize([record(0, 0.2, [0.01])], SLO, "live", 2.0, failed=1)
    assert row["goodput_rps"] == pytest.approx(1.0) and row["shed_pct"] == 0.0
    assert np.isnan(row["shed_would_attain_pct"]) and row["shed_probed"] == 0


def test_record_rows_carry_every_column():
    (row,) = record_rows([record(0, 0.2, [0.01, 0.03])], SLO, "pd", 2.0)
    assert row["num_tbt_gaps"] == 2 and row["max_tbt_s"] == pytest.approx(0.03)
    assert row["attains_slo"] is True and row["route"] == "prefill"


def test_cache_hits_per_route_and_kv_sent_by_hand():
    records = [
        replace(record(0, 0.2, [0.01]), cached_tokens=50, kv_transfer_bytes=2_000_000_000),  # 50 of 100 cached
        replace(record(1, 0.2, [0.01]), cached_tokens=0, kv_transfer_bytes=1_000_000_000),
        replace(record(2, 0.2, [0.01], route="deflect"), cached_tokens=90, kv_transfer_bytes=0),
    ]
    row = summarize(records, SLO, "kairos+prefix", 3.0)
    assert (row["prefill_hit_pct"], row["deflect_hit_pct"], row["kv_transfer_gb"]) == (25.0, 90.0, 3.0)
    (first, *_) = record_rows(records, SLO, "kairos+prefix", 3.0)
    assert (first["cached_tokens"], first["kv_transfer_bytes"]) == (50, 2_000_000_000)


def test_cache_figures_are_unknown_where_the_records_do_not_say():
    row = summarize([record(0, 0.2, [0.01])], SLO, "live", 1.0)
    assert all(np.isnan(row[c]) for c in ("prefill_hit_pct", "deflect_hit_pct", "kv_transfer_gb"))
    assert record_rows([record(0, 0.2, [0.01])], SLO, "live", 1.0)[0]["cached_tokens"] == ""


@given(st.lists(st.lists(st.floats(0.0, 0.2), max_size=30), max_size=20), st.floats(0.0, 2.0))
def test_vectorised_gap_stats_equal_the_per_request_numbers(gap_lists, ttft):
    records = [record(i, ttft, gaps) for i, gaps in enumerate(gap_lists)]
    stats = gap_stats(records, SLO)
    for r, n, p95, top, attains in zip(records, stats.num_gaps, stats.p95_s, stats.max_s, stats.attains, strict=True):
        gaps = r.tbt_gaps_s
        assert n == len(gaps)
        if len(gaps):
            assert p95 == pytest.approx(np.percentile(gaps, 95), rel=1e-9, abs=1e-12)  # seconds: a ps is nothing
            assert top == gaps.max()
        else:
            assert np.isnan(p95) and np.isnan(top)
        over = np.count_nonzero(gaps > SLO.tbt_s)
        assert attains == (r.ttft_s <= SLO.ttft_s and over <= 0.05 * len(gaps))
