"""Markdown tables in the shape of the paper's Tables 3 and 4, and its claims checked, from ``kairos sim`` output.

    python -m kairos_ray.sim.report DIR [--rps R]

DIR holds one sub-directory per workload, each with the ``summary.csv`` of a
``kairos sim`` sweep (``scripts/reproduce_paper.sh`` writes exactly that).
A ``multiturn`` sub-directory, or one named ``multiturn-<cluster>``, gets the
prefix-caching table instead (``scripts/reproduce_prefix.sh``): every policy
at every rate, under a heading that names the sub-directory.
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Sequence
from pathlib import Path

Row = dict[str, str]


def read_summary(path: Path) -> list[Row]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _at(rows: Sequence[Row], policy: str, rps: float) -> Row | None:
    return next((r for r in rows if r["policy"] == policy and float(r["rps"]) == rps), None)


def _rates(rows: Sequence[Row], policy: str) -> list[float]:
    return sorted(float(r["rps"]) for r in rows if r["policy"] == policy)


def table3(by_workload: dict[str, list[Row]], rps: float) -> list[str]:
    """P95 of each TTFT component under pd (the paper's Table 3), in ms."""
    lines = [
        f"| workload ({rps:g} req/s, pd) | prefill queue | prefill exec | KV transfer | decode queue "
        "| P95 TTFT | exec share |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rows in by_workload.items():
        row = _at(rows, "pd", rps)
        if row is None:
            continue
        ms = [1000 * float(row[f"p95_{c}_s"]) for c in ("prefill_queue", "prefill_exec", "kv_transfer", "decode_queue")]
        ttft = 1000 * float(row["p95_ttft_s"])
        lines.append(
            f"| {name} | {ms[0]:,.0f} | {ms[1]:,.0f} | {ms[2]:,.0f} | {ms[3]:,.0f} | {ttft:,.0f} "
            f"| {100 * ms[1] / ttft:.0f} % |"
        )
    return lines


def table4(rows: Sequence[Row], rps: float) -> list[str]:
    """Deflections, P95 TTFT, TBT violations and SLO attainment per policy (the paper's Table 4)."""
    lines = [
        f"| policy ({rps:g} req/s) | deflections | P95 TTFT (s) | TBT violations % | SLO attainment % |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        if float(row["rps"]) == rps:
            lines.append(
                f"| {row['policy']} | {row['deflections']} | {float(row['p95_ttft_s']):.2f} | "
                f"{float(row['tbt_violation_pct']):.2f} | {float(row['slo_attainment_pct']):.1f} |"
            )
    return lines


def cache_table(rows: Sequence[Row]) -> list[str]:
    """Per rate and policy: P95 TTFT, TBT violations, SLO attainment, cache hits per route, KV sent."""
    lines = [
        "| req/s | policy | P95 TTFT (s) | TBT viol. % | SLO att. % | deflected | hit: prefill route % "
        "| hit: deflected % | KV sent (GB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda r: float(r["rps"])):
        hits = [float(row[c]) for c in ("prefill_hit_pct", "deflect_hit_pct")]
        lines.append(
            f"| {float(row['rps']):g} | {row['policy']} | {float(row['p95_ttft_s']):.2f} "
            f"| {float(row['tbt_violation_pct']):.2f} | {float(row['slo_attainment_pct']):.1f} | {row['deflections']} "
            + "".join(f"| {h:.1f} " if h == h else "| - " for h in hits)
            + f"| {float(row['kv_transfer_gb']):.1f} |"
        )
    return lines


def claims(rows: Sequence[Row]) -> list[str]:
    """The reproduction criteria, each with the numbers behind it."""
    out = []
    rates = _rates(rows, "pd")
    low = _at(rows, "pd", rates[0])
    assert low is not None
    base = float(low["p95_ttft_s"])
    tripled = next((r for r in rates if float(_at(rows, "pd", r)["p95_ttft_s"]) >= 3 * base), None)  # type: ignore[index]
    if tripled is None:
        out.append(f"- pd's P95 TTFT never reaches 3x its {rates[0]:g} req/s value ({base:.2f} s) in this sweep.")
    else:
        pd_row, k_row = _at(rows, "pd", tripled), _at(rows, "kairos", tripled)
        assert pd_row is not None
        pd_ttft = float(pd_row["p95_ttft_s"])
        out.append(
            f"- pd's P95 TTFT first triples at {tripled:g} req/s: {base:.2f} s at {rates[0]:g} req/s "
            f"-> {pd_ttft:.2f} s."
        )
        if k_row is not None:
            k_ttft = float(k_row["p95_ttft_s"])
            out.append(
                f"- There kairos has a P95 TTFT of {k_ttft:.2f} s, a cut of {100 * (1 - k_ttft / pd_ttft):.0f} %, "
                f"with {float(k_row['tbt_violation_pct']):.2f} % TBT violations."
            )
        share = float(pd_row["p95_prefill_exec_s"]) / pd_ttft
        out.append(f"- Prefill execution is {100 * share:.0f} % of pd's P95 TTFT there.")
    for spec in ("sl:2048", "kairos"):
        worst = max((r for r in rows if r["policy"] == spec), key=lambda r: float(r["tbt_violation_pct"]), default=None)
        if worst is not None:
            out.append(
                f"- Worst TBT violations of {spec}: {float(worst['tbt_violation_pct']):.2f} % "
                f"at {float(worst['rps']):g} req/s."
            )
    trend = [(r, int(_at(rows, "kairos", r)["deflections"])) for r in _rates(rows, "kairos")]  # type: ignore[index]
    if trend:
        out.append("- kairos deflections by rate: " + ", ".join(f"{r:g}: {d}" for r, d in trend) + ".")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kairos_ray.sim.report", description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="directory with one kairos sim output per workload")
    parser.add_argument("--rps", type=float, default=6.0, help="rate of the tables (default 6)")
    args = parser.parse_args(argv)
    by_workload = {p.parent.name: read_summary(p) for p in sorted(args.dir.glob("*/summary.csv"))}
    if not by_workload:
        parser.error(f"no */summary.csv under {args.dir}")
    for name in [n for n in by_workload if n == "multiturn" or n.startswith("multiturn-")]:
        print(f"### {name}\n")
        print("\n".join(cache_table(by_workload.pop(name))))
        print()
    if not by_workload:
        return 0
    print("\n".join(table3(by_workload, args.rps)))
    if "bursty" in by_workload:
        print()
        print("\n".join(table4(by_workload["bursty"], args.rps)))
        print()
        print("\n".join(claims(by_workload["bursty"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
