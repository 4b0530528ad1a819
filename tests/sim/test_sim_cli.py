"""`kairos sim` as a user runs it."""

import csv

from kairos_ray.sim.run import COMPARED
from tests.test_cli import kairos

REQUIRED = {"policy", "rps", "p95_ttft_s", "p95_tbt_s", "tbt_violation_pct", "slo_attainment_pct", "deflections"}


def test_sim_writes_summary_records_and_plots(tmp_path):
    out = tmp_path / "out"
    result = kairos(
        "sim", "--workload", "bursty", "--rps", "2,8", "--policies", "pd,kairos,oracle", "--requests", "150",
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    with (out / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert REQUIRED | {"throughput_tok_s"} <= set(rows[0])
    assert [(r["policy"], float(r["rps"])) for r in rows] == [
        (p, rate) for rate in (2.0, 8.0) for p in ("pd", "kairos", "oracle")
    ]
    assert all(r["deflections"] == "0" for r in rows if r["policy"] == "pd")
    assert any(int(r["deflections"]) > 0 for r in rows if r["policy"] == "kairos")
    with (out / "requests.csv").open() as f:
        assert sum(1 for _ in csv.DictReader(f)) == 6 * 150
    for name in ("p95_ttft_vs_rps", "p95_tbt_vs_rps", "slo_attainment_vs_rps", "deflections_vs_rps", "ttft_breakdown"):
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"

    assert not (out / "kv_transfer_vs_rps.png").exists()  # no prefix identity: no cache figures


def test_sim_on_multiturn_reports_cache_hits_and_kv_sent(tmp_path):
    out = tmp_path / "out"
    result = kairos(
        "sim", "--workload", "multiturn", "--rps", "8", "--policies", "kairos+blind,kairos+prefix",
        "--requests", "300", "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    with (out / "summary.csv").open() as f:
        blind, aware = list(csv.DictReader(f))
    assert float(aware["deflect_hit_pct"]) > 50  # deflected to the node holding the conversation
    assert float(aware["kv_transfer_gb"]) < float(blind["kv_transfer_gb"])
    for name in ("prefill_hit_vs_rps", "deflect_hit_vs_rps", "kv_transfer_vs_rps"):
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_sim_replays_a_trace_at_its_own_rate(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(
        "arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{i * 0.5},{500 + i},{20}\n" for i in range(40))
    )
    out = tmp_path / "out"
    result = kairos("sim", "--trace", str(trace), "--policies", "kairos", "--out", str(out), "--no-plots")
    assert result.returncode == 0, result.stderr
    with (out / "summary.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert float(row["rps"]) == 2.0 and row["requests"] == "40"
    assert sorted(p.name for p in out.iterdir()) == ["requests.csv", "summary.csv"]  # --no-plots: no PNG


def test_sim_bad_input_is_a_message(tmp_path):
    for args, message in (
        (("--workload", "bursty", "--policies", "pd,magic"), "unknown policy 'magic'"),
        (("--workload", "bursty", "--rps", "2,-1"), "rates must be > 0"),
        (("--trace", str(tmp_path / "missing.csv")), "missing.csv"),
    ):
        result = kairos("sim", *args, "--out", str(tmp_path / "o"))
        assert result.returncode == 2, args
        assert message in result.stderr and "Traceback" not in result.stderr


def test_sim_and_live_summaries_print_side_by_side_with_their_ratio():
    from kairos_ray.sim.run import compare_rows

    sim = {key: 1.0 for _, key in COMPARED}
    live = {**sim, "p95_ttft_s": 1.5, "p95_tbt_s": 0.02, "deflections": 0}
    text = compare_rows(sim, live)
    lines = {line[:22].strip(): line.split() for line in text.splitlines()[1:]}
    assert lines["P95 TTFT s"][-1] == "1.50x" and lines["P95 TBT ms"][-3:] == ["1000.000", "20.000", "0.02x"]
    assert len(lines) == len(COMPARED)


def test_sim_runs_a_mixed_fleet_each_node_priced_with_its_own_model(tmp_path):
    decode = "1:a100-deepseek-v2-lite,1:h100-deepseek-v2-lite"
    deflected = {}
    for models in ("own", "pool"):
        out = tmp_path / models
        result = kairos(
            "sim", "--workload", "bursty", "--rps", "4", "--policies", "kairos", "--requests", "300",
            "--decode", decode, "--node-models", models, "--no-plots", "--out", str(out),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        with (out / "requests.csv").open() as f:
            rows = [r for r in csv.DictReader(f) if r["route"] == "deflect"]
        deflected[models] = {node: sum(r["decode_node"] == node for r in rows) for node in ("decode-0", "decode-1")}
    # priced with its own (H100) model, decode-1 is seen to prefill far faster: it takes most deflections
    assert deflected["own"]["decode-1"] > 2 * deflected["own"]["decode-0"]
    assert deflected["own"]["decode-1"] > deflected["pool"]["decode-1"]


def test_sim_names_a_bad_node_group():
    for value, says in (
        ("2:no-such-gpu", "no profile file 'no-such-gpu'"),
        ("0", "at least 1 node"),
        ("x:a", "N:PROFILE"),
    ):
        result = kairos("sim", "--decode", value, "--requests", "10")
        assert result.returncode == 2 and says in result.stderr and "Traceback" not in result.stderr


def test_sim_with_router_shards_prints_what_sharding_cost_against_one_router(tmp_path):
    out = tmp_path / "sharded"
    result = kairos(
        "sim", "--workload", "bursty", "--rps", "2,6", "--policies", "kairos", "--requests", "200", "--decode", "4",
        "--router-shards", "2", "--no-plots", "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    table = result.stdout.split("2 router shards against one router (the same runs):\n")[1].splitlines()
    rows = [line.split() for line in table[1:3]]
    assert [row[:2] for row in rows] == [["kairos", "2.00"], ["kairos", "6.00"]]
    with (out / "summary.csv").open() as f:
        summary = list(csv.DictReader(f))
    for row, printed in zip(summary, rows, strict=True):  # the sharded runs' figures, and the share they missed
        assert row["router_shards"] == "2" and printed[3] == f"{float(row['p95_ttft_s']):.2f}s"
        assert printed[-1] == f"{float(row['shard_kept_pct']):.2f}%" and 0 <= float(row["shard_kept_pct"]) <= 100
    result = kairos("sim", "--workload", "bursty", "--decode", "4", "--router-shards", "5", "--requests", "10")
    assert result.returncode == 2 and "more shards than the 4 decode nodes" in result.stderr
    assert "Traceback" not in result.stderr
