"""Per-request records and their summaries, shared by ``kairos sim`` and the live load generator.

TTFT breakdown (seconds, they add up to the TTFT):

- ``prefill_queue_s``: arrival to the first prefill step (on a prefill node, or
  on the decode node for a deflected request, behind earlier deflections);
- ``prefill_exec_s``: first to last prefill step;
- ``kv_transfer_s``: prefill end to KV arrival at the decode node, link queueing
  included (0 when deflected);
- ``decode_queue_s``: KV arrival to the first token from the decode node (0
  when deflected: the last prefill chunk yields the first token).

SLO attainment, per request: a request attains the SLO when its TTFT is at
most ``slo.ttft_s`` and at most 5 % of its TBT gaps exceed ``slo.tbt_s`` (its
own P95 TBT is within the objective; a request with no gap has no TBT to
miss). ``slo_attainment_pct`` is the share of requests that attain it. The
cluster-level objective of the paper (P95 TTFT and P95 TBT over all requests
within their bounds) is reported as ``slo_met``.

``tbt_violation_pct`` is the share of all TBT gaps, over all requests, longer
than ``slo.tbt_s``.

Admission (``core.admission``): a request the router shed is a record too
(route ``shed``, its reason in ``shed_reason``, no TTFT, no gap). Latency
percentiles, TBT violations, the breakdown and throughput are over the
admitted requests; ``slo_attainment_pct`` is over every request offered (a
shed one misses the SLO), ``admitted_slo_attainment_pct`` over the admitted
ones, ``shed_pct`` the share shed. ``goodput_rps`` is the offered rate times
the share of offered requests (shed and failed ones included) that attain the
SLO: the requests served within their objectives per second of offered load.
Where the simulator knows what a shed request would have met, had it been
admitted (``RequestRecord.would_attain``), ``shed_would_attain_pct`` is the
share of those ``shed_probed`` requests that would have attained the SLO.

Prefix caching (where the records know it, as the simulator's do):
``prefill_hit_pct`` and ``deflect_hit_pct`` are the shares of prompt tokens
that the node computing the prompt found in its cache, over the requests of
each route (the prefill node's cache for the prefill route, the decode
node's for a deflection); ``kv_transfer_gb`` is the KV that travelled from
prefill to decode nodes (a hand-off carries only the blocks the decode node
lacks). They are NaN where unknown (the live load generator).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kairos_ray.config import SLOConfig

BREAKDOWN = ("prefill_queue_s", "prefill_exec_s", "kv_transfer_s", "decode_queue_s")
SHED_ROUTE = "shed"  # the route of a request admission shed
TBT_ALLOWED_SHARE = 0.05  # a request may have up to 5 % of its gaps over the TBT objective


@dataclass
class RequestRecord:
    """One request: served, or shed by admission (``route`` is ``SHED_ROUTE``)."""

    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    route: str  # "prefill", "deflect" or "shed"
    prefill_node: str  # "" when deflected
    decode_node: str
    ttft_s: float
    prefill_queue_s: float
    prefill_exec_s: float
    kv_transfer_s: float
    decode_queue_s: float
    finish_s: float  # seconds since the start of the run, last token
    tbt_gaps_s: npt.NDArray[np.float64] = field(repr=False)  # every gap between consecutive tokens
    cached_tokens: int | None = None  # prompt tokens the computing node's prefix cache held; None: unknown
    kv_transfer_bytes: int | None = None  # KV sent from a prefill node to the decode node; None: unknown
    priority: int = 0  # vLLM's request priority (lower is more important)
    shed_reason: str = ""  # why admission shed it (``core.ShedReason``); "" when admitted
    would_attain: bool | None = None  # shed: whether it would have attained the SLO, admitted; None: unknown
    shed_answer_s: float = math.nan  # shed, live: seconds from sending it to its 429; NaN: not known

    @property
    def shed(self) -> bool:
        return self.route == SHED_ROUTE

    @classmethod
    def of_shed(
        cls,
        request_id: int,
        arrival_s: float,
        prompt_tokens: int,
        output_tokens: int,
        priority: int,
        reason: str,
        answer_s: float = math.nan,
    ) -> RequestRecord:
        """The record of a request admission shed: no node, no token, its TTFT and finish NaN; ``answer_s``: how
        long its 429 took, where measured."""
        nan = math.nan
        return cls(
            request_id=request_id,
            arrival_s=arrival_s,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            route=SHED_ROUTE,
            prefill_node="",
            decode_node="",
            ttft_s=nan,
            prefill_queue_s=nan,
            prefill_exec_s=nan,
            kv_transfer_s=nan,
            decode_queue_s=nan,
            finish_s=nan,
            tbt_gaps_s=np.empty(0),
            cached_tokens=0,
            kv_transfer_bytes=0,
            priority=priority,
            shed_reason=reason,
            shed_answer_s=answer_s,
        )

    def attains(self, slo: SLOConfig) -> bool:
        """Per-request SLO attainment (module docstring)."""
        return bool(gap_stats([self], slo).attains[0])


@dataclass(frozen=True)
class GapStats:
    """Per-request TBT statistics of many records at once, in record order (``gap_stats``)."""

    gaps_s: npt.NDArray[np.float64]  # every record's gaps, one after another
    num_gaps: npt.NDArray[np.int64]
    p95_s: npt.NDArray[np.float64]  # NaN for a request with no gap
    max_s: npt.NDArray[np.float64]  # NaN for a request with no gap
    attains: npt.NDArray[np.bool_]  # per-request SLO attainment (module docstring)


def gap_stats(records: Sequence[RequestRecord], slo: SLOConfig) -> GapStats:
    """P95 and max TBT gap and SLO attainment of every record, vectorised over all of their gaps.

    The P95 is numpy's default (linear) percentile of each request's gaps,
    read off one sort of all gaps by (request, gap) rather than one
    ``np.percentile`` call per request. The sort key is the request's index
    plus its gap scaled into [0, 0.5), one float: two gaps of a request closer
    than a few 1e-12 of the largest gap may swap places, which moves a P95 by
    as little. The max is exact.
    """
    n = len(records)
    lengths = np.fromiter((len(r.tbt_gaps_s) for r in records), dtype=np.int64, count=n)
    gaps = np.concatenate([r.tbt_gaps_s for r in records]) if n else np.empty(0)
    owner = np.repeat(np.arange(n), lengths)
    top = float(gaps.max()) if len(gaps) else 0.0
    ordered = gaps[np.argsort(owner + gaps / (2 * top if top > 0 else 1.0))]
    has = lengths > 0
    last = np.maximum(lengths - 1, 0)
    starts = np.cumsum(lengths) - lengths
    rank = 0.95 * last
    below = np.floor(rank).astype(np.int64)
    above = np.minimum(below + 1, last)
    safe = ordered if len(ordered) else np.zeros(1)  # indices below only read where has is true

    def at(index: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        return np.where(has, safe[np.where(has, starts + index, 0)], np.nan)

    low = at(below)
    p95 = low + (rank - below) * (at(above) - low)
    longest = np.full(n, np.nan)
    if len(gaps):
        longest[has] = np.maximum.reduceat(gaps, starts[has])
    over = np.bincount(owner, weights=gaps > slo.tbt_s, minlength=n)
    ttft = np.fromiter((r.ttft_s for r in records), dtype=float, count=n)
    attains = (ttft <= slo.ttft_s) & (over <= TBT_ALLOWED_SHARE * lengths)
    return GapStats(gaps, lengths, p95, longest, attains)


SUMMARY_COLUMNS = (
    "policy",
    "admission",
    "rps",
    "requests",
    "failed",
    "p50_ttft_s",
    "p95_ttft_s",
    "p99_ttft_s",
    "p50_tbt_s",
    "p95_tbt_s",
    "p99_tbt_s",
    "tbt_violation_pct",
    "slo_attainment_pct",
    "slo_met",
    "deflections",
    "throughput_tok_s",
    "goodput_rps",
    "shed_pct",
    "admitted_slo_attainment_pct",
    "shed_probed",
    "shed_would_attain_pct",
    *(f"p95_{name}" for name in BREAKDOWN),
    "prefill_util_pct",
    "decode_util_pct",
    "prefill_hit_pct",
    "deflect_hit_pct",
    "kv_transfer_gb",
    "router_shards",  # the simulator's router shards (core.shards)
    "shard_kept_pct",  # of its decisions, those a node of another shard would have served sooner
)


def _pct(values: npt.NDArray[np.float64], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def _hit_pct(records: Sequence[RequestRecord], route: str) -> float:
    """Share of the prompt tokens of ``route``'s requests that were cached where they were computed."""
    cached = prompt = 0
    for r in records:
        if r.route == route and r.cached_tokens is not None:
            cached += r.cached_tokens
            prompt += r.prompt_tokens
    return 100 * cached / prompt if prompt else math.nan


