"""Bookkeeping every engine node shares: pushing its state to the router, and pinning KV it handed off."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

KV_PIN_S = 120.0  # longest a prefill node holds a KV payload that no decode node has confirmed


class StateReporter:
    """Pushes ``state()`` plus the requests ``accepted`` since the last push, at most every ``interval_s``."""

    def __init__(
        self,
        state: Callable[[], dict[str, Any]],
        on_state: Callable[[dict[str, Any]], None] | None,
        interval_s: float,
    ) -> None:
        self.state, self.on_state, self.interval_s = state, on_state, interval_s
        self.accepted: list[int] = []
        self._last = 0.0

    def report(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.on_state is None or (not force and now - self._last < self.interval_s):
            return
        self._last = now
        accepted, self.accepted = self.accepted, []
        self.on_state({**self.state(), "accepted": accepted})


class KVPins:
    """KV payload references a prefill node holds until the decode node has them, or ``KV_PIN_S`` at most.

    The hand-off carries only a reference; without a holder on this side the
    payload could be freed before the decode node fetches it.
    """

    def __init__(self) -> None:
        self._pinned: dict[int, tuple[Any, float]] = {}  # rid -> (ref, since)

    def pin(self, rid: int, ref: Any) -> None:
        now = time.monotonic()
        for old in [r for r, (_, since) in self._pinned.items() if now - since > KV_PIN_S]:
            del self._pinned[old]
        self._pinned[rid] = (ref, now)

    def release(self, rid: int) -> None:
        self._pinned.pop(rid, None)

    def __len__(self) -> int:
        return len(self._pinned)
