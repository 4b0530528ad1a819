"""Online refit of the step-latency model from the step times engines report.

The paper's predictors are profiled offline and need recalibration when the
model or hardware changes. Here the router keeps the last ``window`` steps
engines reported (B, K, chi, the chunk's own prefix P and the measured time; prefill and decode nodes
alike, Eq. 4 covers both), tracks the current model's error on them (the
live prediction error, a metric), and every ``every`` new steps refits the
model on them (``profiling.fit``); it adopts the refit only when it predicts
the window better than the model in use.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kairos_ray.core import StepLatencyModel
from kairos_ray.messages import StepRecord
from kairos_ray.profiling.fit import ProfileTable, fit


@dataclass(frozen=True)
class Refit:
    model: StepLatencyModel | None  # the better model, or None to keep the current one
    current_mape: float  # of the model in use, on the window
    refit_mape: float  # of the refit, on the window


class OnlineRefit:
    def __init__(self, every: int, window: int = 4096) -> None:
        if every < 1 or window < every:
            raise ValueError(f"need 1 <= every <= window, got every={every}, window={window}")
        self.every = every
        self.samples: deque[tuple[float, float, float, float, float]] = deque(maxlen=window)  # B, K, chi, s, P
        self.since_refit = 0

    def add(self, steps: Iterable[StepRecord]) -> None:
        """Keep the steps an engine reported (Eq. 4's features and the measured time)."""
        for step in steps:
            if step.measured_s > 0:
                self.samples.append(
                    (step.batch_size, step.kv_tokens, step.chunk_tokens, step.measured_s, step.prefix_tokens)
                )
                self.since_refit += 1

    @property
    def due(self) -> bool:
        return self.since_refit >= self.every

    def table(self) -> ProfileTable:
        data = np.array(self.samples, dtype=float)
        return ProfileTable(data[:, 0], data[:, 1], data[:, 2], data[:, 3], data[:, 4])

    def mape(self, model: StepLatencyModel) -> float:
        """The model's mean absolute percentage error on the window (the live prediction error)."""
        table = self.table()
        predicted = model.step_s_array(table.batch_size, table.kv_tokens, table.chunk_tokens, table.prefix_tokens)
        return float(np.mean(np.abs(predicted - table.step_s) / table.step_s))

    def refit(self, current: StepLatencyModel) -> Refit:
        self.since_refit = 0
        candidate = fit(self.table(), tile_tokens=current.tile_tokens).model
        current_mape, refit_mape = self.mape(current), self.mape(candidate)
        return Refit(candidate if refit_mape < current_mape else None, current_mape, refit_mape)
