"""Ray's own tools and the live view on a running app.

One emulated app with Ray's dashboard on 127.0.0.1, as ``make run-emulated``
starts it (``scripts/run_local.sh`` gives ``ray start`` the same dashboard), serves
every test here. Its fleet is mixed: two prefill nodes, and two decode groups of a
node each, an A100 (the predictor's profile) and an H100 (a profile of its own,
``serve_configs/2p2d-mixed.yaml``'s shape). The tests: ``serve status``, ``ray list actors``, the dashboard's Serve page
rendered by headless Chromium, ``GET /kairos/state`` and ``kairos top`` (once, and
live under tmux). Tests run Ray without its token auth, as ``make run`` does.
"""

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
import yaml
from ray import serve

from kairos_ray.bench.serving_cost import cpu_s, router_calls, serving_processes
from kairos_ray.config import resolve_profile
from kairos_ray.core import StepLatencyModel
from kairos_ray.messages import LiveState, NodeId, Role
from tests import shared_ray

from .conftest import MODEL, app_args, running_app

pytestmark = pytest.mark.ray

BIN = Path(sys.executable).parent
DEPLOYMENTS = {"Ingress": 1, "Router": 1, "prefill": 2, "decode": 1, "decode-1": 1}  # name -> replicas
H100 = "h100-deepseek-v2-lite"


def mixed_args() -> dict:
    """``app_args`` with its decode pool as two groups of a node each: the A100 profile's, then an H100's."""
    args = app_args()
    a100 = {
        **args["decode_config"],
        "deployment_config": {"num_replicas": 1, "ray_actor_options": {"resources": {"decode_node": 0.01}}},
    }
    args["decode_config"] = [a100, {**a100, "profile": H100}]
    return args


CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser") if shutil.which(name)), None)


@pytest.fixture(scope="module")
def dashboard_app():
    """(app URL, dashboard URL) of the emulated app, with Ray's dashboard on."""
    with running_app(mixed_args(), MODEL, ready_within_s=180) as (url, _):
        yield url, shared_ray.start().dashboard_url


def tool(*args: str, timeout_s: float = 120) -> str:
    """A command of this environment's, asking the cluster its ``--address`` names (RAY_ADDRESS would win)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    result = subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=timeout_s, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_serve_status_reports_the_app_running_with_its_deployments(dashboard_app):
    _, dashboard = dashboard_app
    status = yaml.safe_load(tool("serve", "status", "--address", dashboard))
    app = status["applications"]["kairos"]
    assert app["status"] == "RUNNING"
    assert set(app["deployments"]) == set(DEPLOYMENTS)
    for name, replicas in DEPLOYMENTS.items():
        deployment = app["deployments"][name]
        assert deployment["status"] == "HEALTHY" and deployment["replica_states"] == {"RUNNING": replicas}, name


def test_ray_list_actors_shows_every_replica(dashboard_app):
    _, dashboard = dashboard_app
    actors = yaml.safe_load(
        tool("ray", "list", "actors", "--address", dashboard, "--filter", "state=ALIVE", "--format", "yaml")
    )
    classes = [actor["class_name"] for actor in actors]
    for name, replicas in DEPLOYMENTS.items():
        assert classes.count(f"ServeReplica:kairos:{name}") == replicas, name
    assert classes.count("RouterActor") == 1  # the Router replica's actor, which ingress and engines call


class _TableRows(HTMLParser):
    """The cell texts of every table row of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._row is not None and self._cell is not None:
            self._row.append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def rendered_rows(url: str, profile: Path) -> list[list[str]]:
    """The table rows of ``url`` once headless Chromium has run its scripts."""
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--virtual-time-budget=60000", "--dump-dom",
    ]  # fmt: skip
    result = subprocess.run([CHROMIUM, *flags, url], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    parser = _TableRows()
    parser.feed(result.stdout)
    return parser.rows


@pytest.mark.skipif(CHROMIUM is None, reason="needs headless Chromium (Debian package chromium; scripts/setup.sh)")
def test_the_dashboards_serve_page_lists_the_app_and_its_deployments(dashboard_app, tmp_path):
    _, dashboard = dashboard_app
    deadline = time.monotonic() + 300  # a loaded 2-core machine renders slowly
    while True:  # the page fetches the app's state after it loads: render it until the table shows
        rows = {row[1]: row[2:] for row in rendered_rows(f"{dashboard}/#/serve", tmp_path / "chromium") if len(row) > 4}
        if set(DEPLOYMENTS) <= set(rows) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert "kairos" in rows, f"the Serve page showed no row of the app: {rows}"
    assert rows["kairos"][0] == "RUNNING"
    for name, replicas in DEPLOYMENTS.items():
        status, _, shown_replicas = rows[name][:3]  # status, status message, replicas
        assert (status, shown_replicas) == ("HEALTHY", str(replicas)), name


def send_requests(url: str) -> None:
    for tokens in (300, 3000, 8000):
        body = {"model": MODEL, "prompt": list(range(tokens)), "max_tokens": 8}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
    # refused (counted as a bad request): an unknown model is a 404, as vLLM's server answers it
    assert httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=60).status_code == 404


