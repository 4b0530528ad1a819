"""Pool autoscaling driven by Kairos's own signals, as a Serve custom autoscaling policy.

Every engine replica reports (``record_autoscaling_stats``):

- prefill nodes: ``prefill_wait_s``, the estimated wait of their queue (Eq. 1-2,
  walked request by request). The queue holds only what the router did not
  deflect, so a long wait means deflection headroom is used up;
- decode nodes: ``tbt_headroom_s``, what a step may still add within beta * tau
  (beta * tau - T0(B, K)), and ``kv_free_share``, the share of KV capacity not
  yet used or promised.

``KairosPoolPolicy`` scales a pool out by one replica when the pressure has held
for ``upscale_after_s`` (prefill: the mean wait above ``wait_share`` of the
TTFT SLO; decode: the smallest TBT headroom below ``min_tbt_headroom_s`` or the
smallest free KV share below ``min_kv_free_share``), and in by one when the
pool has been quiet for ``downscale_after_s`` (prefill: mean wait below
``quiet_share`` of the SLO; decode: headroom and KV at least twice their
thresholds), never twice within ``cooldown_s``, within the deployment's
``min_replicas`` and ``max_replicas``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from kairos_ray.core import DecodeNodeView, Policy, PrefillNodeView
from kairos_ray.core.estimate import queue_wait_exact_s

logger = logging.getLogger("ray.serve")

PREFILL_WAIT = "prefill_wait_s"
TBT_HEADROOM = "tbt_headroom_s"
KV_FREE_SHARE = "kv_free_share"


def node_signals(policy: Policy, view: PrefillNodeView | DecodeNodeView) -> dict[str, float]:
    """What a node reports to Serve for ``KairosPoolPolicy``, from its own view and the policy's model."""
    params, model = policy.params, policy.decode_model
    if isinstance(view, PrefillNodeView):
        return {PREFILL_WAIT: queue_wait_exact_s(model, view, params.prefill_chunk_tokens)}
    headroom = params.tbt_budget_s - model.step_s(view.batch_size, view.kv_tokens, 0)
    capacity = view.kv_tokens + view.free_kv_tokens
    return {TBT_HEADROOM: headroom, KV_FREE_SHARE: view.headroom_kv_tokens / capacity if capacity else 1.0}


@dataclass(frozen=True, slots=True)
class ScalingRule:
    """The thresholds and hold times of ``KairosPoolPolicy`` (the defaults of a pool's ``autoscaling`` section)."""

    wait_share: float = 0.5  # prefill: scale out when the mean wait > this share of the TTFT SLO
    quiet_share: float = 0.1  # prefill: scale in when the mean wait < this share
    min_tbt_headroom_s: float = 0.01  # decode: scale out below this TBT headroom
    min_kv_free_share: float = 0.1  # decode: scale out below this free KV share
    upscale_after_s: float = 5.0  # pressure must hold this long
    downscale_after_s: float = 30.0  # quiet must hold this long
    cooldown_s: float = 30.0  # least time between two changes


class KairosPoolPolicy:
    """Serve's custom autoscaling policy for one pool; ``rule`` fields as keyword arguments."""

    def __init__(self, role: str, ttft_slo_s: float, **rule: float) -> None:
        self.role = role
        self.ttft_slo_s = ttft_slo_s
        r = ScalingRule(**rule)
        self.wait_share, self.quiet_share = r.wait_share, r.quiet_share
        self.min_tbt_headroom_s, self.min_kv_free_share = r.min_tbt_headroom_s, r.min_kv_free_share
        self.upscale_after_s, self.downscale_after_s, self.cooldown_s = (
            r.upscale_after_s,
            r.downscale_after_s,
            r.cooldown_s,
        )

    def pressure(self, metrics: dict[str, dict[Any, float]]) -> tuple[bool, bool]:
        """(under pressure, quiet) from the replicas' latest signals; neither without signals."""
        if self.role == "prefill":
            waits = list(metrics.get(PREFILL_WAIT, {}).values())
            if not waits:
                return False, False
            mean = sum(waits) / len(waits)
            return mean > self.wait_share * self.ttft_slo_s, mean < self.quiet_share * self.ttft_slo_s
        headroom = list(metrics.get(TBT_HEADROOM, {}).values())
        kv = list(metrics.get(KV_FREE_SHARE, {}).values())
        if not headroom or not kv:
            return False, False
        tight = min(headroom) < self.min_tbt_headroom_s or min(kv) < self.min_kv_free_share
        roomy = min(headroom) >= 2 * self.min_tbt_headroom_s and min(kv) >= 2 * self.min_kv_free_share
        return tight, roomy

    def decide(
        self, current: int, low: int, high: int, metrics: dict[str, dict[Any, float]], state: dict[str, Any], now: float
    ) -> tuple[int, dict[str, Any]]:
        """The pure rule: (target replicas, new state)."""
        busy, quiet = self.pressure(metrics)
        state = dict(state)
        for key, holds in (("busy_since", busy), ("quiet_since", quiet)):
            since = state.get(key)
            state[key] = (now if since is None else since) if holds else None
        target = current
        cooled = now - state.get("last_change", -float("inf")) >= self.cooldown_s
        if busy and cooled and now - state["busy_since"] >= self.upscale_after_s:
            target = current + 1
        elif quiet and cooled and now - state["quiet_since"] >= self.downscale_after_s:
            target = current - 1
        target = max(low, min(high, target))
        if target != current:
            logger.info(
                "kairos autoscaling: %s pool %d -> %d replicas (signals %s)", self.role, current, target, metrics
            )
            state["last_change"] = now
            state["busy_since"] = state["quiet_since"] = None
        return target, state

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        now = ctx.current_time or time.time()
        return self.decide(
            ctx.target_num_replicas,
            ctx.capacity_adjusted_min_replicas,
            ctx.capacity_adjusted_max_replicas,
            ctx.aggregated_metrics or {},
            ctx.policy_state or {},
            now,
        )
