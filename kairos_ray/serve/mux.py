"""Token streams multiplexed per (decode node, ingress replica): one streamed item per batch of ready tokens.

A Serve streaming call costs a message, and its CPU, per item. Streaming
each request's tokens as its own call costs one per token and per request;
here every ingress replica holds one subscription per decode node it uses
(``EngineServer.subscribe``), and the node sends on it, whenever the
ingress takes the next item, every token ready for every request of that
ingress: one message per step rather than one per token per request. It
never waits to batch: an item goes as soon as the ingress asks for one and
something is ready. A subscription ends once nothing of its listener runs
on the node (an open call would keep the replica from draining); the
ingress subscribes again with its next request there.

- ``Outbox`` (decode node): per listener (an ingress replica), the tokens and
  failures of its requests since its last item.
- ``TokenMux`` (ingress replica): its subscriptions, and per request a queue
  that ``serve.dispatch`` reads. Tokens that arrive before their request's
  queue opens wait for it. A subscription that breaks (its replica died)
  fails every request it carried, which then migrate (``serve.dispatch``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import cast

from ray.serve.handle import DeploymentResponseGenerator

from kairos_ray.messages import TokenBatch, TokenEvent
from kairos_ray.serve.delivery import NodeGroups, apart

logger = logging.getLogger("ray.serve")

RequestKey = tuple[int, int]
"""(request id, attempt): a request's run on one node."""


class StreamFailed(RuntimeError):
    """The request's run on its decode node failed, or the subscription carrying its tokens broke."""


class Outbox:
    """A decode node's tokens for one ingress replica, waiting for its next ``take``."""

    def __init__(self) -> None:
        self.runs: set[RequestKey] = set()  # requests of this listener running on the node
        self.subscribed = False  # its listener has subscribed (an outbox never subscribed to is dropped in time)
        self._tokens: dict[RequestKey, list[TokenEvent]] = {}
        self._failed: dict[RequestKey, str] = {}
        self._ready = asyncio.Event()

    def put(self, key: RequestKey, tokens: list[TokenEvent]) -> None:
        self._tokens.setdefault(key, []).extend(tokens)
        self._ready.set()

    def fail(self, key: RequestKey, why: str) -> None:
        self._failed[key] = why
        self._ready.set()

    async def take(self, idle_s: float) -> TokenBatch | None:
        """Everything ready since the last ``take`` (waits until something is); None once idle.

        Idle: nothing came for ``idle_s`` and no request of the listener runs here.
        """
        while not self._ready.is_set():
            try:
                async with asyncio.timeout(idle_s):
                    await self._ready.wait()
            except TimeoutError:  # tokens put as the wait timed out are still taken
                if not self.runs and not self._ready.is_set():
                    return None
        self._ready.clear()
        batch = TokenBatch(self._tokens, self._failed)
        self._tokens, self._failed = {}, {}
        return batch


class TokenMux:
    """An ingress replica's subscriptions to the decode nodes, and a queue per request it streams."""

    def __init__(self, decode: NodeGroups, listener: str) -> None:
        self.decode, self.listener = decode, listener
        self._subscriptions: dict[str, asyncio.Task[None]] = {}  # node -> the task reading its subscription
        self._queues: dict[RequestKey, asyncio.Queue[list[TokenEvent] | StreamFailed]] = {}
        self._nodes: dict[RequestKey, str] = {}  # request -> the node it runs on
        self._early: dict[RequestKey, list[list[TokenEvent] | StreamFailed]] = {}  # expected, queue not open yet

    def subscribe(self, node: str) -> None:
        """Read ``node``'s tokens for this replica, if not already."""
        if node not in self._subscriptions:
            task = asyncio.get_running_loop().create_task(self._read(node))
            self._subscriptions[node] = task

    def expect(self, key: RequestKey) -> None:
        """A request is about to start on some node: keep what arrives for it until its queue opens."""
        self._early.setdefault(key, [])

    def open(self, key: RequestKey, node: str) -> asyncio.Queue[list[TokenEvent] | StreamFailed]:
        """The queue of a request running on ``node``: lists of tokens, or a ``StreamFailed``."""
        queue: asyncio.Queue[list[TokenEvent] | StreamFailed] = asyncio.Queue()
        for item in self._early.pop(key, ()):
            queue.put_nowait(item)
        self._queues[key], self._nodes[key] = queue, node
        self.subscribe(node)
        return queue

    def close(self, key: RequestKey) -> None:
        self._queues.pop(key, None)
        self._nodes.pop(key, None)
        self._early.pop(key, None)

    def residue(self) -> dict[str, int]:
        """Entries kept per request: all 0 once no request runs here (nothing grows with requests served)."""
        return {"mux_queues": len(self._queues), "mux_nodes": len(self._nodes), "mux_early": len(self._early)}

    def _deliver(self, key: RequestKey, item: list[TokenEvent] | StreamFailed) -> None:
        queue = self._queues.get(key)
        if queue is not None:
            queue.put_nowait(item)
        elif key in self._early:  # its start call has not returned yet
            self._early[key].append(item)
        # else: the request has ended here (its client went away); what was in flight is dropped

    async def _read(self, node: str) -> None:
        why = "ended"
        try:
            # By value over Serve's gRPC transport (a batch holds no object refs): an item costs a fraction of the
            # CPU of a Ray streaming-generator item on both ends.
            subscribe = self.decode.of(node).options(stream=True, _by_reference=False).subscribe.remote
            stream = cast(DeploymentResponseGenerator[TokenBatch], apart(subscribe, self.listener, node=node))
            async for batch in stream:
                for key, tokens in batch.tokens.items():
                    self._deliver(key, tokens)
                for key, failure in batch.failed.items():
                    self._deliver(key, StreamFailed(failure))
        except Exception as exc:  # the node's replica died or refused: its requests move on
            why = f"broke: {type(exc).__name__}"
            logger.warning("token subscription to %s broke (%s: %s)", node, type(exc).__name__, exc)
        finally:  # cancelled too (the replica is closing): then nothing more is done for the node
            self._subscriptions.pop(node, None)
        waiting = [k for k, n in self._nodes.items() if n == node]
        if why == "ended" and waiting:  # it went idle as a request started there: listen again
            self.subscribe(node)
        else:
            for key in waiting:  # nothing more comes for them
                self._deliver(key, StreamFailed(f"the token subscription to {node} {why}"))
