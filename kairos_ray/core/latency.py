"""Step-latency model of a serving node (paper Eq. 4).

    T_step(B, K, chi) = T0(B, K) + dT_pf(B, K, chi)

B is the decode batch size, K the KV tokens resident on the node and chi the
prefill tokens injected into the step. The model is linear in six features,
so it is O(1) to evaluate and can be fitted by ordinary least squares:

    T0(B, K)         = c0 + c_batch * B + c_kv * K
    dT_pf(B, K, chi) = c_chunk * chi + c_chunk_kv * chi * K + c_chunk_sq * chi**2

``chi * K`` makes a chunk cost more as context accumulates (later chunks of a
deflected prompt are slower, the paper's reason for shrinking schedules);
``chi**2`` is the chunk's attention over itself. Setting chi = 0 leaves the pure
decode step T0.

Because every term is linear in K, a run of ``n`` equal chunks that starts at
K0 has a closed-form total time and a closed-form count of TBT-safe steps.
``run_s`` and ``safe_steps`` expose that; the Eq. 5 sweep and the prefill
estimators use them so a decision costs O(candidates), not O(steps).
``StepwiseLatency`` gives the same two methods by walking steps one at a time,
for latency functions without a closed form.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

FEATURE_NAMES: tuple[str, ...] = ("1", "B", "K", "chi", "chi*K", "chi^2")
"""Names of the regression features, in coefficient order."""

FloatArray = npt.NDArray[np.float64]


class StepLatency(Protocol):
    """What the estimators and policies need from a latency function."""

    def step_s(self, batch_size: int, kv_tokens: float, chunk_tokens: float) -> float:
        """Seconds for one step (Eq. 4)."""
        ...

    def run_s(self, batch_size: int, kv_tokens: float, chunk_tokens: int, num_steps: int) -> float:
        """Seconds for ``num_steps`` steps of ``chunk_tokens`` each, K growing by the chunk."""
        ...

    def safe_steps(self, batch_size: int, kv_tokens: float, chunk_tokens: int, max_steps: int, budget_s: float) -> int:
        """How many leading steps of such a run each fit in ``budget_s`` (Eq. 5), at most ``max_steps``."""
        ...


class StepwiseLatency:
    """``run_s`` and ``safe_steps`` by walking the run step by step.

    Subclasses define ``step_s``; this works for any latency function,
    including non-linear ground truths, at O(steps) cost.
    """

    def step_s(self, batch_size: int, kv_tokens: float, chunk_tokens: float) -> float:
        raise NotImplementedError

    def run_s(self, batch_size: int, kv_tokens: float, chunk_tokens: int, num_steps: int) -> float:
        return sum(self.step_s(batch_size, kv_tokens + j * chunk_tokens, chunk_tokens) for j in range(num_steps))

    def safe_steps(self, batch_size: int, kv_tokens: float, chunk_tokens: int, max_steps: int, budget_s: float) -> int:
        for j in range(max_steps):
            if self.step_s(batch_size, kv_tokens + j * chunk_tokens, chunk_tokens) > budget_s:
                return j
        return max_steps


@dataclass(frozen=True, slots=True)
class StepLatencyModel:
    """Linear step-latency model (Eq. 4); coefficients in seconds per feature unit."""

    c0: float  # fixed cost of a step
    c_batch: float  # per decoding request
    c_kv: float  # per resident KV token (decode attention reads)
    c_chunk: float  # per prefill token (linear layers)
    c_chunk_kv: float  # per prefill token per resident KV token (attention to context)
    c_chunk_sq: float  # per squared prefill token (attention within the chunk)

    @classmethod
    def from_coefficients(cls, coefficients: npt.ArrayLike) -> StepLatencyModel:
        """Build from a vector in ``FEATURE_NAMES`` order."""
        values = [float(v) for v in np.asarray(coefficients, dtype=float).ravel()]
        if len(values) != len(FEATURE_NAMES):
            raise ValueError(f"expected {len(FEATURE_NAMES)} coefficients, got {len(values)}")
        return cls(*values)

    @property
    def coefficients(self) -> FloatArray:
        """Coefficient vector in ``FEATURE_NAMES`` order."""
        return np.array([self.c0, self.c_batch, self.c_kv, self.c_chunk, self.c_chunk_kv, self.c_chunk_sq], dtype=float)

    def step_s(self, batch_size: int, kv_tokens: float, chunk_tokens: float) -> float:
        """T_step(B, K, chi) in seconds (Eq. 4)."""
        return (
            self.c0
            + self.c_batch * batch_size
            + self.c_kv * kv_tokens
            + chunk_tokens * (self.c_chunk + self.c_chunk_kv * kv_tokens + self.c_chunk_sq * chunk_tokens)
        )

    def step_s_array(
        self, batch_size: npt.ArrayLike, kv_tokens: npt.ArrayLike, chunk_tokens: npt.ArrayLike
    ) -> FloatArray:
        """Vectorised ``step_s`` over broadcastable arrays."""
        return features(batch_size, kv_tokens, chunk_tokens) @ self.coefficients

    def run_s(self, batch_size: int, kv_tokens: float, chunk_tokens: int, num_steps: int) -> float:
        """Closed-form sum of ``num_steps`` steps whose K grows by ``chunk_tokens`` per step.

        step_s(B, K, chi) = a + b * K for fixed B and chi, so the run sums an
        arithmetic series: n * a + b * (n * K0 + chi * n * (n - 1) / 2).
        """
        if num_steps <= 0:
            return 0.0
        n = num_steps
        a = self.c0 + self.c_batch * batch_size + chunk_tokens * (self.c_chunk + self.c_chunk_sq * chunk_tokens)
        b = self.c_kv + self.c_chunk_kv * chunk_tokens
        return n * a + b * (n * kv_tokens + chunk_tokens * n * (n - 1) / 2)

    def safe_steps(self, batch_size: int, kv_tokens: float, chunk_tokens: int, max_steps: int, budget_s: float) -> int:
        """Closed-form count of leading steps within budget; agrees with stepwise ``step_s`` checks."""
        first_s = self.step_s(batch_size, kv_tokens, chunk_tokens)
        if max_steps <= 0 or first_s > budget_s:
            return 0
        b = self.c_kv + self.c_chunk_kv * chunk_tokens  # growth of the step time per KV token
        if b <= 0.0:
            return max_steps  # K growth never makes this chunk slower
        # step j costs step_s(B, K0, chi) + b * chi * j, within budget while j <= last
        last = (budget_s - first_s) / (b * chunk_tokens)
        n = max_steps if last >= max_steps else max(0, math.floor(last) + 1)
        # Division rounding can be off by one at the boundary: settle with step_s itself.
        while n > 1 and self.step_s(batch_size, kv_tokens + (n - 1) * chunk_tokens, chunk_tokens) > budget_s:
            n -= 1
        while n < max_steps and self.step_s(batch_size, kv_tokens + n * chunk_tokens, chunk_tokens) <= budget_s:
            n += 1
        return n

    def to_json(self) -> str:
        """JSON object with the coefficients and the feature names."""
        return json.dumps({"model": "linear-v1", "features": list(FEATURE_NAMES), **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> StepLatencyModel:
        """Inverse of ``to_json``; a missing or non-finite coefficient raises ``ValueError``."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("model") != "linear-v1":
            raise ValueError('not a linear-v1 step-latency profile (missing "model": "linear-v1")')
        names = [f for f in cls.__dataclass_fields__]
        missing = [n for n in names if n not in data]
        if missing:
            raise ValueError(f"step-latency profile lacks coefficients: {', '.join(missing)}")
        bad = [n for n in names if not isinstance(data[n], (int, float)) or not math.isfinite(data[n])]
        if bad:
            raise ValueError(f"step-latency coefficients must be finite numbers: {', '.join(bad)}")
        return cls(**{n: float(data[n]) for n in names})

    @classmethod
    def load(cls, path: str | Path) -> StepLatencyModel:
        """Read a profile file written by ``to_json``."""
        try:
            return cls.from_json(Path(path).read_text())
        except (ValueError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: {exc}") from exc


def features(batch_size: npt.ArrayLike, kv_tokens: npt.ArrayLike, chunk_tokens: npt.ArrayLike) -> FloatArray:
    """Design matrix with one row per step and columns in ``FEATURE_NAMES`` order."""
    b, k, chi = np.broadcast_arrays(
        np.asarray(batch_size, dtype=float), np.asarray(kv_tokens, dtype=float), np.asarray(chunk_tokens, dtype=float)
    )
    return np.stack([np.ones_like(b), b, k, chi, chi * k, chi * chi], axis=-1)
