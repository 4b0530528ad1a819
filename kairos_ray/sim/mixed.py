"""A mixed decode fleet, each node priced with its own model against one model per pool, in the simulator.

    python -m kairos_ray.sim.mixed [--workloads bursty,azure] [--requests N] [--step RPS]

2 A100 prefill nodes and a decode pool of 2 A100 and 2 H100 nodes (the shipped
``a100-deepseek-v2-lite`` and ``h100-deepseek-v2-lite`` profiles, each
group's steps its own profile's ground truth). For each workload, at ``--step``,
2 ``--step``, 4 ``--step``, ... up to the first rate at which ``pd``'s P95 TTFT
passes the TTFT objective (its saturation, included), three runs on the same
requests:

- ``pd``: plain disaggregation;
- ``kairos`` (own): every node priced with its own group's model
  (``DecodeNodeView.model``);
- ``kairos`` (pool): every node priced with the A100 model, as a router that
  knows one model per pool would.

The table gives each run's P95 TTFT and TBT violations and the deflections to
each decode group; ``azure`` is the Azure conversation trace's first
``--requests`` requests rescaled to each rate. A rate passes when own has the
lowest P95 TTFT of the three, 0.00 % TBT violations, and sends more
deflections to the H100 nodes than pool does.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kairos_ray.config import KairosConfig, load_config
from kairos_ray.metrics import RequestRecord, summarize
from kairos_ray.sim.admission import Source, add_source_options, sources
from kairos_ray.sim.run import Group, SimSetup

A100, H100 = "a100-deepseek-v2-lite", "h100-deepseek-v2-lite"
PREFILL: tuple[Group, ...] = ((2, A100),)
DECODE: tuple[Group, ...] = ((2, A100), (2, H100))
MOST_RATES = 12  # a scan that has not found pd's saturation by then (step x 2^11) stops


@dataclass(frozen=True)
class Run:
    """One policy's run at one rate: its P95 TTFT, TBT violations and deflections per decode group."""

    p95_ttft_s: float
    tbt_violation_pct: float
    deflections: tuple[int, ...]  # per decode group, in ``DECODE`` order


@dataclass(frozen=True)
class Row:
    workload: str
    rps: float
    pd: Run
    own: Run
    pool: Run

    @property
    def passes(self) -> bool:
        h100 = len(DECODE) - 1
        return (
            self.own.p95_ttft_s < min(self.pd.p95_ttft_s, self.pool.p95_ttft_s)
            and self.own.tbt_violation_pct == 0.0
            and self.own.deflections[h100] > self.pool.deflections[h100]
        )


def deflections_by_group(records: Sequence[RequestRecord]) -> tuple[int, ...]:
    """Deflected requests per decode group (the simulator names decode nodes ``decode-<i>`` in group order)."""
    counts = [0] * len(DECODE)
    bounds = [sum(count for count, _ in DECODE[: g + 1]) for g in range(len(DECODE))]
    for record in records:
        if record.route == "deflect":
            index = int(record.decode_node.rsplit("-", 1)[1])
            counts[next(g for g, bound in enumerate(bounds) if index < bound)] += 1
    return tuple(counts)


def run(setup: SimSetup, spec: str, source: Source, rps: float) -> Run:
    records = setup.simulate(spec, source.at(rps)).records
    row = summarize(records, setup.config.slo, spec, rps)
    return Run(row["p95_ttft_s"], row["tbt_violation_pct"], deflections_by_group(records))


def sweep_workload(setup: SimSetup, source: Source, step: float) -> list[Row]:
    """Every rate of one workload, up to pd's saturation."""
    pool = replace(setup, node_models=False)
    rows: list[Row] = []
    for doublings in range(MOST_RATES):
        rps = round(step * 2**doublings, 6)
        own = run(setup, "kairos", source, rps)
        rows.append(Row(source.name, rps, run(setup, "pd", source, rps), own, run(pool, "kairos", source, rps)))
        if rows[-1].pd.p95_ttft_s > setup.config.slo.ttft_s:
            break
    return rows


def table(rows: Sequence[Row]) -> list[str]:
    """The markdown table of the runs."""
    groups = " / ".join(str(name).split("-", 1)[0].upper() for _, name in DECODE)
    lines = [
        f"| workload | rate (req/s) | P95 TTFT pd (s) | P95 TTFT pool (s) | P95 TTFT own (s) | TBT viol. own % "
        f"| deflections pool ({groups}) | deflections own ({groups}) | passes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.workload} | {r.rps:g} | {r.pd.p95_ttft_s:.2f} | {r.pool.p95_ttft_s:.2f} | {r.own.p95_ttft_s:.2f} "
            f"| {r.own.tbt_violation_pct:.2f} | {' / '.join(map(str, r.pool.deflections))} "
            f"| {' / '.join(map(str, r.own.deflections))} | {'yes' if r.passes else 'no'} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kairos_ray.sim.mixed", description=__doc__.splitlines()[0])
    add_source_options(parser, "bursty,azure", 0.5, "rates scanned: step, 2 step, 4 step, ... req/s")
    args = parser.parse_args(argv)
    config = load_config(args.config) if args.config else KairosConfig()
    setup = SimSetup.from_config(config, A100, PREFILL, DECODE, args.seed)
    rows = [row for source in sources(args) for row in sweep_workload(setup, source, args.step)]
    print("\n".join(table(rows)))
    return 0 if rows and all(r.passes for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
