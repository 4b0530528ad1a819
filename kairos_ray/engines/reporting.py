"""A node's reports to the router: the one place a ``NodeState`` is built.

Engines call ``stepped`` after each step and ``accepted`` when they take a
request; ``report`` pushes the state (at most every ``interval_s``, or at
once when forced: the heartbeat) with the steps and requests since the
previous push.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from kairos_ray.core import DecodeNodeView, PrefillNodeView, StepLatency
from kairos_ray.messages import NodeState, StepRecord

MAX_STEPS_PER_REPORT = 64  # a report carries at most this many of the latest steps


class StateReporter:
    """Builds this node's ``NodeState`` and pushes it to ``on_state``."""

    def __init__(
        self,
        ray_node_id: str,
        predictor: StepLatency | None,
        on_state: Callable[[NodeState], None] | None,
        interval_s: float,
    ) -> None:
        self.ray_node_id, self.predictor = ray_node_id, predictor
        self.on_state, self.interval_s = on_state, interval_s
        self.snapshot: Callable[[], NodeState] | None = None  # the engine's ``state``
        self._accepted: list[int] = []
        self._steps: deque[StepRecord] = deque(maxlen=MAX_STEPS_PER_REPORT)
        self._last: StepRecord | None = None
        self._pushed_s = 0.0

    def accepted(self, request_id: int) -> None:
        """The engine took a request: the next report acknowledges it to the router's ledger."""
        self._accepted.append(request_id)

    def stepped(
        self, batch_size: int, kv_tokens: int, chunk_tokens: int, measured_s: float, prefix_tokens: int = 0
    ) -> None:
        """The engine finished a step (Eq. 4's features and its measured time)."""
        predicted = self.predictor.step_s(batch_size, kv_tokens, chunk_tokens, prefix_tokens) if self.predictor else 0.0
        self._last = StepRecord(batch_size, kv_tokens, chunk_tokens, measured_s, predicted, prefix_tokens)
        self._steps.append(self._last)

    def state(
        self,
        view: PrefillNodeView | DecodeNodeView,
        *,
        num_waiting: int = 0,
        pinned_kv: int = 0,
        kv_recomputes: int = 0,
        kv_usage: float = 0.0,
        healthy: bool = True,
    ) -> NodeState:
        """The node's state now; its ``steps`` hold the last step only (``report`` sends all since the last)."""
        return NodeState(
            view=view,
            ray_node_id=self.ray_node_id,
            wall_s=time.time(),
            steps=(self._last,) if self._last else (),
            num_waiting=num_waiting,
            pinned_kv=pinned_kv,
            kv_recomputes=kv_recomputes,
            kv_usage=kv_usage,
            healthy=healthy,
        )

    def report(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.on_state is None or self.snapshot is None or (not force and now - self._pushed_s < self.interval_s):
            return
        self._pushed_s = now
        accepted, self._accepted = tuple(self._accepted), []
        steps = tuple(self._steps)
        self._steps.clear()
        self.on_state(replace(self.snapshot(), steps=steps, accepted_request_ids=accepted))
