"""``kairos top``: a live terminal view of a running app, from its ``GET /kairos/state`` (``serve.live``).

A line per node: its queue, decode batch size, resident and free KV, committed
deflections, mean step time measured against the step-latency model's
prediction, and what the router sent it in the last minute (deflected share on
decode nodes); then the app's last minute at the ingress: requests, deflected
share, P95 TTFT and TBT, the router calls' P50 and P99 (asking to the reply), fallbacks,
rejections, requests admission shed (by reason and priority) and goodput (requests a second
that ended within their TTFT and TBT objectives).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kairos_ray.messages import LiveState, NodeLive, Role, ServiceLive

STATE_PATH = "/kairos/state"


def fetch(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> LiveState:
    """The app's live state; ``ValueError`` with the reason when it cannot be had."""
    request = urllib.request.Request(url.rstrip("/") + STATE_PATH)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return LiveState.from_json(json.loads(response.read()))
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300]
        raise ValueError(f"{url}{STATE_PATH} answered {exc.code}: {detail}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read {url}{STATE_PATH}: {exc}") from None


def _tokens(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e4 else str(n)


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f} %" if whole else "-"


def _node_row(node: NodeLive) -> list[str]:
    decode = node.role is Role.DECODE
    queue = f"{node.queued_requests}" + ("" if decode else f" ({_tokens(node.queued_prompt_tokens)} tok)")
    step = f"{1e3 * node.step_measured_s:.1f}/{1e3 * node.step_predicted_s:.1f}" if node.num_steps else "-"
    error = f"{100 * node.step_error:.0f}%" if node.num_steps else "-"
    return [
        node.node_id,
        queue,
        str(node.batch_size) if decode else "-",
        _tokens(node.kv_tokens) if decode else "-",
        _tokens(node.free_kv_tokens) if decode else "-",
        f"{100 * node.kv_usage:.0f}%",
        str(node.committed_deflections) if decode else "-",
        step,
        error,
        str(node.num_routed),
        _share(node.num_deflected, node.num_routed) if decode else "-",
        f"{node.report_age_s:.1f}",
    ]


COLUMNS = (  # (title, what it shows)
    ("node", "its role, then its Serve replica id"),
    ("queue", "queued requests (prefill: and their prompt tokens; decode: hand-offs waiting for a slot)"),
    ("batch", "decoding requests"),
    ("KV res", "resident KV tokens"),
    ("KV free", "free KV tokens"),
    ("KV%", "share of the KV cache in use"),
    ("commit", "committed deflections, not prefilled yet"),
    ("step ms", "mean step time over the window: measured/predicted by the model the router prices the node with"),
    ("err", "that model's mean absolute percentage error on those steps"),
    ("routed", "requests the router sent here in the window"),
    ("defl", "of those, deflected here"),
    ("age s", "since the node's last report"),
)


def render(state: LiveState, url: str) -> Group:
    """The view of one state: a header, a line per node (its id says its role), the ingress's last minute."""
    router, service = state.router, state.service
    stamp = datetime.fromtimestamp(state.wall_s).strftime("%H:%M:%S")
    header = Text(f"Kairos-Ray at {url}   policy {router.policy}   window {router.window_s:.0f} s   {stamp}")
    table = Table(box=None, header_style="bold", pad_edge=False)
    id_width = max((len(node.node_id) for node in router.nodes), default=4)  # ids are never cut short
    table.add_column(COLUMNS[0][0], no_wrap=True, min_width=id_width)
    for title, _ in COLUMNS[1:]:
        table.add_column(title, justify="right", no_wrap=True)
    for node in router.nodes:
        table.add_row(*_node_row(node))
    if not router.nodes:
        table.add_row("(no node has reported yet)", *[""] * (len(COLUMNS) - 1))
    rejected = sum(service.rejections.values())
    reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(service.rejections.items()))
    ttft = "-" if service.p95_ttft_s is None else f"{service.p95_ttft_s:.3f} s"
    tbt = "-" if service.p95_tbt_s is None else f"{1e3 * service.p95_tbt_s:.1f} ms"
    calls = (
        "-"
        if service.p50_router_call_s is None or service.p99_router_call_s is None
        else f"{1e3 * service.p50_router_call_s:.1f}/{1e3 * service.p99_router_call_s:.1f} ms"
    )
    summary = Text(
        f"last {service.window_s:.0f} s at the ingress: {service.num_requests} requests, "
        f"{service.num_deflected} deflected ({_share(service.num_deflected, service.num_requests)}), "
        f"P95 TTFT {ttft}, P95 TBT {tbt}, router call P50/P99 {calls}, {service.num_fallbacks} fallbacks, "
        f"{rejected} rejected" + (f" ({reasons})" if reasons else "")
    )
    admission = Text(f"admission: {_shed(service)}, goodput {service.goodput_rps:.2f} req/s within the SLO")
    return Group(header, table, summary, admission)


def _shed(service: ServiceLive) -> str:
    """'N shed (by reason; by priority)', the priorities only when more than one class was shed."""
    total = sum(service.shed.values())
    if not total:
        return "0 shed"
    reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(service.shed.items()))
    classes = service.shed_by_priority
    priorities = "; " + ", ".join(f"priority {p} {n}" for p, n in sorted(classes.items())) if len(classes) > 1 else ""
    return f"{total} shed ({reasons}{priorities})"


def run(url: str, interval_s: float, once: bool, api_key: str | None) -> int:
    """Print the view once, or refresh it every ``interval_s`` until Ctrl-C."""
    console = Console(width=None if sys.stdout.isatty() else 200)
    if once:
        console.print(render(fetch(url, api_key), url))
        return 0
    try:
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                try:
                    view: Group | Text = render(fetch(url, api_key), url)
                except ValueError as exc:
                    view = Text(f"kairos top: {exc} (retrying)", style="red")
                live.update(view, refresh=True)
                time.sleep(interval_s)
    except KeyboardInterrupt:
        return 0


def columns_help() -> str:
    """What each column shows, for ``kairos top --help``."""
    return "\n".join(f"  {title:<8} {what}" for title, what in COLUMNS)
