"""Step-latency model of a serving node (paper Eq. 4), with the injected chunk's own context.

    T_step(B, K, chi, P) = T0(B, K) + dT_pf(B, K, chi, P)

B is the decode batch size, K the KV tokens resident on the node, chi the
prefill tokens injected into the step and P the chunk's own prefix: the tokens
of the same request prefilled before this chunk (for the i-th chunk of a
schedule, P = sum_{j<i} chi_j; they are resident too, so K includes them, as
in Eq. 5's K_n + sum_{j<i} chi_j). The model is linear in nine features, so
it is O(1) to evaluate and can be fitted by ordinary least squares:

    T0(B, K)             = c0 + c_batch * B + c_batch_sq * B**2 + c_kv * K
    dT_pf(B, K, chi, P)  = c_chunk * tiles(chi) + c_chunk_kv * chi * K + c_chunk_sq * chi**2
                           + c_chunk_prefix * chi * P + c_prefix * P
    tiles(chi)           = ceil(chi / tile_tokens) * tile_tokens

``c_batch_sq * B**2`` is batch crowding: the per-request decode cost that
grows as the batch fills (the paper's T0 is linear in B). ``tiles(chi)`` is
the chunk as the linear layers see it: an engine that runs prefill tokens in
tiles pays a partial tile as a whole one, so a 129-token chunk costs 256
tokens of ``c_chunk`` at ``tile_tokens`` = 128. ``tile_tokens`` is a property
of the engine, not a fitted coefficient (1: no padding, the paper's form);
``c_batch_sq`` is fitted like the others (0: the paper's form).

A chunk's attention spans its own request's context, not the node's: ``chi *
P`` is that attention's arithmetic (the reason later chunks of a deflected
prompt are slower and LargestSafe's schedule shrinks), ``P`` the reading of
the prefix's KV beyond what any resident token costs (``c_kv``; an engine may
gather a prefilling request's context where decode reads it in place),
``chi**2`` the chunk's attention over itself; the other requests' KV costs the
decode part of the step, ``c_kv * K``. The paper writes the chunk's context as
the node's resident KV; that form is ``c_chunk_prefix = c_prefix = 0`` with
``c_chunk_kv > 0`` (every profile of format ``linear-v1`` reads so). With
chi = 0 there is no chunk and no prefix: the pure decode step T0.

Because every term is linear in K and P, a run of ``n`` equal chunks whose K
and P both grow by the chunk each step has a closed-form total time and a
closed-form count of TBT-safe steps. ``run_s`` and ``safe_steps`` expose that;
the Eq. 5 sweep and the prefill estimators use them so a decision costs
O(candidates), not O(steps). ``StepwiseLatency`` gives the same two methods by
walking steps one at a time, for latency functions without a closed form.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, overload

import numpy as np
import numpy.typing as npt

FEATURE_NAMES: tuple[str, ...] = ("1", "B", "K", "tiles(chi)", "chi*K", "chi^2", "chi*P", "P", "B^2")
"""Names of the regression features, in coefficient order."""

FORMAT = "linear-v3"
"""The ``model`` field of profile files written now.

