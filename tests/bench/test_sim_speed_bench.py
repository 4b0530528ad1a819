import json
import subprocess
import sys


def test_sim_speed_bench_reports_each_size(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{i * 0.2},{800},{30}\n" for i in range(200)))
    result = subprocess.run(
        [sys.executable, "-m", "kairos_ray.bench.sim_speed", "--trace", str(trace), "--sizes", "2,4", "--repeats", "1",
         "--command", "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    *rows, command = [json.loads(line) for line in result.stdout.splitlines()]
    assert command["command"] == "kairos sim --trace t.csv --policies kairos" and command["wall_s"] > 0
    assert [r["cluster"] for r in rows] == ["2P2D", "4P4D"]
    assert rows[1]["rps"] == 2 * rows[0]["rps"]
    assert all(r["requests"] == 200 and r["events"] > 200 and r["wall_s"] > 0 for r in rows)
