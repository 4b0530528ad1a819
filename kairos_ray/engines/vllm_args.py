"""What Kairos passes to vLLM engines per request, importable without vLLM.

- ``extra_args["chunk_schedule"]``: a deflected request's schedule X (Eq. 5),
  read by ``vllm_scheduler.ChunkScheduleScheduler``;
- ``extra_args["chunk_guard"]``: the step-latency model and budget that
  scheduler re-checks each chunk against when it runs.

What passes in ``kv_transfer_params`` is ``kv.staging``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kairos_ray.core import StepLatency, StepLatencyModel

SCHEDULE_KEY = "chunk_schedule"
GUARD_KEY = "chunk_guard"


def guard_spec(model: StepLatency, candidates: Sequence[int], tbt_budget_s: float) -> dict[str, Any]:
    """The ``chunk_guard`` extra arg: Eq. 4's coefficients and tile size, LargestSafe's candidates and beta * tau."""
    if not isinstance(model, StepLatencyModel):
        raise TypeError(f"the run-time chunk guard needs a linear StepLatencyModel, got {type(model).__name__}")
    return {
        "coefficients": [float(c) for c in model.coefficients],
        "tile_tokens": model.tile_tokens,
        "candidates": [int(c) for c in candidates],
        "tbt_budget_s": float(tbt_budget_s),
    }