def _transfer_gb(records: Sequence[RequestRecord]) -> float:
    sent = [r.kv_transfer_bytes for r in records if r.kv_transfer_bytes is not None]
    return sum(sent) / 1e9 if sent else math.nan


def summarize(
    records: Sequence[RequestRecord],
    slo: SLOConfig,
    policy: str,
    rps: float,
    prefill_util: float = math.nan,
    decode_util: float = math.nan,
    failed: int = 0,
    stats: GapStats | None = None,
    admission: str = "",
) -> dict[str, Any]:
    """One summary row (``SUMMARY_COLUMNS``) of the ``records`` of the requests offered at ``rps`` (``failed``
    requests more got no answer); utilisations are busy shares in [0, 1] where known; ``stats``: their
    ``gap_stats``, if already computed; ``admission``: the admission mode they ran under, where known."""
    stats = stats or gap_stats(records, slo)
    served = [r for r in records if not r.shed]
    ttft = np.array([r.ttft_s for r in served])
    gaps = stats.gaps_s
    start = min((r.arrival_s for r in served), default=0.0)
    end = max((r.finish_s for r in served), default=0.0)
    tokens = sum(r.output_tokens for r in served)
    attained = int(np.count_nonzero(stats.attains))
    offered = len(records) + failed
    probed = [r.would_attain for r in records if r.shed and r.would_attain is not None]
    row: dict[str, Any] = {
        "policy": policy,
        "admission": admission,
        "rps": rps,
        "requests": len(records),
        "failed": failed,
        "p50_ttft_s": _pct(ttft, 50),
        "p95_ttft_s": _pct(ttft, 95),
        "p99_ttft_s": _pct(ttft, 99),
        "p50_tbt_s": _pct(gaps, 50),
        "p95_tbt_s": _pct(gaps, 95),
        "p99_tbt_s": _pct(gaps, 99),
        "tbt_violation_pct": 100 * float(np.mean(gaps > slo.tbt_s)) if len(gaps) else 0.0,
        "slo_attainment_pct": 100 * float(np.mean(stats.attains)) if records else math.nan,
        "deflections": sum(r.route == "deflect" for r in records),
        "throughput_tok_s": tokens / (end - start) if end > start else math.nan,
        "goodput_rps": rps * attained / offered if offered else math.nan,
        "shed_pct": 100 * (len(records) - len(served)) / offered if offered else math.nan,
        "admitted_slo_attainment_pct": 100 * attained / len(served) if served else math.nan,
        "shed_probed": len(probed),
        "shed_would_attain_pct": 100 * sum(probed) / len(probed) if probed else math.nan,
        "prefill_util_pct": 100 * prefill_util,
        "decode_util_pct": 100 * decode_util,
        "prefill_hit_pct": _hit_pct(records, "prefill"),
        "deflect_hit_pct": _hit_pct(records, "deflect"),
        "kv_transfer_gb": _transfer_gb(records),
    }
    for name in BREAKDOWN:
        row[f"p95_{name}"] = _pct(np.array([getattr(r, name) for r in served]), 95)
    row["slo_met"] = bool(row["p95_ttft_s"] <= slo.ttft_s and (not len(gaps) or row["p95_tbt_s"] <= slo.tbt_s))
    return row


