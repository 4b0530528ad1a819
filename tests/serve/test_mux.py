"""A decode node's outbox: one item carries every token ready for every request of a listener."""

import asyncio

from kairos_ray.messages import TokenEvent
from kairos_ray.serve.mux import Outbox


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

    first, second = asyncio.run(scenario())
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

    last, idle = asyncio.run(scenario())
    assert list(last.tokens) == [(1, 0)] and idle is None
