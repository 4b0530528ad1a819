"""Goodput under overload, admission off and on (``core.admission``), in the simulator.

    python -m kairos_ray.sim.admission [--workloads bursty,multiturn,azure] [--out DIR]

For each workload, R is the highest rate of the grid ``--step``, 2 ``--step``,
... (scanned upwards until it fails) at which plain ``kairos`` (admission off)
keeps SLO attainment >= 90 %, and G its goodput there. At 1.5 R, 2 R and 4 R,
``pd`` and ``kairos`` run with admission off and on (2P2D, ``--seed``,
``--requests`` requests; ``azure`` is the Azure conversation trace's first
``--requests`` requests rescaled to each rate), and the table gives each run's
goodput, shed share, the SLO attainment and TBT violations of its admitted
requests, and two measures of what shedding cost:

- *met without*: the share of the shed requests that attained the SLO in
  the run of the same policy and rate with admission off;
- *would attain*: the share of the probed shed requests (every
  ``--probe-every``-th) that attain it when admitted as decided in a copy of
  the run taken at their arrival, every other request as before
  (``ClusterSim``'s probes): had this one request been admitted, would it
  have met its objective.

A run passes when goodput >= 0.9 G, TBT violations <= 0.5 % and the admitted
requests' SLO attainment >= 95 %. The table goes to stdout (markdown) and,
with every run's summary row, to ``OUT/admission.csv``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kairos_ray.config import KairosConfig, load_config
from kairos_ray.core import AdmissionMode
from kairos_ray.metrics import SUMMARY_COLUMNS, RequestRecord, summarize, write_csv
from kairos_ray.sim.run import SimSetup
from kairos_ray.workloads import Workload
from kairos_ray.workloads.synthetic import synthetic
from kairos_ray.workloads.traces import load_trace

AZURE_CONV = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
MULTIPLES = (1.5, 2.0, 4.0)
POLICIES = ("pd", "kairos")
MODES = (AdmissionMode.OFF, AdmissionMode.SHED)
HOLDS_ATTAINMENT_PCT = 90.0  # R: the highest rate at which plain kairos attains at least this
GOODPUT_SHARE = 0.9  # acceptance: goodput >= this share of G
TBT_VIOLATION_PCT = 0.5  # acceptance: TBT violations of admitted requests at most this
ADMITTED_ATTAINMENT_PCT = 95.0  # acceptance: SLO attainment of admitted requests at least this
COLUMNS = ("workload", "R", "G", "multiple", *SUMMARY_COLUMNS, "met_without_pct", "passes")


@dataclass(frozen=True)
class Source:
    """A workload at any rate: a synthetic one by name, or the head of a trace rescaled."""

    name: str
    requests: int
    seed: int
    trace: Workload | None = None

    def at(self, rps: float) -> Workload:
        if self.trace is not None:
            return self.trace.scaled_to_rate(rps)
        return synthetic(self.name, rps, self.requests, self.seed)


def add_source_options(parser: argparse.ArgumentParser, workloads: str, step: float, step_help: str) -> None:
    """The options of a comparison over workloads at several rates (this module's, ``sim.mixed``'s)."""
    parser.add_argument("--workloads", default=workloads, help=f"bursty, multiturn, ..., azure ({workloads})")
    parser.add_argument("--trace", type=Path, default=AZURE_CONV, help="the trace 'azure' names (%(default)s)")
    parser.add_argument("--requests", type=int, default=2000, help="requests per run (2000)")
    parser.add_argument("--seed", type=int, default=1, help="seed of workloads and step noise (1)")
    parser.add_argument("--step", type=float, default=step, help=f"{step_help} ({step:g})")
    parser.add_argument("--config", type=Path, help="Kairos configuration YAML")


def sources(args: argparse.Namespace) -> Iterator[Source]:
    """The workloads ``add_source_options``'s arguments name; ``azure`` skipped, and said so, without its trace."""
    for name in (n.strip() for n in args.workloads.split(",") if n.strip()):
        trace = None
        if name == "azure":
            if not args.trace.is_file():
                print(f"azure: skipped, no trace at {args.trace}")
                continue
            trace = load_trace(args.trace).head(args.requests)
        yield Source(name, args.requests, args.seed, trace)


def run(
    setup: SimSetup, spec: str, mode: AdmissionMode, source: Source, rps: float
) -> tuple[dict[str, Any], list[RequestRecord]]:
    """One run: its summary row and its records."""
    result = setup.with_admission(mode).simulate(spec, source.at(rps))
    return summarize(result.records, setup.config.slo, spec, rps, admission=mode.value), result.records


