"""A fake cluster for the live path's logic, in process, without Ray: pools whose calls the test answers.

``FakeCluster`` gives a real ``serve.dispatch.Dispatcher`` (its ``RouterLink``,
``DecisionBatcher`` and ``TokenMux`` included) handles that stand for the
``Router`` deployment and the two pools. Each remote call returns an asyncio
future, as Serve's responses are awaitable and cancellable; the test decides
what the router answers (``decide``), what a prefill returns, and which
tokens each decode node streams to the ingress's subscription, and reads
back every call the dispatcher made.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kairos_ray.core import Decision, Route
from kairos_ray.messages import DecisionRequest, EngineRequest, KVHandoff, RoutingReply, TokenBatch, TokenEvent
from kairos_ray.serve.delivery import NodeGroups
from kairos_ray.serve.dispatch import Dispatcher, ServingLimits
from kairos_ray.serve.metrics import IngressMetrics
from kairos_ray.serve.types import LineOff

LIMITS = ServingLimits(
    decision_timeout_s=5.0, first_token_timeout_s=5.0, token_stall_timeout_s=5.0, max_attempts=3, max_migrations=2
)


class Remote:
    """A handle method: ``remote(...)`` records the call and returns a future of ``answer(...)``.

    ``answer`` may return a value, an awaitable (the future waits for it) or raise (the future fails).
    """

    def __init__(self, answer: Callable[..., Any]) -> None:
        self.answer = answer
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        self.calls.append((args, kwargs))
        try:
            result = self.answer(*args, **kwargs)
        except Exception as exc:
            future = asyncio.get_running_loop().create_future()
            future.set_exception(exc)
            return future
        if inspect.isawaitable(result):
            return asyncio.ensure_future(result)
        future = asyncio.get_running_loop().create_future()
        future.set_result(result)
        return future


def deflect_to(node: str) -> Callable[[DecisionRequest], Decision]:
    """A router that deflects every request to ``node`` with a one-chunk schedule."""
    return lambda r: Decision(Route.DEFLECT, None, node, (r.prompt_tokens,), 1.0, 0.5, "decode faster")


def hand_off(prefill: str, decode: str) -> Callable[[DecisionRequest], Decision]:
    """A router that prefills every request on ``prefill`` and hands it off to ``decode``."""
    return lambda r: Decision(Route.PREFILL, prefill, decode, (), 0.5, None, "prefill faster")


@dataclass
class FakeRouter:
    """The ``Router`` deployment and its actor: decisions by ``decide``, on Ray calls (its TCP line is off)."""

    decide: Callable[[DecisionRequest], Decision]
    asked: list[DecisionRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.handle = Remote(lambda: self)
        self.decide_many = Remote(self._decide_many)
        self.wire = Remote(self._no_line)

    def _decide_many(self, requests: list[DecisionRequest]) -> list[RoutingReply]:
        self.asked += requests
        return [RoutingReply(self.decide(r), 0.0, 0.0) for r in requests]

    @staticmethod
    def _no_line() -> None:
        raise LineOff("the test's router takes Ray calls only")


class FakePrefillPool:
    """Prefill nodes: ``prefill`` answers with ``handoff_for(request, node)`` (or raises what it raises)."""

    def __init__(self) -> None:
        self.handoff_for: Callable[[EngineRequest, str], Any] = lambda request, node: KVHandoff(
            kv=f"kv-{request.request_id}", kv_bytes=8, node_id=node, prefill_queue_s=0.0, prefill_exec_s=0.01,
            prefill_end_wall_s=0.0, transport="object_store",
        )  # fmt: skip
        self.prefill = Remote(lambda request, node=None, avoid=(): self.handoff_for(request, node))
        self.release = Remote(lambda request_id, node=None: None)


class FakeDecodePool:
    """Decode nodes: ``start`` takes a request on the node named (or the first not avoided), and the test
    streams its tokens with ``emit``; each node's subscription reads what ``emit`` and ``fail`` put for it."""

    def __init__(self, nodes: tuple[str, ...]) -> None:
        self.nodes = nodes
        self.refuse: dict[str, Exception] = {}  # node -> what its start raises
        self.started: list[tuple[str, EngineRequest, KVHandoff | None]] = []  # (node, request, handoff)
        self._feeds: dict[str, asyncio.Queue[TokenBatch | BaseException | None]] = {}
        self.start = Remote(self._start)
        self.cancel = Remote(lambda request_id, attempt, node=None: None)
        self.subscribe = _Stream(self._subscription)

    def options(self, **_: Any) -> FakeDecodePool:
        return self

    def _start(
        self, request: EngineRequest, handoff: KVHandoff | None, listener: str, node: str | None = None,
        avoid: tuple[str, ...] = (),
    ) -> str:  # fmt: skip
        chosen = node or next(n for n in self.nodes if n not in avoid)
        if chosen in self.refuse:
            raise self.refuse[chosen]
        self.started.append((chosen, request, handoff))
        return chosen

    def _feed(self, node: str) -> asyncio.Queue[TokenBatch | BaseException | None]:
        return self._feeds.setdefault(node, asyncio.Queue())

    async def _subscription(self, listener: str, node: str | None = None) -> AsyncIterator[TokenBatch]:
        assert node is not None
        feed = self._feed(node)
        while (item := await feed.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    def emit(self, node: str, request: EngineRequest, first: int, count: int, last: bool = False) -> None:
        """``count`` tokens of ``request``'s latest run on ``node``, from output index ``first``."""
        events = [TokenEvent(1000 + i, i, last and i == first + count - 1, node) for i in range(first, first + count)]
        self._feed(node).put_nowait(TokenBatch({self.key_on(node, request): events}, {}))

    def fail(self, node: str, request: EngineRequest, why: str) -> None:
        """The run of ``request`` on ``node`` failed there (the node's outbox reports it)."""
        self._feed(node).put_nowait(TokenBatch({}, {self.key_on(node, request): why}))

    def break_subscription(self, node: str, error: BaseException) -> None:
        self._feed(node).put_nowait(error)

    def key_on(self, node: str, request: EngineRequest) -> tuple[int, int]:
        """(request id, attempt) of ``request``'s latest run started on ``node``."""
        attempts = [r.attempt for n, r, _ in self.started if n == node and r.request_id == request.request_id]
        return request.request_id, attempts[-1]

    def cancelled(self) -> list[tuple[int, int, str | None]]:
        return [(args[0], args[1], kwargs.get("node")) for args, kwargs in self.cancel.calls]


class _Stream:
    """A streaming handle method: ``remote(...)`` is the async iterator itself."""

    def __init__(self, make: Callable[..., AsyncIterator[Any]]) -> None:
        self.make = make

    def remote(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        return self.make(*args, **kwargs)


class FakeCluster:
    """A ``Dispatcher`` over a fake router and fake pools (build it inside the test's event loop)."""

    def __init__(
        self,
        decide: Callable[[DecisionRequest], Decision],
        decode_nodes: tuple[str, ...] = ("decode-a", "decode-b"),
        limits: ServingLimits = LIMITS,
        second_decode_group: tuple[str, ...] = (),
    ) -> None:
        """``second_decode_group``: the nodes of a second decode group (``decode-1-<id>``), its pool ``second``."""
        self.router = FakeRouter(decide)
        self.prefill = FakePrefillPool()
        self.decode = FakeDecodePool(decode_nodes)
        self.second = FakeDecodePool(second_decode_group)
        decode = [self.decode, self.second] if second_decode_group else [self.decode]
        pools = NodeGroups([self.prefill]), NodeGroups(decode)  # type: ignore[arg-type, list-item]
        self.dispatcher = Dispatcher([self.router], *pools, limits, IngressMetrics(), "ingress-1")  # type: ignore[list-item]


def request(request_id: int = 1, prompt_tokens: int = 64, max_tokens: int = 4, **fields: Any) -> EngineRequest:
    """A request with token ids, arrived now."""
    ids = tuple(range(prompt_tokens))
    return EngineRequest(request_id, prompt_tokens, max_tokens, time.time(), prompt_token_ids=ids, **fields)


async def until(condition: Callable[[], bool], within_s: float = 10.0) -> None:
    """Wait, turn by turn of the event loop, until ``condition()`` holds (fails past ``within_s``)."""
    async with asyncio.timeout(within_s):
        while not condition():
            await asyncio.sleep(0.001)
