"""Run policies over workloads at several rates and collect summaries, records and plots."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kairos_ray.config import KairosConfig, SLOConfig, resolve_profile
from kairos_ray.core import AdmissionMode, Policy, StepLatencyModel, parse_spec
from kairos_ray.emulation import ClusterHardware, GroundTruth
from kairos_ray.metrics import (
    RECORD_COLUMNS,
    SUMMARY_COLUMNS,
    RequestRecord,
    gap_stats,
    record_rows,
    summarize,
    write_csv,
)
from kairos_ray.sim.cluster import ClusterSim, SimResult
from kairos_ray.workloads import Workload


@dataclass(frozen=True)
class SimSetup:
    """Everything fixed across the runs of one sweep."""

    config: KairosConfig
    model: StepLatencyModel  # the predictor policies decide with
    hardware: ClusterHardware
    truth: GroundTruth  # what simulated steps take (before noise)
    num_prefill: int = 2
    num_decode: int = 2
    seed: int = 0
    probe_every: int = 0  # admit every probe_every-th shed request in a copy of the run (0: none; ClusterSim)

    @classmethod
    def from_config(
        cls, config: KairosConfig, profile: str | None = None, num_prefill: int = 2, num_decode: int = 2, seed: int = 0
    ) -> SimSetup:
        """Predictor and hardware from ``profile`` (a name or a path; default: the config's)."""
        path = resolve_profile(profile or config.predictor.profile)
        model = StepLatencyModel.load(path)
        hardware = ClusterHardware.from_profile(path)
        return cls(config, model, hardware, GroundTruth(model, hardware), num_prefill, num_decode, seed)

    def with_admission(self, mode: AdmissionMode) -> SimSetup:
        """The same setup with the configuration's ``admission.mode`` set to ``mode``."""
        admission = self.config.admission.model_copy(update={"mode": mode})
        return replace(self, config=self.config.model_copy(update={"admission": admission}))

    def policy(self, spec: str) -> Policy:
        """A core policy by spec, deciding with the predictor (``oracle``: with the noise-free ground truth)."""
        return self.config.build_policy(spec, model=self.model, truth=self.truth, hardware=self.hardware)

    def simulate(self, spec: str, workload: Workload, progress: Callable[[int], None] | None = None) -> SimResult:
        """One run of the policy ``spec`` names over ``workload``."""
        sim = ClusterSim(
            self.policy(spec),
            self.truth,
            self.hardware,
            self.num_prefill,
            self.num_decode,
            self.config.prefill_chunk_tokens,
            self.seed,
            self.probe_every,
        )
        result = sim.run(workload.clipped_to_context(self.hardware.context_tokens), progress)
        for record in result.records:
            probe = result.probes.get(record.request_id) if record.shed else None
            if probe is not None:
                record.would_attain = probe.attains(self.config.slo)
        return result


def check_specs(specs: Sequence[str]) -> None:
    """Raise ``ValueError`` for a spec that names no policy."""
    for spec in specs:
        parse_spec(spec)


def sweep(
    setup: SimSetup,
    specs: Sequence[str],
    runs: Sequence[tuple[float, Workload]],
    progress: Callable[[int], None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[tuple[str, float], list[RequestRecord]]]:
    """Every policy over every (rate, workload); returns summary rows, record rows and the records by run."""
    summary, rows = [], []
    by_run: dict[tuple[str, float], list[RequestRecord]] = {}
    slo = setup.config.slo
    for rps, workload in runs:
        for spec in specs:
            result = setup.simulate(spec, workload, progress)
            stats = gap_stats(result.records, slo)
            util = (result.prefill_util, result.decode_util)
            mode = setup.config.admission.mode.value
            summary.append(summarize(result.records, slo, spec, rps, *util, stats=stats, admission=mode))
            rows.extend(record_rows(result.records, slo, spec, rps, stats))
            by_run[(spec, rps)] = result.records
    return summary, rows, by_run


def write_outputs(
    out: Path, summary: list[dict[str, Any]], rows: list[dict[str, Any]], slo: SLOConfig, plots: bool = True
) -> list[Path]:
    """summary.csv, requests.csv and (unless ``plots`` is false) the plots; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "summary.csv", SUMMARY_COLUMNS, summary)
    write_csv(out / "requests.csv", RECORD_COLUMNS, rows)
    written = [out / "summary.csv", out / "requests.csv"]
    if plots:
        from kairos_ray.metrics.plots import plot_all  # matplotlib: imported only when drawing

        written += plot_all(summary, out, slo)
    return written


COMPARED = (
    ("P50 TTFT s", "p50_ttft_s"),
    ("P95 TTFT s", "p95_ttft_s"),
    ("P99 TTFT s", "p99_ttft_s"),
    ("P95 TBT ms", "p95_tbt_s"),
    ("P99 TBT ms", "p99_tbt_s"),
    ("TBT violations %", "tbt_violation_pct"),
    ("SLO attainment %", "slo_attainment_pct"),
    ("deflections", "deflections"),
    ("P95 prefill queue s", "p95_prefill_queue_s"),
    ("P95 prefill exec s", "p95_prefill_exec_s"),
    ("P95 KV transfer s", "p95_kv_transfer_s"),
    ("P95 decode queue s", "p95_decode_queue_s"),
)


def compare_rows(sim: dict[str, Any], live: dict[str, Any]) -> str:
    """The simulator's and a live run's summaries side by side, with live / sim for each figure."""
    lines = [f"{'':<22} {'sim':>10} {'live':>10} {'live/sim':>9}"]
    for label, key in COMPARED:
        scale = 1e3 if label.endswith(" ms") else 1.0
        a, b = scale * float(sim[key]), scale * float(live[key])
        ratio = f"{b / a:>8.2f}x" if a else f"{'-':>9}"
        lines.append(f"{label:<22} {a:>10.3f} {b:>10.3f} {ratio}")
    return "\n".join(lines)
