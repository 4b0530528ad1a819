"""Plots of summary rows (PNG, matplotlib's Agg backend): the paper's Figures 4-6 and Tables 3-4 in our terms.

Figures are drawn with matplotlib's object API (no pyplot, no state to
close) and laid out by fixed margins rather than ``tight_layout``, which
measured every label's extent and cost more than the drawing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from kairos_ray.config import SLOConfig
from kairos_ray.metrics import BREAKDOWN

LINES = (  # column, axis label, file, log scale
    ("p95_ttft_s", "P95 TTFT (s)", "p95_ttft_vs_rps.png", True),
    ("p95_tbt_s", "P95 TBT (s)", "p95_tbt_vs_rps.png", False),
    ("slo_attainment_pct", "SLO attainment (%)", "slo_attainment_vs_rps.png", False),
    ("deflections", "deflected requests", "deflections_vs_rps.png", False),
)
CACHE_LINES = (
    ("prefill_hit_pct", "prefill route: cached prompt tokens (%)", "prefill_hit_vs_rps.png", False),
    ("deflect_hit_pct", "deflected: cached prompt tokens (%)", "deflect_hit_vs_rps.png", False),
    ("kv_transfer_gb", "KV sent to decode nodes (GB)", "kv_transfer_vs_rps.png", False),
)
"""Drawn only when some request found part of its prompt cached (a workload with prefix identity)."""


def _cached_any(summary: Sequence[dict[str, Any]]) -> bool:
    return any(float(r[c]) > 0 for r in summary for c in ("prefill_hit_pct", "deflect_hit_pct"))


def _by_policy(summary: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in summary:
        groups[str(row["policy"])].append(row)
    for rows in groups.values():
        rows.sort(key=lambda r: float(r["rps"]))
    return groups


def plot_all(summary: Sequence[dict[str, Any]], out: Path, slo: SLOConfig) -> list[Path]:
    """One PNG per metric against the rate (objectives dashed), plus the TTFT breakdown bars; returns the paths."""
    groups = _by_policy(summary)
    objectives = {"p95_ttft_s": slo.ttft_s, "p95_tbt_s": slo.tbt_s}
    written = []
    for column, label, name, log in (*LINES, *(CACHE_LINES if _cached_any(summary) else ())):
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        fig.subplots_adjust(left=0.13, right=0.97, bottom=0.13, top=0.96)
        for policy, rows in groups.items():
            ax.plot([r["rps"] for r in rows], [r[column] for r in rows], marker="o", label=policy)
        if column in objectives:
            ax.axhline(objectives[column], color="k", linestyle="--", linewidth=1, label="objective")
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.savefig(out / name, dpi=110)
        written.append(out / name)
    written.append(_breakdown(groups, out / "ttft_breakdown.png"))
    return written


def _breakdown(groups: dict[str, list[dict[str, Any]]], path: Path) -> Path:
    """Per policy, per rate: the P95 of each TTFT component (the paper's Table 3) beside the P95 TTFT."""
    cols = min(4, len(groups))
    nrows = -(-len(groups) // cols)
    fig = Figure(figsize=(3.6 * cols, 3.2 * nrows))
    axes = fig.subplots(nrows, cols, sharey=True, squeeze=False)
    width_in, height_in = 3.6 * cols, 3.2 * nrows
    # margins in inches: the axis labels on the left and below, each row's title above it
    fig.subplots_adjust(
        left=0.75 / width_in, right=1 - 0.1 / width_in, bottom=0.5 / height_in, top=1 - 0.3 / height_in,
        wspace=0.1, hspace=0.35,
    )  # fmt: skip
    width = 0.18
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(groups) :]:
        ax.set_visible(False)
    for ax, (policy, rows) in zip(flat, groups.items(), strict=False):
        xs = range(len(rows))
        for i, name in enumerate(BREAKDOWN):
            ax.bar([x + (i - 1.5) * width for x in xs], [r[f"p95_{name}"] for r in rows], width, label=name[:-2])
        ax.plot(list(xs), [r["p95_ttft_s"] for r in rows], "k_", markersize=14, label="P95 TTFT")
        ax.set_xticks(list(xs), [f"{r['rps']:g}" for r in rows])
        ax.set_title(policy, fontsize=9)
        ax.set_xlabel("req/s")
        ax.set_yscale("log")
    for row in axes:
        row[0].set_ylabel("P95 (s)")
    flat[0].legend(fontsize=7)
    fig.savefig(path, dpi=110)
    return path