Older files still load: ``linear-v2`` has no ``B^2`` term and no tiles,
``linear-v1`` (the paper's form) no prefix terms either.
"""

_LATER_FIELDS = {  # the fields each older format lacks (read as 0, or 1 for tile_tokens)
    "linear-v1": ("c_chunk_prefix", "c_prefix", "c_batch_sq", "tile_tokens"),
    "linear-v2": ("c_batch_sq", "tile_tokens"),
    FORMAT: (),
}

FloatArray = npt.NDArray[np.float64]


class StepLatency(Protocol):
    """What the estimators and policies need from a latency function.

    ``prefix_tokens`` is the chunk's own prefix P (0 for a request's first chunk; ignored without a chunk).
    """

    def step_s(self, batch_size: int, kv_tokens: float, chunk_tokens: float, prefix_tokens: float = 0) -> float:
        """Seconds for one step (Eq. 4)."""
        ...

    def run_s(
        self, batch_size: int, kv_tokens: float, chunk_tokens: int, num_steps: int, prefix_tokens: float = 0
    ) -> float:
        """Seconds for ``num_steps`` steps of ``chunk_tokens`` each, K and P growing by the chunk."""
        ...

    def safe_steps(
        self,
        batch_size: int,
        kv_tokens: float,
        chunk_tokens: int,
        max_steps: int,
        budget_s: float,
        prefix_tokens: float = 0,
    ) -> int:
        """How many leading steps of such a run each fit in ``budget_s`` (Eq. 5), at most ``max_steps``."""
        ...


class StepwiseLatency:
    """``run_s`` and ``safe_steps`` by walking the run step by step.

    Subclasses define ``step_s``; this works for any latency function,
    including non-linear ground truths, at O(steps) cost.
    """

    def step_s(self, batch_size: int, kv_tokens: float, chunk_tokens: float, prefix_tokens: float = 0) -> float:
        raise NotImplementedError

    def run_s(
        self, batch_size: int, kv_tokens: float, chunk_tokens: int, num_steps: int, prefix_tokens: float = 0
    ) -> float:
        return sum(
            self.step_s(batch_size, kv_tokens + j * chunk_tokens, chunk_tokens, prefix_tokens + j * chunk_tokens)
            for j in range(num_steps)
        )

    def safe_steps(
        self,
        batch_size: int,
        kv_tokens: float,
        chunk_tokens: int,
        max_steps: int,
        budget_s: float,
        prefix_tokens: float = 0,
    ) -> int:
        for j in range(max_steps):
            grown = j * chunk_tokens
            if self.step_s(batch_size, kv_tokens + grown, chunk_tokens, prefix_tokens + grown) > budget_s:
                return j
        return max_steps


@dataclass(frozen=True, slots=True)
class StepLatencyModel:
    """Linear step-latency model (Eq. 4); coefficients in seconds per feature unit."""

    c0: float  # fixed cost of a step
    c_batch: float  # per decoding request
    c_kv: float  # per resident KV token (decode attention reads)
    c_chunk: float  # per prefill token (linear layers)
    c_chunk_kv: float  # per prefill token per resident KV token (the paper's form of the chunk's context)
    c_chunk_sq: float  # per squared prefill token (attention within the chunk)
    c_chunk_prefix: float = 0.0  # per prefill token per token of its own prefix (attention over its context)
    c_prefix: float = 0.0  # per token of the chunk's own prefix (reading its context), beyond c_kv
    c_batch_sq: float = 0.0  # per squared decoding request (batch crowding)
    tile_tokens: int = 1  # prefill tokens go through the linear layers in tiles of this many (not fitted)

    def __post_init__(self) -> None:
        if not isinstance(self.tile_tokens, int) or self.tile_tokens < 1:
            raise ValueError(f"tile_tokens must be an integer >= 1, got {self.tile_tokens!r}")

    @classmethod
    def from_coefficients(cls, coefficients: npt.ArrayLike, tile_tokens: int = 1) -> StepLatencyModel:
        """Build from a vector in ``FEATURE_NAMES`` order and the engine's tile size."""
        values = [float(v) for v in np.asarray(coefficients, dtype=float).ravel()]
        if len(values) != len(FEATURE_NAMES):
            raise ValueError(f"expected {len(FEATURE_NAMES)} coefficients, got {len(values)}")
        names = [name for name in cls.__dataclass_fields__ if name != "tile_tokens"]
        return cls(**dict(zip(names, values, strict=True)), tile_tokens=tile_tokens)

    @property
    def coefficients(self) -> FloatArray:
        """Coefficient vector in ``FEATURE_NAMES`` order."""
        return np.array(
            [
                self.c0,
                self.c_batch,
                self.c_kv,
                self.c_chunk,
                self.c_chunk_kv,
                self.c_chunk_sq,
                self.c_chunk_prefix,
                self.c_prefix,
                self.c_batch_sq,
            ],
            dtype=float,
        )

    def step_s(self, batch_size: int, kv_tokens: float, chunk_tokens: float, prefix_tokens: float = 0) -> float:
        """T_step(B, K, chi, P) in seconds (Eq. 4)."""
        seconds = self.c0 + batch_size * (self.c_batch + self.c_batch_sq * batch_size) + self.c_kv * kv_tokens
        if not chunk_tokens:
            return seconds
        return (
            seconds
            + self.c_chunk * tiles(chunk_tokens, self.tile_tokens)
            + chunk_tokens
            * (self.c_chunk_kv * kv_tokens + self.c_chunk_sq * chunk_tokens + self.c_chunk_prefix * prefix_tokens)
            + self.c_prefix * prefix_tokens
        )

    def step_s_array(
        self,
        batch_size: npt.ArrayLike,
        kv_tokens: npt.ArrayLike,
        chunk_tokens: npt.ArrayLike,
        prefix_tokens: npt.ArrayLike = 0,
    ) -> FloatArray:
        """Vectorised ``step_s`` over broadcastable arrays."""
        return features(batch_size, kv_tokens, chunk_tokens, prefix_tokens, self.tile_tokens) @ self.coefficients

    def _growth_s(self, chunk_tokens: float) -> float:
        """How much a step slows per token by which K and P both grow (the chunk's own KV)."""
        return self.c_kv + self.c_prefix + (self.c_chunk_kv + self.c_chunk_prefix) * chunk_tokens

    def run_s(
        self, batch_size: int, kv_tokens: float, chunk_tokens: int, num_steps: int, prefix_tokens: float = 0
    ) -> float:
        """Closed-form sum of ``num_steps`` steps whose K and P grow by ``chunk_tokens`` per step.

        Step j costs step_s(B, K0, chi, P0) + b * chi * j for fixed B and chi
        (the tiles of chi are fixed too), so the run sums an arithmetic series: n * first + b * chi * n * (n - 1) / 2.
        """
        if num_steps <= 0:
            return 0.0
        n = num_steps
        first = self.step_s(batch_size, kv_tokens, chunk_tokens, prefix_tokens)
        return n * first + self._growth_s(chunk_tokens) * chunk_tokens * n * (n - 1) / 2

    def safe_steps(
        self,
        batch_size: int,
        kv_tokens: float,
        chunk_tokens: int,
        max_steps: int,
        budget_s: float,
        prefix_tokens: float = 0,
    ) -> int:
        """Closed-form count of leading steps within budget; agrees with stepwise ``step_s`` checks."""
        first_s = self.step_s(batch_size, kv_tokens, chunk_tokens, prefix_tokens)
        if max_steps <= 0 or first_s > budget_s:
            return 0
        b = self._growth_s(chunk_tokens)
        if b <= 0.0:
            return max_steps  # the chunk's growing context never makes it slower
        # step j costs first_s + b * chi * j, within budget while j <= last
        last = (budget_s - first_s) / (b * chunk_tokens)
        n = max_steps if last >= max_steps else max(0, math.floor(last) + 1)

        def fits(j: int) -> bool:
            grown = j * chunk_tokens
            return self.step_s(batch_size, kv_tokens + grown, chunk_tokens, prefix_tokens + grown) <= budget_s

        # Division rounding can be off by one at the boundary: settle with step_s itself.
        while n > 1 and not fits(n - 1):
            n -= 1
        while n < max_steps and fits(n):
            n += 1
        return n

    def to_json(self) -> str:
        """JSON object with the coefficients, the tile size and the feature names."""
        return json.dumps({"model": FORMAT, "features": list(FEATURE_NAMES), **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> StepLatencyModel:
        """Inverse of ``to_json``; also reads ``linear-v2`` and ``linear-v1`` (``_LATER_FIELDS``).

        A missing or non-finite coefficient, or a tile size that is not a positive integer, raises ``ValueError``.
        """
        data = json.loads(text)
        version = data.get("model") if isinstance(data, dict) else None
        if version not in _LATER_FIELDS:
            raise ValueError(
                f'not a linear step-latency profile (need "model": one of {", ".join(map(repr, _LATER_FIELDS))})'
            )
        names = [f for f in cls.__dataclass_fields__ if f not in _LATER_FIELDS[version]]
        missing = [n for n in names if n not in data]
        if missing:
            raise ValueError(f"step-latency profile lacks coefficients: {', '.join(missing)}")
        bad = [n for n in names if not isinstance(data[n], (int, float)) or not math.isfinite(data[n])]
        if bad:
            raise ValueError(f"step-latency coefficients must be finite numbers: {', '.join(bad)}")
        tile = data["tile_tokens"] if "tile_tokens" in names else 1
        tile = int(tile) if float(tile).is_integer() else tile  # JSON may write 128 as 128.0; __post_init__ checks
        return cls(**{n: float(data[n]) for n in names if n != "tile_tokens"}, tile_tokens=tile)

    @classmethod
    def load(cls, path: str | Path) -> StepLatencyModel:
        """Read a profile file written by ``to_json``."""
        try:
            return cls.from_json(Path(path).read_text())
        except (ValueError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: {exc}") from exc


@overload
def tiles(chunk_tokens: float, tile_tokens: int) -> float: ...
@overload
def tiles(chunk_tokens: FloatArray, tile_tokens: int) -> FloatArray: ...
def tiles(chunk_tokens: float | FloatArray, tile_tokens: int) -> float | FloatArray:
    """The chunk (a number or an array of them) rounded up to whole tiles: the prefill tokens the linear layers
    compute."""
    return chunk_tokens if tile_tokens == 1 else -(-chunk_tokens // tile_tokens) * tile_tokens


def features(
    batch_size: npt.ArrayLike,
    kv_tokens: npt.ArrayLike,
    chunk_tokens: npt.ArrayLike,
    prefix_tokens: npt.ArrayLike = 0,
    tile_tokens: int = 1,
) -> FloatArray:
    """Design matrix with one row per step and columns in ``FEATURE_NAMES`` order (P counts only with a chunk)."""
    b, k, chi, p = np.broadcast_arrays(
        np.asarray(batch_size, dtype=float),
        np.asarray(kv_tokens, dtype=float),
        np.asarray(chunk_tokens, dtype=float),
        np.asarray(prefix_tokens, dtype=float),
    )
    p = np.where(chi > 0, p, 0.0)
    return np.stack([np.ones_like(b), b, k, tiles(chi, tile_tokens), chi * k, chi * chi, chi * p, p, b * b], axis=-1)
