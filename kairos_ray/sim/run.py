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
from kairos_ray.sim.cluster import ClusterSim, NodeGroup, SimResult
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
    # a mixed fleet (``from_config``): each pool's node groups, each with its own profile; () for one group
    prefill_groups: tuple[NodeGroup, ...] = ()
    decode_groups: tuple[NodeGroup, ...] = ()
    node_models: bool = True  # the policy prices each node with its own group's model, not the pool's
    router_shards: int = 1  # router shards dividing the decode nodes (``core.shards``; 1: one router)

    @classmethod
    def from_config(
        cls,
        config: KairosConfig,
        profile: str | None = None,
        prefill: int | Sequence[Group] = 2,
        decode: int | Sequence[Group] = 2,
        seed: int = 0,
    ) -> SimSetup:
        """Predictor and hardware from ``profile`` (a name or a path; default: the config's), for ``prefill`` and
        ``decode`` nodes: a count, or (count, profile) groups of a mixed fleet (``parse_groups``; a group without
        a profile is of the setup's)."""
        path = resolve_profile(profile or config.predictor.profile)
        model = StepLatencyModel.load(path)
        hardware = ClusterHardware.from_profile(path)
        truth = GroundTruth(model, hardware)

        def groups(pool: int | Sequence[Group]) -> tuple[NodeGroup, ...]:
            if isinstance(pool, int):
                return (NodeGroup(pool, truth, hardware),)
            made = []
            for count, name in pool:
                own = resolve_profile(name) if name else path
                if own == path:
                    made.append(NodeGroup(count, truth, hardware))
                    continue
                own_model, own_hardware = StepLatencyModel.load(own), ClusterHardware.from_profile(own)
                made.append(NodeGroup(count, GroundTruth(own_model, own_hardware), own_hardware, own_model))
            return tuple(made)

        prefill_groups, decode_groups = groups(prefill), groups(decode)
        return cls(
            config,
            model,
            hardware,
            truth,
            sum(g.count for g in prefill_groups),
            sum(g.count for g in decode_groups),
            seed,
            prefill_groups=prefill_groups,
            decode_groups=decode_groups,
        )

    def with_admission(self, mode: AdmissionMode) -> SimSetup:
        """The same setup with the configuration's ``admission.mode`` set to ``mode``."""
        admission = self.config.admission.model_copy(update={"mode": mode})
        return replace(self, config=self.config.model_copy(update={"admission": admission}))

    def policy(self, spec: str) -> Policy:
        """A core policy by spec, deciding with the predictor (``oracle``: with the noise-free ground truth)."""
        return self.config.build_policy(spec, model=self.model, truth=self.truth, hardware=self.hardware)

    def simulate(self, spec: str, workload: Workload, progress: Callable[[int], None] | None = None) -> SimResult:
        """One run of the policy ``spec`` names over ``workload``."""
        policy = self.policy(spec)
        sim = ClusterSim(
            policy,
            self.truth,
            self.hardware,
            self.num_prefill,
            self.num_decode,
            self.config.prefill_chunk_tokens,
            self.seed,
            self.probe_every,
            self._shown(self.prefill_groups, policy),
            self._shown(self.decode_groups, policy),
            self.router_shards,
        )
        result = sim.run(workload.clipped_to_context(self.hardware.context_tokens), progress)
        for record in result.records:
            probe = result.probes.get(record.request_id) if record.shed else None
            if probe is not None:
                record.would_attain = probe.attains(self.config.slo)
        return result

    def _shown(self, groups: tuple[NodeGroup, ...], policy: Policy) -> tuple[NodeGroup, ...]:
        """The groups as ``policy`` sees them: each with its own model (the oracle: its ground truth), or, without
        ``node_models``, all priced with the pool's."""
        if not self.node_models:
            return tuple(replace(g, model=None) for g in groups)
        if policy.decides_with_ground_truth:
            return tuple(replace(g, model=g.truth if g.model is not None else None) for g in groups)
        return groups


Group = tuple[int, str | None]
"""(nodes, profile name or path; None: the setup's own) of one node group (``SimSetup.from_config``)."""


def parse_groups(text: str) -> int | list[Group]:
    """A pool as ``kairos sim --decode`` takes it: ``N`` (N nodes of the setup's profile) or ``N:PROFILE`` entries
    separated by commas (``2:a100-deepseek-v2-lite,2:h100-deepseek-v2-lite``); a bare N among them is of the
    setup's profile. Raises ``ValueError`` naming the entry at fault."""
    text = text.strip()
    if text.isdigit():
        if int(text) < 1:
            raise ValueError(f"need at least 1 node, got {text}")
        return int(text)
    groups: list[Group] = []
    for entry in text.split(","):
        count, _, name = entry.strip().partition(":")
        if not count.strip().isdigit() or int(count) < 1:
            raise ValueError(f"{entry.strip()!r}: expected N or N:PROFILE with N >= 1")
        if name.strip():
            resolve_profile(name.strip())  # a profile that does not exist is named now
        groups.append((int(count), name.strip() or None))
    return groups


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
            row = summarize(result.records, slo, spec, rps, *util, stats=stats, admission=mode)
            row["router_shards"] = setup.router_shards
            if result.kept_from_better is not None:
                row["shard_kept_pct"] = 100 * result.kept_from_better
            summary.append(row)
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
