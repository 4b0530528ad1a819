"""The `kairos` console command: its arguments, answers and exit statuses, as a user would see them."""

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kairos_ray.cli import main
from kairos_ray.core import StepLatencyModel

KAIROS = Path(sys.executable).parent / "kairos"


def kairos(*args: str) -> subprocess.CompletedProcess[str]:
    """``kairos ARGS`` as the console script runs it (``cli.main``), in this process: what it printed and its exit
    status (an interpreter's start per call would cost more than most commands; ``kairos_process`` runs the
    installed script itself)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's answer to bad arguments and to --help
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return subprocess.CompletedProcess(["kairos", *args], code, out.getvalue(), err.getvalue())


def kairos_process(*args: str) -> subprocess.CompletedProcess[str]:
    """``kairos ARGS`` run by the installed console script, in a process of its own."""
    return subprocess.run([str(KAIROS), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("run", [kairos, kairos_process])
def test_help_lists_the_commands(run):
    result = run("--help")
    assert result.returncode == 0
    for command in ("demo", "config", "fit", "top"):
        assert re.search(rf"^\s+{command}\s", result.stdout, re.M), command


def test_the_parser_is_built_without_ray_or_vllm():
    """``kairos --help`` and every command's arguments answer at once: the tools that need Ray or vLLM import
    them when they run, not when the parser lists them."""
    probe = "import sys; from kairos_ray.cli import build_parser; build_parser(); print(sorted(m for m in " \
        "('ray', 'vllm', 'torch', 'sklearn') if m in sys.modules))"  # fmt: skip
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_demo_prints_one_decision_per_request():
    result = kairos("demo", "--requests", "6", "--seed", "3")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if re.match(r"^\s*\d+\s+\d+\s+(prefill|deflect)\s", line)]
    assert len(rows) == 6
    assert "of 6 requests deflected" in result.stdout


def test_demo_under_pd_deflects_nothing():
    result = kairos("demo", "--policy", "pd")
    assert result.returncode == 0, result.stderr
    assert "0 of 12 requests deflected" in result.stdout
    assert " deflect " not in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (("demo", "--policy", "fastest"), "unknown policy 'fastest'"),
        (("demo", "--requests", "0"), "must be >= 1, got 0"),
        (("config", "check", "no-such-file.yaml"), "no-such-file.yaml"),
        (("top", "--once", "--url", "http://127.0.0.1:9"), "cannot read http://127.0.0.1:9/kairos/state"),
        (("top", "--interval", "0"), "must be > 0, got 0"),
    ],
)
def test_bad_input_is_a_message_not_a_traceback(args, message):
    result = kairos(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_config_show_round_trips_through_check(tmp_path):
    shown = kairos("config", "show")
    assert shown.returncode == 0
    path = tmp_path / "kairos.yaml"
    path.write_text(shown.stdout)
    assert kairos("config", "check", str(path)).stdout.strip().endswith(": ok")
    path.write_text(shown.stdout.replace("alpha: 1.2", "alpha: 0.3"))
    bad = kairos("config", "check", str(path))
    assert bad.returncode == 2
    assert "policy.alpha = 0.3" in bad.stderr


def test_fit_writes_a_loadable_profile(tmp_path):
    table = tmp_path / "steps.csv"
    lines = ["batch_size,kv_tokens,chunk_tokens,step_s"]
    for b in (1, 16, 64):
        for k in (0, 50_000, 200_000):
            for chi in (0, 256, 1024):
                lines.append(f"{b},{k},{chi},{0.02 + 1e-4 * b + 1e-8 * k + 3e-5 * chi}")
    table.write_text("\n".join(lines) + "\n")
    out = tmp_path / "profile.json"
    result = kairos("fit", str(table), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert "held-out MAPE" in result.stdout
    assert json.loads(out.read_text())["c_chunk"] == pytest.approx(3e-5, rel=1e-4)
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"  # predicted against measured
    demo = kairos("demo", "--requests", "2", "--config", str(_config_with_profile(tmp_path, out)))
    assert demo.returncode == 0, demo.stderr


def test_fit_with_tiles_prices_a_partial_tile_as_a_whole_one(tmp_path):
    table = tmp_path / "steps.csv"
    lines = ["batch_size,kv_tokens,chunk_tokens,step_s"]
    for b in (1, 16, 64, 128):
        for chi in (0, 100, 129, 256, 700, 1000):
            lines.append(f"{b},0,{chi},{0.02 + 1e-4 * b + 3e-5 * -(-chi // 128) * 128}")  # 128-token tiles
    table.write_text("\n".join(lines) + "\n")
    out = tmp_path / "profile.json"
    result = kairos("fit", str(table), "-o", str(out), "--tile-tokens", "128")
    assert result.returncode == 0, result.stderr
    model = StepLatencyModel.load(out)
    assert model.tile_tokens == 128 and model.c_chunk == pytest.approx(3e-5, rel=1e-4)
    assert model.step_s(1, 0, 129) == pytest.approx(0.02 + 1e-4 + 3e-5 * 256, rel=1e-4)


def _config_with_profile(tmp_path: Path, profile: Path) -> Path:
    path = tmp_path / "with-profile.yaml"
    path.write_text(f"predictor:\n  profile: {profile}\n")
    return path
