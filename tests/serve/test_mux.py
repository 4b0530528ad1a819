"""Token streams multiplexed per decode node: a node's outbox, and the ingress's mux of subscriptions and queues."""

import asyncio

from kairos_ray.messages import TokenBatch, TokenEvent
from kairos_ray.serve.delivery import NodeGroups
from kairos_ray.serve.mux import Outbox, StreamFailed, TokenMux
from tests.serve.fakes import until


def tokens(first: int, count: int) -> list[TokenEvent]:
    return [TokenEvent(i, i, False, "decode-0") for i in range(first, first + count)]


def test_what_is_ready_goes_in_one_item_and_a_take_waits_for_something():
    async def scenario():
        box = Outbox()
        box.put((1, 0), tokens(0, 2))
        box.put((2, 0), tokens(0, 1))
        box.put((1, 0), tokens(2, 1))
        box.fail((3, 0), "EngineUnhealthy: stalled")
        first = await box.take(60)
        waiting = asyncio.ensure_future(box.take(60))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # nothing ready: the next item waits
        box.put((2, 0), tokens(1, 1))
        second = await asyncio.wait_for(waiting, 5)
        return first, second

    first, second = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert [e.index for e in first.tokens[(1, 0)]] == [0, 1, 2] and len(first.tokens[(2, 0)]) == 1
    assert first.failed == {(3, 0): "EngineUnhealthy: stalled"}
    assert list(second.tokens) == [(2, 0)] and second.failed == {}


def test_an_outbox_goes_idle_only_when_nothing_runs_for_its_listener():
    async def scenario():
        box = Outbox()
        box.runs.add((1, 0))
        running = asyncio.ensure_future(box.take(0.05))
        await asyncio.sleep(0.3)
        assert not running.done()  # a request runs: its subscription stays open however long it is quiet
        box.put((1, 0), tokens(0, 1))
        box.runs.discard((1, 0))
        last = await asyncio.wait_for(running, 5)
        idle = await asyncio.wait_for(box.take(0.05), 5)
        return last, idle

    last, idle = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert list(last.tokens) == [(1, 0)] and idle is None


class Node:
    """A decode pool whose subscriptions the test feeds: ``feed(node)`` is what ``subscribe`` streams from."""

    def __init__(self) -> None:
        self.feeds: dict[str, asyncio.Queue] = {}
        self.subscriptions = 0

    def options(self, **_):
        return self

    @property
    def subscribe(self):
        return self

    def remote(self, listener: str, node: str):
        self.subscriptions += 1
        return self._stream(node)

    def feed(self, node: str) -> asyncio.Queue:
        return self.feeds.setdefault(node, asyncio.Queue())

    async def _stream(self, node: str):
        feed = self.feed(node)
        while (item := await feed.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item


def batch(key, first, count) -> TokenBatch:
    return TokenBatch({key: tokens(first, count)}, {})


def test_tokens_that_come_before_their_queue_opens_wait_for_it_in_order():
    async def scenario():
        pool = Node()
        mux = TokenMux(NodeGroups([pool]), "ingress-1")  # type: ignore[list-item]
        mux.expect((7, 0))
        mux.subscribe("decode-0")
        pool.feed("decode-0").put_nowait(batch((7, 0), 0, 2))
        pool.feed("decode-0").put_nowait(batch((7, 0), 2, 1))
        await until(lambda: pool.feed("decode-0").empty())
        queue = mux.open((7, 0), "decode-0")
        got = [await queue.get(), await queue.get()]
        mux.close((7, 0))
        return got, mux.residue()

    got, residue = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert [[e.index for e in item] for item in got] == [[0, 1], [2]]
    assert residue == {"mux_queues": 0, "mux_nodes": 0, "mux_early": 0}


def test_a_broken_subscription_fails_every_request_it_carried_and_nothing_else():
    async def scenario():
        pool = Node()
        mux = TokenMux(NodeGroups([pool]), "ingress-1")  # type: ignore[list-item]
        on_a, also_on_a, on_b = mux.open((1, 0), "decode-a"), mux.open((2, 0), "decode-a"), mux.open((3, 0), "decode-b")
        pool.feed("decode-a").put_nowait(ConnectionError("replica died"))
        failed = [await asyncio.wait_for(q.get(), 5) for q in (on_a, also_on_a)]
        await asyncio.sleep(0)
        return failed, on_b.empty(), "decode-a" in mux._subscriptions

    failed, untouched, still_subscribed = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert all(isinstance(f, StreamFailed) and "decode-a broke" in str(f) for f in failed)
    assert untouched and not still_subscribed


def test_an_idle_subscription_ends_and_comes_back_only_while_a_request_waits_on_its_node():
    async def scenario():
        pool = Node()
        mux = TokenMux(NodeGroups([pool]), "ingress-1")  # type: ignore[list-item]
        mux.open((1, 0), "decode-a")
        pool.feed("decode-a").put_nowait(None)  # the node ended it, idle, as the request started
        await until(lambda: pool.subscriptions == 2)  # the request waits there: listened to again
        mux.close((1, 0))
        pool.feed("decode-a").put_nowait(None)
        await until(lambda: "decode-a" not in mux._subscriptions)
        await asyncio.sleep(0.05)
        return pool.subscriptions

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) == 2  # no request left there: no new subscription


def test_what_comes_for_a_request_that_ended_here_is_dropped_not_kept():
    async def scenario():
        pool = Node()
        mux = TokenMux(NodeGroups([pool]), "ingress-1")  # type: ignore[list-item]
        mux.open((1, 0), "decode-a")
        mux.close((1, 0))  # its client went away
        pool.feed("decode-a").put_nowait(batch((1, 0), 5, 3))
        await until(lambda: pool.feed("decode-a").empty())
        await asyncio.sleep(0)
        return mux.residue()

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) == {"mux_queues": 0, "mux_nodes": 0, "mux_early": 0}
