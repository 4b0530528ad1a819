"""Online refit of the step-latency model from the step times engines report.

The paper's predictors are profiled offline and need recalibration when the
model or hardware changes. Here the router keeps the last ``window`` steps
engines reported (B, K, chi, the chunk's own prefix P and the measured time; prefill and decode nodes
alike, Eq. 4 covers both), tracks the current model's error on them (the
live prediction error, a metric), and every ``every`` new steps refits the
model on them (``profiling.fit``); it adopts the refit only when it predicts
the window better than the model in use.

The refit runs on the router's event loop, between its decisions, so it must
be brief: the window is kept as rows of one preallocated array (a ring),
which the fit and both errors read as views, so a refit builds no array of
its own (``docs/operations.md``).
"""

from __future__ import annotations

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
        self._rows = np.empty((window, 5))  # B, K, chi, s, P per kept step; the oldest is overwritten first
        self._next = 0  # the row the next step goes to
        self.num_samples = 0  # steps kept (at most ``window``)
        self.since_refit = 0

    def add(self, steps: Iterable[StepRecord]) -> None:
        """Keep the steps an engine reported (Eq. 4's features and the measured time)."""
        window = len(self._rows)
        for step in steps:
            if step.measured_s > 0:
                self._rows[self._next] = (
                    step.batch_size, step.kv_tokens, step.chunk_tokens, step.measured_s, step.prefix_tokens
                )  # fmt: skip
                self._next = (self._next + 1) % window
                self.num_samples = min(self.num_samples + 1, window)
                self.since_refit += 1

    @property
    def due(self) -> bool:
        return self.since_refit >= self.every

    def table(self) -> ProfileTable:
        """The kept steps (views of the ring's rows, in no particular order)."""
        data = self._rows[: self.num_samples]
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
