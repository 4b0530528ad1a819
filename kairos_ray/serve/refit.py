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
from kairos_ray.profiling.fit import ProfileTable, fit, linear_regression


@dataclass(frozen=True)
class Refit:
    model: StepLatencyModel | None  # the better model, or None to keep the current one
    current_mape: float  # of the model in use, on the window
    refit_mape: float  # of the refit, on the window


class OnlineRefit:
    def __init__(self, every: int, window: int = 4096) -> None:
        if every < 1 or window < every:
            raise ValueError(f"need 1 <= every <= window, got every={every}, window={window}")
        linear_regression()  # scikit-learn's import paid as the router starts, not in its first refit
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


SCALE_STEP = 0.05
"""A node's new scale is considered only when it differs from its current one (1: the pool's model) by more than
this share: a node the model already fits keeps it, whatever the noise says."""

NODE_WINDOW = 512
"""Steps a node's calibration keeps (``NodeScales``): a few KB a node, whatever the fleet's traffic."""

NODE_EVERY = 100
"""A node is recalibrated at most every this many of its own steps: one parameter needs fewer than a refit."""


class NodeScales:
    """Each node's own speed on its pool's model: T_node = s_n x T_pool (Eq. 4 scaled), fitted to its own steps.

    A pool's model is refit from every node's steps (``OnlineRefit``); nodes of one pool still differ (a GPU
    of another kind, neighbours sharing its host), and one node's steps seldom cover Eq. 4's every feature
    (a decode node without deflections reports no chunk), so a node borrows the pool model's shape and fits
    only its scale: s_n is the median of measured / predicted over its last ``window`` steps, every ``every``
    new ones, adopted when it moved by more than ``SCALE_STEP`` from the scale the node is priced with and
    predicts its steps better. Until a node has its own, it is priced with the median scale of its group's
    calibrated nodes (a node that has not run yet shares its hosts' slowdown, so a calibrated node is not
    ranked below an idle sibling priced at the profile's speed); with none, with the pool's model. The
    router's view of the node carries ``model_for``'s model.
    """

    def __init__(self, every: int, window: int = NODE_WINDOW) -> None:
        if every < 1 or window < 1:
            raise ValueError(f"need every >= 1 and window >= 1, got every={every}, window={window}")
        self.every, self.window = every, window
        self._steps: dict[str, OnlineRefit] = {}
        self._group: dict[str, str] = {}  # node id -> its group (the nodes a node borrows a scale from)
        self.scale: dict[str, float] = {}  # node id -> its adopted scale (absent: priced with its group's)
        self._group_scale: dict[str, float] = {}  # group -> the median of its nodes' adopted scales
        self._models: dict[str, tuple[StepLatencyModel, float, StepLatencyModel]] = {}  # (pool, scale, model)

    def add(self, node_id: str, group: str, steps: Iterable[StepRecord], pool: StepLatencyModel) -> Refit | None:
        """Keep the node's steps; when its calibration is due, recalibrate it on ``pool`` (the refit, whether
        adopted or not; None when not due)."""
        kept = self._steps.get(node_id)
        if kept is None:
            kept = self._steps[node_id] = OnlineRefit(min(self.every, self.window), self.window)
            self._group[node_id] = group
        kept.add(steps)
        if not kept.due:
            return None
        kept.since_refit = 0
        table = kept.table()
        predicted = pool.step_s_array(table.batch_size, table.kv_tokens, table.chunk_tokens, table.prefix_tokens)
        scale = float(np.median(table.step_s / predicted))
        candidate, current = scaled(pool, scale), self.model_for(node_id, group, pool)
        current_mape, candidate_mape = kept.mape(current), kept.mape(candidate)
        moved = abs(scale / self.scale_of(node_id, group) - 1) > SCALE_STEP
        better = moved and candidate_mape < current_mape
        if better:
            self.scale[node_id] = scale
            self._regroup(group)
        return Refit(candidate if better else None, current_mape, candidate_mape)

    def scale_of(self, node_id: str, group: str) -> float:
        """The scale ``node_id`` of ``group`` is priced with: its own, else its group's, else 1 (the pool's
        model)."""
        own = self.scale.get(node_id)
        return own if own is not None else self._group_scale.get(group, 1.0)

    def model_for(self, node_id: str, group: str, pool: StepLatencyModel) -> StepLatencyModel:
        """The model ``node_id`` of ``group`` is priced with: the pool's, scaled by ``scale_of`` (the same object
        while neither changes, as a policy's queue walks expect)."""
        scale = self.scale_of(node_id, group)
        if scale == 1.0:
            return pool
        made = self._models.get(node_id)
        if made is None or made[0] is not pool or made[1] != scale:
            made = self._models[node_id] = (pool, scale, scaled(pool, scale))
        return made[2]

    def _regroup(self, group: str) -> None:
        adopted = [s for node, s in self.scale.items() if self._group[node] == group]
        if adopted:
            self._group_scale[group] = float(np.median(adopted))
        else:
            self._group_scale.pop(group, None)

    def reset(self) -> None:
        """The pool's model changed: every scale was fitted against the old one (each node recalibrates on the new
        one when it is next due)."""
        self.scale.clear()
        self._group_scale.clear()
        self._models.clear()

    def forget(self, node_id: str) -> None:
        """A node left: its steps and scale go with it."""
        self._steps.pop(node_id, None)
        self._models.pop(node_id, None)
        group = self._group.pop(node_id, None)
        if self.scale.pop(node_id, None) is not None and group is not None:
            self._regroup(group)

    def group_of(self, node_id: str) -> str:
        """The group ``node_id`` (one of ``nodes``) was calibrated in."""
        return self._group[node_id]

    def nodes(self) -> list[str]:
        return list(self._steps)

    def __len__(self) -> int:
        return len(self._steps)


def scaled(model: StepLatencyModel, scale: float) -> StepLatencyModel:
    """``model`` with every coefficient times ``scale`` (a node ``scale`` times slower, or faster below 1)."""
    return StepLatencyModel.from_coefficients(model.coefficients * scale, model.tile_tokens)
