"""Fit the linear step-latency model (paper Eq. 4) to measured steps.

A profile table has one row per measured engine step with the columns
``batch_size, kv_tokens, chunk_tokens, prefix_tokens, step_s`` (``prefix_tokens``,
the chunk's own prefix, may be absent: tables measured before it existed read
as chunks with no prefix). ``fit`` holds out a random share of the rows, fits
the nine coefficients of ``StepLatencyModel`` by least squares on the rest,
and reports the mean absolute percentage error on the held-out rows (the
paper's predictors reach MAPE < 10 %). The engine's tile size is given, not
fitted: the chunk's linear-layer feature is the chunk rounded up to whole
tiles (``core.latency.tiles``; 1, no rounding, unless the engine is known to
pad).

Coefficients are constrained to be non-negative by default: every feature
(batch, batch squared, KV, chunk tokens, chunk x KV, chunk squared, chunk x
own prefix) can only add work, and non-negative coefficients make the step
time grow as the prefix grows, which is what lets LargestSafe shrink chunks
monotonically (Eq. 5).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kairos_ray.core.latency import FEATURE_NAMES, FloatArray, StepLatencyModel, features

COLUMNS = ("batch_size", "kv_tokens", "chunk_tokens", "prefix_tokens", "step_s")
OPTIONAL = {"prefix_tokens": 0.0}  # columns a table may lack, and the value they then read as


@dataclass(frozen=True)
class ProfileTable:
    """Measured steps as parallel arrays; without ``prefix_tokens``, every chunk had an empty prefix."""

    batch_size: FloatArray
    kv_tokens: FloatArray
    chunk_tokens: FloatArray
    step_s: FloatArray
    prefix_tokens: FloatArray = field(default_factory=lambda: np.zeros(0))

    def __post_init__(self) -> None:
        if not len(self.prefix_tokens) and len(self.step_s):
            object.__setattr__(self, "prefix_tokens", np.zeros_like(self.step_s))
        if len(self.prefix_tokens) != len(self.step_s):
            raise ValueError(f"{len(self.prefix_tokens)} prefix lengths for {len(self.step_s)} steps")

    def __len__(self) -> int:
        return len(self.step_s)

    def subset(self, rows: np.ndarray) -> ProfileTable:
        return ProfileTable(
            self.batch_size[rows],
            self.kv_tokens[rows],
            self.chunk_tokens[rows],
            self.step_s[rows],
            self.prefix_tokens[rows],
        )

    def design(self, tile_tokens: int = 1) -> FloatArray:
        """The regression's design matrix (``core.latency.features``)."""
        return features(self.batch_size, self.kv_tokens, self.chunk_tokens, self.prefix_tokens, tile_tokens)


@dataclass(frozen=True)
class FitResult:
    model: StepLatencyModel
    holdout_mape: float  # mean absolute percentage error on held-out steps, as a fraction (0.05 = 5 %)
    num_train: int
    num_holdout: int


def read_table(path: str | Path) -> ProfileTable:
    """Read a profile CSV; a missing column or a bad number names the file, line and field."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        present = reader.fieldnames or []
        missing = [c for c in COLUMNS if c not in present and c not in OPTIONAL]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)}; need {', '.join(COLUMNS)}")
        rows: list[list[float]] = []
        for row in reader:
            values = []
            for column in COLUMNS:
                if column not in present:
                    values.append(OPTIONAL[column])
                    continue
                try:
                    values.append(float(row[column]))
                except (TypeError, ValueError):
                    raise ValueError(f"{path}:{reader.line_num}: {column} = {row[column]!r} is not a number") from None
            rows.append(values)
    if not rows:
        raise ValueError(f"{path}: no measured steps")
    columns = dict(zip(COLUMNS, np.array(rows, dtype=float).T, strict=True))
    return ProfileTable(**columns)


def write_table(path: str | Path, table: ProfileTable) -> None:
    """Write a profile CSV that ``read_table`` reads back."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for b, k, chi, p, step in zip(
            table.batch_size, table.kv_tokens, table.chunk_tokens, table.prefix_tokens, table.step_s, strict=True
        ):
            writer.writerow([int(b), int(k), int(chi), int(p), f"{step:.6g}"])


def linear_regression() -> Any:
    """scikit-learn's ``LinearRegression``, imported when first asked for: an ingress or engine replica imports
    this module through the router's actor class (Ray loads it to call the actor) and never fits."""
    from sklearn.linear_model import LinearRegression

    return LinearRegression


def fit(
    table: ProfileTable, holdout: float = 0.2, seed: int = 0, non_negative: bool = True, tile_tokens: int = 1
) -> FitResult:
    """Least-squares fit of Eq. 4 (chunks in tiles of ``tile_tokens``) with its held-out MAPE."""
    if not 0.0 < holdout < 1.0:
        raise ValueError(f"holdout must be in (0, 1), got {holdout}")
    n = len(table)
    num_holdout = max(1, round(n * holdout))
    if n - num_holdout < len(FEATURE_NAMES):
        raise ValueError(f"need more measured steps to fit {len(FEATURE_NAMES)} coefficients with a hold-out, got {n}")
    order = np.random.default_rng(seed).permutation(n)
    train, test = table.subset(order[num_holdout:]), table.subset(order[:num_holdout])
    design = train.design(tile_tokens)
    # The columns span some ten orders of magnitude (1 to chi * K); scaled to at most 1, the solver treats them alike.
    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0
    regression = linear_regression()(fit_intercept=False, positive=non_negative)
    regression.fit(design / scale, train.step_s)
    model = StepLatencyModel.from_coefficients(regression.coef_ / scale, tile_tokens)
    mape = float(np.mean(np.abs(test.design(tile_tokens) @ model.coefficients - test.step_s) / test.step_s))
    return FitResult(model, mape, n - num_holdout, num_holdout)
