"""A caller's link to the router: the ``RouterActor``'s handle, fetched through the ``Router`` deployment.

Decisions and reports go to the router over its TCP line (``serve.wire``),
or as plain Ray actor calls where that line cannot be opened (a firewall
between the nodes: logged once per actor). The link asks the ``Router``
replica for the actor's handle the first time it is needed (within
``fetch_timeout_s``), then the actor for its line's address, and does both
again after a call failed: a dead actor (its replica was replaced) closes
its connection, or raises ``RayActorError``, at once, and the next call
fetches the new one's handle, which Serve answers once the new replica is
up. A hung actor makes calls time out at the caller's deadline; the
replica's health check then replaces it, and the calls fail fast from there
on.

Reports are fire and forget (``report``), sent in order: those made while
the link is down wait, in order, until the handle comes (the last
``UNSENT_REPORTS`` of them: a prefix-cache delta lost beyond that makes the
router drop that node's mirror until its next full delta).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from ray import ObjectRef
from ray.serve.handle import DeploymentHandle

from kairos_ray.messages import DecisionRequest, NodeState, RoutingReply, WireAddress
from kairos_ray.serve.types import LineOff
from kairos_ray.serve.wire import Answered, WireClient

if TYPE_CHECKING:
    from concurrent.futures import Future

logger = logging.getLogger("ray.serve")

RouterHandle = Any
"""A Ray actor handle to ``serve.router.RouterActor`` (Ray's handles are not typed by their class)."""

UNSENT_REPORTS = 1024  # reports kept while the link is down (each carries its prefix-cache delta)
FETCH_TIMEOUT_S = 30.0  # how long asking the Router replica for its actor's handle may take (a replica starting)
CONNECT_TIMEOUT_S = 5.0  # how long opening the actor's TCP line may take before the link uses Ray calls


class RouterLink:
    """The ``RouterActor``'s handle for one process, with what to do when it fails."""

    def __init__(self, router: DeploymentHandle[Any], fetch_timeout_s: float = FETCH_TIMEOUT_S) -> None:
        self.router = router
        self.fetch_timeout_s = fetch_timeout_s
        self._actor: RouterHandle | None = None
        self._wire: WireClient | None = None  # the actor's TCP line; None: Ray calls
        self._fetching: asyncio.Task[RouterHandle] | None = None
        self._unsent: deque[NodeState] = deque(maxlen=UNSENT_REPORTS)  # reports made while the link was down
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deciding: set[asyncio.Task[list[RoutingReply]]] = set()  # decisions asked over Ray calls
        self._in_flight: deque[ObjectRef[None]] = deque(maxlen=32)  # the last reports stay referenced while sent

    async def actor(self) -> RouterHandle:
        """The actor's handle, asking the ``Router`` replica for it when there is none (one question at a time)."""
        if self._actor is not None:
            return self._actor
        if self._fetching is None or self._fetching.done():
            self._fetching = asyncio.get_running_loop().create_task(self._fetch())
        return await asyncio.shield(self._fetching)

    async def _fetch(self) -> RouterHandle:
        actor: RouterHandle = await asyncio.wait_for(self.router.handle.remote(), self.fetch_timeout_s)
        self._wire = await self._connect(actor)
        self._actor = actor
        while self._unsent:
            self._send(actor, self._unsent.popleft())
        return actor

    async def _connect(self, actor: RouterHandle) -> WireClient | None:
        try:
            address: WireAddress = await asyncio.wait_for(actor.wire.remote(), self.fetch_timeout_s)
            return await WireClient.connect(address, CONNECT_TIMEOUT_S)
        except LineOff:  # the app chose Ray calls
            return None
        except Exception as exc:  # a firewall between the nodes, or the actor died meanwhile: Ray calls
            logger.warning("router's TCP line unavailable (%s: %s); using Ray actor calls", type(exc).__name__, exc)
            return None

    def lost(self, actor: RouterHandle) -> None:
        """A call on ``actor`` failed: the next call asks for the handle again (unless it was asked already)."""
        if self._actor is actor:
            self._actor = None
            if self._wire is not None:
                self._wire.close()
                self._wire = None

    async def _fetched_then_decided(self, requests: list[DecisionRequest]) -> list[RoutingReply]:
        """The replies once the handle (and the line, where it opens) has been fetched."""
        actor = await self.actor()
        wire = self._wire
        try:
            if wire is not None:
                replies: list[RoutingReply] = await wire.call("decide_many", requests)
            else:
                replies = await actor.decide_many.remote(requests)
        except Exception:
            self.lost(actor)
            raise
        return replies

    def decide_then(self, requests: list[DecisionRequest], answered: Answered, timeout_s: float) -> None:
        """Ask for ``requests``' replies; ``answered`` runs once, with them or with what failed the call (its
        deadline, ``timeout_s``, included). Over the line the call leaves at once and ``answered`` runs in
        the turn of the loop that reads the reply; otherwise the handle is fetched and the call made in a task.
        The link's one way to decide (``decide`` awaits it)."""
        loop = asyncio.get_running_loop()
        actor, wire = self._actor, self._wire
        if actor is None or wire is None or wire.closed:
            task = loop.create_task(asyncio.wait_for(self._fetched_then_decided(requests), timeout_s))
            self._deciding.add(task)
            task.add_done_callback(functools.partial(_task_answered, answered))
            task.add_done_callback(self._deciding.discard)
            return

        def replied(replies: Any, error: BaseException | None) -> None:
            deadline.cancel()
            if error is not None:
                self.lost(actor)
            answered(replies, error)

        def expired() -> None:
            wire.forget(call_id)
            answered(None, TimeoutError(f"the router did not answer within {timeout_s:g} s"))

        deadline = loop.call_later(timeout_s, expired)
        call_id = wire.submit("decide_many", requests, replied)

    async def decide(self, requests: list[DecisionRequest], timeout_s: float) -> list[RoutingReply]:
        """``decide_then``, awaited: the replies, or what failed the call raised."""
        answer: asyncio.Future[list[RoutingReply]] = asyncio.get_running_loop().create_future()

        def answered(replies: Any, error: BaseException | None) -> None:
            if not answer.done():
                answer.set_result(replies) if error is None else answer.set_exception(error)

        self.decide_then(requests, answered, timeout_s)
        return await answer

    def report(self, state: NodeState) -> None:
        """Send a node's state without waiting; while the link is down, keep it and fetch the handle.

        Call from the event loop the link was first used on, or from any
        thread once ``bind`` named that loop.
        """
        loop = self._loop or asyncio.get_running_loop()
        if self._loop is not None and not _running(self._loop):
            loop.call_soon_threadsafe(self.report, state)  # the line is the loop's: send from it, in order
            return
        if self._actor is not None and self._wire is not None and self._wire.closed:
            self.lost(self._actor)  # its actor died: keep the report for the next one
        if self._actor is not None:
            self._send(self._actor, state)
            return
        self._unsent.append(state)
        loop.call_soon_threadsafe(self.prefetch)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop that fetches the handle for reports made from other threads."""
        self._loop = loop

    def prefetch(self) -> None:
        """Fetch the handle and open the line in the background, unless there are or a fetch is under way.

        An ingress calls it as it starts, so that its first decision does not
        wait for them (a first Serve call to the ``Router`` deployment, a Ray
        call and a connection, together far longer than a decision). Call it
        on the loop the link is used on.
        """
        if self._actor is None and (self._fetching is None or self._fetching.done()):
            self._fetching = asyncio.get_running_loop().create_task(self._fetch())
            self._fetching.add_done_callback(_log_failed_fetch)

    def _send(self, actor: RouterHandle, state: NodeState) -> None:
        if self._wire is not None:
            self._wire.send("report", state)
            return

        def sent(future: Future[Any]) -> None:
            if future.exception() is not None:
                self.lost(actor)

        sending: ObjectRef[None] = actor.report.remote(state)
        sending.future().add_done_callback(sent)
        self._in_flight.append(sending)


def _task_answered(answered: Answered, task: asyncio.Task[list[RoutingReply]]) -> None:
    if task.cancelled():  # its loop is closing
        answered(None, RuntimeError("the call to the router was cancelled"))
    elif (failure := task.exception()) is not None:
        answered(None, failure)
    else:
        answered(task.result(), None)


def _running(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether this thread runs ``loop``."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _log_failed_fetch(task: asyncio.Task[RouterHandle]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("could not reach the router (%s); the next call or report tries again", task.exception())
