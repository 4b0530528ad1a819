"""``serve.wire``: the router's TCP line, between two real asyncio endpoints on 127.0.0.1."""

import asyncio
import pickle
import struct

import pytest

from kairos_ray.messages import WireAddress, WireCall
from kairos_ray.serve.wire import MAX_FRAME_BYTES, WireClient, WireClosed, WireServer

LOOPS = ["asyncio", "uvloop"]  # Serve's replicas run uvloop, whose transports are not asyncio's classes


@pytest.fixture(params=LOOPS)
def run(request):
    """Runs a coroutine on a fresh event loop of each kind."""
    if request.param == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return lambda coroutine: uvloop.run(asyncio.wait_for(coroutine, 30))
    return lambda coroutine: asyncio.run(asyncio.wait_for(coroutine, 30))


class Recorder:
    """Handlers that record what they were called with, in order."""

    def __init__(self):
        self.calls = []

    def handlers(self):
        def add(pair):
            self.calls.append(("add", pair))
            return pair[0] + pair[1]

        def note(value):
            self.calls.append(("note", value))

        def fail(_):
            raise ValueError("no such node")

        return {"add": add, "note": note, "fail": fail}


def test_calls_are_answered_by_id_and_one_way_sends_run_in_order_before_later_calls(run):
    recorder = Recorder()

    async def main():
        server = WireServer(recorder.handlers())
        client = await WireClient.connect(await server.open("127.0.0.1"), 5)
        client.send("note", "first")
        results = await asyncio.gather(*(client.call("add", (i, 10 * i)) for i in range(20)))
        client.send("note", "last")
        assert await client.call("add", (1, 1)) == 2
        client.close()
        server.close()
        return results

    assert run(main()) == [11 * i for i in range(20)]
    assert recorder.calls[0] == ("note", "first") and recorder.calls[-2] == ("note", "last")
    assert [value for name, value in recorder.calls if name == "add"][:20] == [(i, 10 * i) for i in range(20)]


def test_a_handler_s_error_comes_back_to_its_caller_and_the_line_stays_up(run):
    async def main():
        server = WireServer(Recorder().handlers())
        client = await WireClient.connect(await server.open("127.0.0.1"), 5)
        with pytest.raises(RuntimeError, match="ValueError: no such node"):
            await client.call("fail", None)
        with pytest.raises(RuntimeError, match="no method 'missing'"):
            await client.call("missing", None)
        assert await client.call("add", (2, 3)) == 5 and not client.closed
        client.close()
        server.close()

    run(main())


async def raw_connection(address, first_bytes):
    reader, writer = await asyncio.open_connection(address.host, address.port)
    writer.write(first_bytes)
    return reader, writer


def test_nothing_is_unpickled_before_the_caller_sends_the_secret(run):
    recorder = Recorder()

    async def main():
        server = WireServer(recorder.handlers())
        address = await server.open("127.0.0.1")
        body = pickle.dumps(WireCall(1, "note", "from a stranger"))
        reader, writer = await raw_connection(address, b"x" * len(address.secret) + struct.pack("!I", len(body)) + body)
        assert await reader.read() == b""  # closed without an answer
        writer.close()
        server.close()

    run(main())
    assert recorder.calls == []


def test_a_frame_longer_than_the_limit_closes_the_connection_unread(run):
    async def main():
        server = WireServer(Recorder().handlers())
        address = await server.open("127.0.0.1")
        reader, writer = await raw_connection(address, address.secret + struct.pack("!I", MAX_FRAME_BYTES + 1))
        assert await reader.read() == b""
        writer.close()
        server.close()

    run(main())


def test_a_call_waiting_when_the_peer_goes_fails_at_once(run):
    async def main():
        accepted = asyncio.Event()

        async def swallow_then_hang_up(reader, writer):
            await reader.read(1)  # takes the call, never answers
            accepted.set()
            await asyncio.sleep(0.2)
            writer.close()

        server = await asyncio.start_server(swallow_then_hang_up, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = await WireClient.connect(WireAddress("127.0.0.1", port, b"s" * 32), 5)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(WireClosed, match="closed"):
            await client.call("add", (1, 2))
        assert loop.time() - start < 5 and client.closed
        with pytest.raises(WireClosed):
            await client.call("add", (1, 2))  # and every later one, until the link reconnects
        server.close()

    run(main())


def test_connecting_where_nothing_listens_fails_with_the_address(run):
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        with pytest.raises(WireClosed, match=f"127.0.0.1:{port}"):
            await WireClient.connect(WireAddress("127.0.0.1", port, b"s" * 32), 5)

    run(main())


def test_a_call_given_up_on_is_not_answered_and_a_closed_line_answers_at_once(run):
    async def main():
        server = WireServer(Recorder().handlers())
        client = await WireClient.connect(await server.open("127.0.0.1"), 5)
        answers = []
        forgotten = client.submit("add", (1, 1), lambda result, error: answers.append(("forgotten", result)))
        client.forget(forgotten)
        assert await client.call("add", (2, 2)) == 4  # answered after the forgotten one: that one's reply came
        client.close()
        client.submit("add", (3, 3), lambda result, error: answers.append(("after close", type(error))))
        server.close()
        return answers

    assert run(main()) == [("after close", WireClosed)]
