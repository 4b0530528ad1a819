"""A node's reports to the router: the one place a ``NodeState`` is built.

Engines call ``stepped`` after each step and ``accepted`` when they take a
request; ``report`` pushes the state with the steps and requests since the
previous push. A push costs an RPC on both ends, so it goes only when it
tells the router something a decision depends on: a request taken, or a
change of the node's shape (its queue, its batch, its committed deflections)
at most every ``interval_s``; otherwise (the KV growing by a token per
request and step) every ``refresh_s``, and always on the heartbeat.

An engine with a prefix cache gives the reporter its journal (``cache``):
each push then carries the blocks stored and removed since the previous one
(``PrefixDelta``), and a change of the cache is a reason to push, so the
router's mirror (``serve.router``) learns a finished turn's blocks before
the conversation's next turn comes. Every ``resync_s`` (and first) the delta
is the whole cache, which restarts a mirror that lost a report.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from kairos_ray.core import DecodeNodeView, JournaledBlockCache, PrefillNodeView, StepLatency
from kairos_ray.messages import NodeState, PrefixDelta, StepRecord

MAX_STEPS_PER_REPORT = 64  # a report carries at most this many of the latest steps
REFRESH_S = 0.25  # a node whose shape did not change still reports this often while it steps
RESYNC_S = 30.0  # a node's prefix-cache delta is its whole cache this often


class StateReporter:
    """Builds this node's ``NodeState`` and pushes it to ``on_state``."""

    def __init__(
        self,
        ray_node_id: str,
        predictor: StepLatency | None,
        on_state: Callable[[NodeState], None] | None,
        interval_s: float,
        refresh_s: float = REFRESH_S,
        resync_s: float = RESYNC_S,
    ) -> None:
        self.ray_node_id, self.predictor = ray_node_id, predictor
        self.on_state, self.interval_s, self.refresh_s = on_state, interval_s, refresh_s
        self.cache: JournaledBlockCache | None = None  # the engine's prefix cache (or its mirror), if it has one
        self.resync_s = resync_s
        self._prefix_seq = 0
        self._resynced_s = 0.0
        self._shape: tuple[object, ...] = ()  # of the last pushed view
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
        if self.on_state is None or self.snapshot is None:
            return
        since = time.monotonic() - self._pushed_s
        if not force and since < self.interval_s:
            return
        state = self.snapshot()
        shape = _shape(state)
        cache = self.cache
        changed = cache is not None and cache.changed
        if not (force or changed or self._accepted or shape != self._shape or since >= self.refresh_s):
            return
        self._pushed_s, self._shape = time.monotonic(), shape
        accepted, self._accepted = tuple(self._accepted), []
        steps = tuple(self._steps)
        self._steps.clear()
        self.on_state(replace(state, steps=steps, accepted_request_ids=accepted, prefix=self._prefix()))

    def _prefix(self) -> PrefixDelta | None:
        """The cache's changes since the last push (its whole content every ``resync_s``)."""
        if self.cache is None:
            return None
        full = time.monotonic() - self._resynced_s >= self.resync_s
        delta = self.cache.take(full)
        if delta is None:
            return None
        if delta.full:
            self._resynced_s = time.monotonic()
        self._prefix_seq += 1
        return PrefixDelta(self.cache.block_tokens, self._prefix_seq - 1, delta)


def _shape(state: NodeState) -> tuple[object, ...]:
    """What a decision depends on beyond the KV's steady growth: queue, batch, commitments, health."""
    view = state.view
    if isinstance(view, PrefillNodeView):
        return (view.queued_prompt_tokens, view.queued_cached_tokens, state.healthy)
    return (view.batch_size, view.committed, view.committed_cached_tokens, state.num_waiting, state.healthy)
