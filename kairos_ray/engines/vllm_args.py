"""What Kairos passes to vLLM engines per request, importable without vLLM.

- ``extra_args["chunk_schedule"]``: a deflected request's schedule X (Eq. 5),
  read by ``vllm_scheduler.ChunkScheduleScheduler``;
- ``extra_args["chunk_guard"]``: the step-latency model and budget that
  scheduler re-checks each chunk against when it runs;
- ``extra_args["join_guard"]``: on a hand-off (admission on), the model and
  budget the scheduler checks before the request joins the decode batch
  (decode-side protection, ``core.admission.joined_step_fits``).

What passes in ``kv_transfer_params`` is ``kv.staging``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kairos_ray.core import StepLatency, StepLatencyModel

SCHEDULE_KEY = "chunk_schedule"
GUARD_KEY = "chunk_guard"
JOIN_KEY = "join_guard"


def join_spec(model: StepLatency, tbt_budget_s: float) -> dict[str, Any]:
    """The ``join_guard`` extra arg: Eq. 4's coefficients and tile size, and beta * tau."""
    if not isinstance(model, StepLatencyModel):
        raise TypeError(f"the run-time guards need a linear StepLatencyModel, got {type(model).__name__}")
    return {
        "coefficients": [float(c) for c in model.coefficients],
        "tile_tokens": model.tile_tokens,
        "tbt_budget_s": float(tbt_budget_s),
    }


def priced_with(spec: dict[str, Any], model: StepLatencyModel | None) -> dict[str, Any]:
    """A ``chunk_guard`` or ``join_guard`` arg checking with ``model`` (the one the router priced the request's
    node with, ``EngineRequest.decode_model``) instead of the node's configured profile; ``spec`` when None."""
    return spec if model is None else {**spec, **join_spec(model, spec["tbt_budget_s"])}


def guard_spec(model: StepLatency, candidates: Sequence[int], tbt_budget_s: float) -> dict[str, Any]:
    """The ``chunk_guard`` extra arg: ``join_spec``'s, and LargestSafe's candidates."""
    return {**join_spec(model, tbt_budget_s), "candidates": [int(c) for c in candidates]}
