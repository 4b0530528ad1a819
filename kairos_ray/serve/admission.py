"""Admission slots: how many requests (prompts) are in flight, counted so that no way a request ends can leak one.

A request takes a ``Slot`` when it is admitted and gives it back exactly once,
whether it completes, fails, times out or its client goes away, before or
after the first token, streamed or not. The ingress releases a non-streamed
request's slot in a ``finally``; a streamed request's slot travels with its
response (``GuardedStream``), which releases it when the response ends,
however it ends, even when the body never started.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class Slot:
    """One admitted request's places (one per prompt it runs); ``release`` is idempotent."""

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission
        self.count = 1

    def widen(self, more: int) -> bool:
        """Hold ``more`` places too (a request of several prompts), if there is room; False, holding what it held,
        if not."""
        admission = self._admission
        if admission is None or admission.in_flight + more > admission.limit:
            return False
        admission.in_flight += more
        self.count += more
        return True

    def release(self) -> None:
        if self._admission is not None:
            self._admission.in_flight -= self.count
            self._admission = None


class Admission:
    """At most ``limit`` requests in flight."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0

    def try_acquire(self) -> Slot | None:
        """A slot, or None when ``limit`` requests are in flight."""
        if self.in_flight >= self.limit:
            return None
        self.in_flight += 1
        return Slot(self)


class GuardedStream(StreamingResponse):
    """A streaming response that runs ``on_close`` once it ends, however it ends (even unstarted)."""

    def __init__(self, content: AsyncGenerator[str, None], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._content.aclose()
            finally:
                self._on_close()