RECORD_COLUMNS = (
    "policy",
    "rps",
    "request_id",
    "arrival_s",
    "prompt_tokens",
    "output_tokens",
    "route",
    "prefill_node",
    "decode_node",
    "ttft_s",
    *BREAKDOWN,
    "finish_s",
    "num_tbt_gaps",
    "p95_tbt_s",
    "max_tbt_s",
    "attains_slo",
    "cached_tokens",
    "kv_transfer_bytes",
    "priority",
    "shed_reason",
    "would_attain",
)


def record_rows(
    records: Sequence[RequestRecord], slo: SLOConfig, policy: str, rps: float, stats: GapStats | None = None
) -> list[dict[str, Any]]:
    """Flat per-request rows (``RECORD_COLUMNS``) for CSV output; ``stats``: their ``gap_stats``, if computed."""
    stats = stats or gap_stats(records, slo)
    p95s, maxes = np.round(stats.p95_s, 6).tolist(), np.round(stats.max_s, 6).tolist()
    rows = []
    for r, num_gaps, p95, top, attains in zip(
        records, stats.num_gaps.tolist(), p95s, maxes, stats.attains.tolist(), strict=True
    ):
        rows.append(
            {
                "policy": policy,
                "rps": rps,
                "request_id": r.request_id,
                "arrival_s": round(r.arrival_s, 6),
                "prompt_tokens": r.prompt_tokens,
                "output_tokens": r.output_tokens,
                "route": r.route,
                "prefill_node": r.prefill_node,
                "decode_node": r.decode_node,
                "ttft_s": round(r.ttft_s, 6),
                **{name: round(getattr(r, name), 6) for name in BREAKDOWN},
                "finish_s": round(r.finish_s, 6),
                "num_tbt_gaps": num_gaps,
                "p95_tbt_s": p95 if num_gaps else "",
                "max_tbt_s": top if num_gaps else "",
                "attains_slo": attains,
                "cached_tokens": "" if r.cached_tokens is None else r.cached_tokens,
                "kv_transfer_bytes": "" if r.kv_transfer_bytes is None else r.kv_transfer_bytes,
                "priority": r.priority,
                "shed_reason": r.shed_reason,
                "would_attain": "" if r.would_attain is None else r.would_attain,
            }
        )
    return rows


def write_csv(path: Path, columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
