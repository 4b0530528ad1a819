"""Fit the linear step-latency model (paper Eq. 4) to measured steps.

A profile table has one row per measured engine step with the columns
``batch_size, kv_tokens, chunk_tokens, step_s``. ``fit`` holds out a random
share of the rows, fits the six coefficients of ``StepLatencyModel`` by least
squares on the rest, and reports the mean absolute percentage error on the
held-out rows (the paper's predictors reach MAPE < 10 %).

Coefficients are constrained to be non-negative by default: every feature
(batch, KV, chunk tokens, chunk x KV, chunk squared) can only add work, and
non-negative coefficients make the step time grow with K, which is what lets
LargestSafe shrink chunks monotonically (Eq. 5).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sklearn.linear_model import LinearRegression

from kairos_ray.core.latency import FloatArray, StepLatencyModel, features

COLUMNS = ("batch_size", "kv_tokens", "chunk_tokens", "step_s")


@dataclass(frozen=True)
class ProfileTable:
    """Measured steps as parallel arrays."""

    batch_size: FloatArray
    kv_tokens: FloatArray
    chunk_tokens: FloatArray
    step_s: FloatArray

    def __len__(self) -> int:
        return len(self.step_s)

    def subset(self, rows: np.ndarray) -> ProfileTable:
        return ProfileTable(self.batch_size[rows], self.kv_tokens[rows], self.chunk_tokens[rows], self.step_s[rows])


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
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)}; need {', '.join(COLUMNS)}")
        rows: list[list[float]] = []
        for row in reader:
            values = []
            for column in COLUMNS:
                try:
                    values.append(float(row[column]))
                except (TypeError, ValueError):
                    raise ValueError(f"{path}:{reader.line_num}: {column} = {row[column]!r} is not a number") from None
            rows.append(values)
    if not rows:
        raise ValueError(f"{path}: no measured steps")
    data = np.array(rows, dtype=float)
    return ProfileTable(*(data[:, i] for i in range(len(COLUMNS))))


def write_table(path: str | Path, table: ProfileTable) -> None:
    """Write a profile CSV that ``read_table`` reads back."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for b, k, chi, step in zip(table.batch_size, table.kv_tokens, table.chunk_tokens, table.step_s, strict=True):
            writer.writerow([int(b), int(k), int(chi), f"{step:.6g}"])


def fit(table: ProfileTable, holdout: float = 0.2, seed: int = 0, non_negative: bool = True) -> FitResult:
    """Least-squares fit of Eq. 4 with its held-out MAPE."""
    if not 0.0 < holdout < 1.0:
        raise ValueError(f"holdout must be in (0, 1), got {holdout}")
    n = len(table)
    num_holdout = max(1, round(n * holdout))
    if n - num_holdout < len(StepLatencyModel.__dataclass_fields__):
        raise ValueError(f"need more measured steps to fit 6 coefficients with a hold-out, got {n}")
    order = np.random.default_rng(seed).permutation(n)
    train, test = table.subset(order[num_holdout:]), table.subset(order[:num_holdout])
    regression = LinearRegression(fit_intercept=False, positive=non_negative)
    regression.fit(features(train.batch_size, train.kv_tokens, train.chunk_tokens), train.step_s)
    model = StepLatencyModel.from_coefficients(regression.coef_)
    predicted = model.step_s_array(test.batch_size, test.kv_tokens, test.chunk_tokens)
    mape = float(np.mean(np.abs(predicted - test.step_s) / test.step_s))
    return FitResult(model, mape, n - num_holdout, num_holdout)