def test_a_mixed_fleet_serves_on_both_decode_groups_each_priced_with_its_own_profile(dashboard_app):
    url, _ = dashboard_app
    body = {"model": MODEL, "prompt": list(range(2000)), "max_tokens": 4}
    groups: set[str] = set()
    with ThreadPoolExecutor(8) as pool:
        for _ in range(10):  # bursts until each group's node has served one (the first burst does, as a rule)
            replies = list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=120), range(8)))
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
            groups |= {NodeId.parse(r.headers["x-kairos-decode-node"]).group_name for r in replies}
            if groups == {"decode", "decode-1"}:
                break
    assert groups == {"decode", "decode-1"}
    router = serve.get_deployment_handle("Router", app_name="kairos")
    nodes = router.snapshot.remote().result(timeout_s=60)
    a100, h100 = (StepLatencyModel.load(resolve_profile(p)) for p in ("a100-deepseek-v2-lite", H100))
    for node_id, state in nodes.items():
        if NodeId.parse(node_id).role is Role.DECODE:
            # the model the router decides on: the group's profile (scaled to the node's steps, about x1 here)
            own = H100 if NodeId.parse(node_id).group_name == "decode-1" else None
            model = state.view.model or a100  # none of its own: the predictor's (its refit)
            profile = h100 if own else a100
            assert model.step_s(16, 100_000, 512) == pytest.approx(profile.step_s(16, 100_000, 512), rel=0.2), node_id


def test_the_live_state_holds_every_node_and_the_last_minute(dashboard_app):
    url, _ = dashboard_app
    send_requests(url)
    state = LiveState.from_json(httpx.get(f"{url}/kairos/state", timeout=30).json())
    assert state.router.policy == "kairos" and state.router.window_s == 60
    roles = sorted(node.role.value for node in state.router.nodes)
    assert roles == ["decode", "decode", "prefill", "prefill"]
    assert all(node.node_id.startswith(node.role.value + "-") and node.report_age_s < 5 for node in state.router.nodes)
    assert sorted(NodeId.parse(n.node_id).group_name for n in state.router.nodes if n.role is Role.DECODE) == [
        "decode",
        "decode-1",
    ]
    assert sum(node.num_routed for node in state.router.nodes if node.role is Role.DECODE) >= 3
    assert any(node.num_steps and node.step_measured_s > 0 and node.step_predicted_s > 0 for node in state.router.nodes)
    service = state.service
    assert service.num_requests >= 3 and service.p95_ttft_s and service.p95_tbt_s
    # every request asked the router, well within the decision deadline
    assert service.p50_router_call_s is not None and service.p99_router_call_s is not None
    assert 0 < service.p50_router_call_s <= service.p99_router_call_s < 5
    assert re.search(r"router calls at the ingress .*: P50 [0-9.]+ ms, P99 [0-9.]+ ms$", router_calls(url))
    assert service.rejections.get("bad-request", 0) >= 1


def test_kairos_top_once_prints_every_nodes_line(dashboard_app):
    url, _ = dashboard_app
    send_requests(url)
    nodes = LiveState.from_json(httpx.get(f"{url}/kairos/state", timeout=30).json()).router.nodes
    lines = tool("kairos", "top", "--once", "--url", url).splitlines()
    for node in nodes:  # a line per node, its id first, then its queue
        (line,) = [line for line in lines if line.split()[:1] == [node.node_id]]
        assert line.split()[1].isdigit()
    assert "requests" in lines[-2] and "P95 TTFT" in lines[-2] and "rejected" in lines[-2]
    assert re.fullmatch(r"admission: \d+ shed.*, goodput [0-9.]+ req/s within the SLO", lines[-1]), lines[-1]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (Debian package tmux; scripts/setup.sh)")
def test_kairos_top_refreshes_every_second_under_tmux(dashboard_app):
    url, _ = dashboard_app
    nodes = [n.node_id for n in LiveState.from_json(httpx.get(f"{url}/kairos/state", timeout=30).json()).router.nodes]
    tmux = ["tmux", "-L", f"kairos-top-{uuid.uuid4().hex[:8]}"]  # a server of its own, ended below

    def screen() -> str:
        return subprocess.run([*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True).stdout

    def wait_for(condition, what: str) -> str:
        deadline = time.monotonic() + 60
        while not condition(text := screen()):
            assert time.monotonic() < deadline, f"{what}; the screen shows:\n{text}"
            time.sleep(0.5)
        return text

    def stamp(text: str) -> str:
        return text.splitlines()[0].split()[-1]  # the header's clock, HH:MM:SS

    top = [str(BIN / "kairos"), "top", "--url", url]
    command = [*tmux, "new-session", "-d", "-s", "top", "-x", "120", "-y", "30", *top]
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}  # the terminal's size, not pytest's
    subprocess.run(command, env=env, check=True)
    try:
        first = wait_for(lambda text: all(node in text for node in nodes), "not every node is on the screen")
        wait_for(lambda text: text.strip() and stamp(text) != stamp(first), "the view does not refresh")
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


def test_the_serving_cost_bench_finds_every_process_of_the_serving_path(dashboard_app):
    processes = serving_processes("kairos")
    kinds = sorted(p.name.split("#")[0] for p in processes)
    # the proxy, every replica, and the router's actor, which takes the decisions and reports
    assert kinds == ["Ingress", "Router", "decode", "decode-1", "prefill", "prefill", "proxy", "router-actor"]
    assert len({p.pid for p in processes}) == len(processes) and all(cpu_s(p.pid) > 0 for p in processes)
