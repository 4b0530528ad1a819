import json
import subprocess
import sys


def test_decision_bench_prints_the_json_report():
    result = subprocess.run(
        [sys.executable, "-m", "kairos_ray.bench.decision", "--decode-nodes", "8", "--decisions", "200", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(result.stdout)
    assert report["decode_nodes"] == 8
    assert 0 < report["p50_us"] <= report["p99_us"]
    assert report["decisions_per_s"] > 0
    assert 0 < report["deflected_pct"] < 100  # realistic views give both outcomes


def test_decision_bench_rejects_bad_counts():
    result = subprocess.run(
        [sys.executable, "-m", "kairos_ray.bench.decision", "--decode-nodes", "0"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "--decode-nodes must be >= 1" in result.stderr


def test_decision_bench_times_a_mixed_fleet_in_process():
    from kairos_ray.bench.decision import run

    one, mixed = (run(32, decisions=100, repeats=1, mixed=m) for m in (None, "h100-deepseek-v2-lite"))
    assert (one["mixed"], mixed["mixed"]) == ("", "h100-deepseek-v2-lite")
    assert mixed["deflected_pct"] != one["deflected_pct"]  # the same views, half the nodes priced faster