def find_r(setup: SimSetup, source: Source, step: float) -> tuple[float, float, list[tuple[float, float]]]:
    """(R, G, the (rate, attainment %) scanned): plain kairos upwards from ``step`` until attainment < 90 %."""
    scanned: list[tuple[float, float]] = []
    best = (math.nan, math.nan)
    rps = step
    while True:
        row, _ = run(replace(setup, probe_every=0), "kairos", AdmissionMode.OFF, source, rps)
        scanned.append((rps, row["slo_attainment_pct"]))
        if row["slo_attainment_pct"] < HOLDS_ATTAINMENT_PCT:
            return *best, scanned
        best = (rps, row["goodput_rps"])
        rps = round(rps + step, 6)


def met_without(shed_run: Sequence[RequestRecord], off_run: Sequence[RequestRecord], setup: SimSetup) -> float:
    """Share (%) of ``shed_run``'s shed requests that attained the SLO in ``off_run`` (same requests, no admission)."""
    attained = {r.request_id for r in off_run if r.attains(setup.config.slo)}
    shed = [r.request_id for r in shed_run if r.shed]
    return 100 * sum(i in attained for i in shed) / len(shed) if shed else math.nan


def passes(row: dict[str, Any], goodput_rps: float) -> bool:
    return bool(
        row["goodput_rps"] >= GOODPUT_SHARE * goodput_rps
        and row["tbt_violation_pct"] <= TBT_VIOLATION_PCT
        and row["admitted_slo_attainment_pct"] >= ADMITTED_ATTAINMENT_PCT
    )


def sweep_workload(setup: SimSetup, source: Source, step: float) -> tuple[list[dict[str, Any]], str]:
    """Every run of one workload (rows of ``COLUMNS``) and the line that says how R was found."""
    r, g, scanned = find_r(setup, source, step)
    found = ", ".join(f"{rps:g}: {pct:.1f} %" for rps, pct in scanned)
    line = f"{source.name}: plain kairos attainment by rate {found}; R = {r:g} req/s, G = {g:.2f} req/s"
    rows = []
    for multiple in MULTIPLES if r == r else ():
        rps = round(multiple * r, 6)
        for spec in POLICIES:
            off, off_records = run(setup, spec, AdmissionMode.OFF, source, rps)
            on, on_records = run(setup, spec, AdmissionMode.SHED, source, rps)
            for row, records in ((off, off_records), (on, on_records)):
                extra = {"met_without_pct": met_without(records, off_records, setup), "passes": passes(row, g)}
                rows.append({"workload": source.name, "R": r, "G": g, "multiple": multiple, **row, **extra})
    return rows, line


def table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The markdown table of the runs."""
    lines = [
        "| workload | rate (req/s) | policy | admission | goodput (req/s) | shed % | admitted SLO att. % "
        "| TBT viol. % | shed that met it without admission % | shed that would attain, admitted % (probed) | passes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        on = row["admission"] == AdmissionMode.SHED.value
        probed = f"{row['shed_would_attain_pct']:.1f} ({row['shed_probed']})" if row["shed_probed"] else "-"
        lines.append(
            f"| {row['workload']} | {row['rps']:g} ({row['multiple']:g} R) | {row['policy']} | {row['admission']} "
            f"| {row['goodput_rps']:.2f} | {row['shed_pct']:.1f} | {row['admitted_slo_attainment_pct']:.1f} "
            f"| {row['tbt_violation_pct']:.2f} | {_pct(row['met_without_pct']) if on else '-'} "
            f"| {probed if on else '-'} | {('yes' if row['passes'] else 'no') if on else '-'} |"
        )
    return lines


def _pct(value: float) -> str:
    return "-" if value != value else f"{value:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kairos_ray.sim.admission", description=__doc__.splitlines()[0])
    add_source_options(parser, "bursty,multiturn,azure", 1.0, "grid of rates R is found on, req/s")
    parser.add_argument("--probe-every", type=int, default=10, help="probe every N-th shed request (10; 0: none)")
    parser.add_argument("--out", type=Path, default=Path("admission-out"), help="where admission.csv goes")
    args = parser.parse_args(argv)
    config = load_config(args.config) if args.config else KairosConfig()
    setup = replace(SimSetup.from_config(config, seed=args.seed), probe_every=args.probe_every)
    rows = []
    for source in sources(args):
        workload_rows, line = sweep_workload(setup, source, args.step)
        rows += workload_rows
        print(line, flush=True)
    print()
    print("\n".join(table(rows)))
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "admission.csv", COLUMNS, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
