"""What Kairos passes to vLLM engines per request, importable without vLLM.

- ``extra_args["chunk_schedule"]``: a deflected request's schedule X (Eq. 5),
  read by ``vllm_scheduler.ChunkScheduleScheduler``;
- ``extra_args["chunk_guard"]``: the step-latency model and budget that
  scheduler re-checks each chunk against when it runs;
- ``kv_transfer_params``: ``{"do_remote_decode": true}`` to a prefill node,
  ``{"kairos_kv": <staged path>, "num_tokens": n}`` back from it and on to the
  decode node (``kv_connector``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

from kairos_ray.core import StepLatency, StepLatencyModel

SCHEDULE_KEY = "chunk_schedule"
GUARD_KEY = "chunk_guard"
KV_PATH = "kairos_kv"  # kv_transfer_params key: the staged path (without the rank suffix)
KV_TOKENS = "num_tokens"  # kv_transfer_params key: prompt tokens whose KV was staged
REMOTE_DECODE = "do_remote_decode"  # kv_transfer_params key set by the caller of a producer
HOLD_KEY = "hold_blocks_until_taken"  # kv_connector_extra_config: producer keeps blocks until the KV is taken
TAKEN = ".taken"  # suffix of the marker the engine leaves once the decode node has a staged file's KV


def guard_spec(model: StepLatency, candidates: Sequence[int], tbt_budget_s: float) -> dict[str, Any]:
    """The ``chunk_guard`` extra arg: Eq. 4's coefficients, LargestSafe's candidates and beta * tau."""
    if not isinstance(model, StepLatencyModel):
        raise TypeError(f"the run-time chunk guard needs a linear StepLatencyModel, got {type(model).__name__}")
    return {
        "coefficients": [float(c) for c in model.coefficients],
        "candidates": [int(c) for c in candidates],
        "tbt_budget_s": float(tbt_budget_s),
    }


def default_staging_dir() -> str:
    """Shared memory where there is some (it never touches a disk), else the temp dir."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, "kairos-kv")


def rank_path(prefix: str, rank: int) -> str:
    """The staged file of one tensor-parallel rank."""
    return f"{prefix}.rank{rank}.pt"


def mark_taken(prefix: str, ranks: Iterable[int]) -> None:
    """Tell a holding producer that the decode node has the KV staged under ``prefix``: it frees the blocks."""
    for rank in ranks:
        with open(rank_path(prefix, rank) + TAKEN, "w"):
            pass
