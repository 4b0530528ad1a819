"""A node's server (``serve.engine_server.EngineServer``) over a stand-in engine, without Serve: its runs and the
outboxes its listeners read, and what it keeps once they end."""

import asyncio

import pytest

from kairos_ray.messages import TokenEvent
from kairos_ray.serve import engine_server
from kairos_ray.serve.engine_server import EngineServer
from tests.serve.fakes import request, until

# Serve awaits a replica's async __del__ when it stops it; these stand-ins are only collected
pytestmark = pytest.mark.filterwarnings("ignore:coroutine 'EngineServer.__del__' was never awaited")


class Engine:
    """Streams ``count`` tokens per request, one per ``step_s``; records which runs were cancelled."""

    def __init__(self, count: int, step_s: float) -> None:
        self.count, self.step_s = count, step_s
        self.started: list[int] = []
        self.cancelled: list[int] = []

    def residue(self) -> dict[str, int]:
        return {}

    async def generate(self, req, handoff):
        self.started.append(req.request_id)
        try:
            for i in range(self.count):
                await asyncio.sleep(self.step_s)
                yield [TokenEvent(i, i, i == self.count - 1, "decode-x")]
        except asyncio.CancelledError:
            self.cancelled.append(req.request_id)
            raise


def server(engine: Engine):
    node = object.__new__(EngineServer.func_or_class)  # the class behind Serve's deployment
    node.node_id, node.engine, node._outboxes, node._runs = "decode-x", engine, {}, {}
    return node


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(engine_server, "SUBSCRIPTION_IDLE_S", 0.05)
    monkeypatch.setattr(engine_server, "UNCLAIMED_OUTBOX_S", 0.2)


def test_a_listener_reads_its_requests_tokens_and_nothing_is_kept_once_its_subscription_ends(quick):
    async def scenario():
        node = server(Engine(count=3, step_s=0.01))
        await node.start(request(1), None, "ingress-1")
        got = [batch async for batch in node.subscribe("ingress-1")]  # ends once idle
        return got, await node.residue()

    got, residue = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert [e.index for b in got for e in b.tokens[(1, 0)]] == [0, 1, 2]
    assert residue.counts["runs"] == 0 and residue.counts["outboxes"] == 0


def test_an_outbox_its_listener_never_reads_is_dropped_with_its_runs(quick):
    async def scenario():
        engine = Engine(count=1000, step_s=0.01)
        node = server(engine)
        await node.start(request(1), None, "gone-ingress")  # its ingress died before it subscribed
        await until(lambda: not node._outboxes and not node._runs, within_s=10)
        return engine.cancelled

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) == [1]


def test_a_subscription_that_ends_cancels_what_its_listener_still_runs_here(quick):
    async def scenario():
        engine = Engine(count=1000, step_s=0.01)
        node = server(engine)
        await node.start(request(1), None, "ingress-1")
        await until(lambda: engine.started)
        stream = node.subscribe("ingress-1")
        await anext(stream)
        await stream.aclose()  # the listener went away mid-stream
        await until(lambda: not node._runs)
        return engine.cancelled, node._outboxes

    cancelled, outboxes = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert cancelled == [1] and outboxes == {}


def test_cancel_stops_the_named_run_only():
    async def scenario():
        engine = Engine(count=1000, step_s=0.01)
        node = server(engine)
        await node.start(request(1), None, "ingress-1")
        await node.start(request(2), None, "ingress-1")
        await until(lambda: len(engine.started) == 2)
        await node.cancel(1, 0)
        await until(lambda: len(node._runs) == 1)
        for run in node._runs.values():
            run.cancel()
        return engine.cancelled[0], list(node._runs)

    first, _ = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert first == 1
