"""``serve.wire``: the router's TCP line, between two real asyncio endpoints on 127.0.0.1."""

import asyncio
import dataclasses
import hmac
import os
import pickle

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kairos_ray.core import CacheDelta, Decision, DecodeNodeView, PrefillNodeView, Route, StepLatencyModel
from kairos_ray.messages import DecisionRequest, NodeState, PrefixDelta, RoutingReply, StepRecord, WireAddress
from kairos_ray.serve import wire
from kairos_ray.serve.wire import (
    _HEADER,
    MAGIC,
    MAX_FRAME_BYTES,
    METHODS,
    NONCE_BYTES,
    WireClient,
    WireClosed,
    WireServer,
    prove_caller,
)

LOOPS = ["asyncio", "uvloop"]  # Serve's replicas run uvloop, whose transports are not asyncio's classes
DECIDE_MANY, REPORT = METHODS  # the line's two methods, in code order
DECIDE_MANY_CODE, REPORT_CODE = range(len(METHODS))
HELLO_BYTES = len(MAGIC) + NONCE_BYTES

PREFILL_VIEW = PrefillNodeView("prefill-0", (800, 1200), 256, (64, 0))
DECODE_VIEW = DecodeNodeView("decode-0", 7, 9000, 20000, ((512, 256), (128,)), 64, (32, 0), 2, 3000)
REQUEST = DecisionRequest(1 << 40, 2048, 256, ("decode-1",), {16: (1, 2**64 - 1), 32: (5,)})
REPLY = RoutingReply(
    Decision(Route.DEFLECT, "prefill-0", "decode-0", (512, 256), 0.25, 0.125, "deflect: cheaper", 64, 32),
    1.5e-4,
    0.02,
    fallback=True,
    block_tokens=(16, 32),
    decode_model=StepLatencyModel(0.01, 1e-4, 2e-8, 3e-6, 1e-11, 2e-10, 3e-9, 7e-7, 1e-7, tile_tokens=16),
)


def full_state(view):
    """A report with every optional part filled."""
    return NodeState(
        view,
        "ray-node-a",
        1.7e9,
        (StepRecord(7, 9000, 512, 0.031, 0.029, 128), StepRecord(8, 9600, 0, 0.02, 0.021)),
        (3, 1 << 40),
        num_waiting=2,
        pinned_kv=1,
        kv_recomputes=4,
        kv_usage=0.375,
        healthy=False,
        prefix=PrefixDelta(16, 5, CacheDelta(False, (b"\x01" * 32, 2**64 - 1), (7,))),
    )


STATE = full_state(DECODE_VIEW)


@pytest.fixture(params=LOOPS)
def run(request):
    """Runs a coroutine on a fresh event loop of each kind."""
    if request.param == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return lambda coroutine: uvloop.run(asyncio.wait_for(coroutine, 30))
    return lambda coroutine: asyncio.run(asyncio.wait_for(coroutine, 30))


@pytest.fixture
def decodes(monkeypatch):
    """Every body the line decodes, in order (on either end)."""
    seen = []
    decode = wire.Body.decode

    def counted(body, data):
        seen.append(bytes(data))
        return decode(body, data)

    monkeypatch.setattr(wire.Body, "decode", counted)
    return seen


def reply_for(request):
    return RoutingReply(Decision(Route.PREFILL, None, None, (), None, None, f"for {request.request_id}"), 0.0, 0.0)


class Recorder:
    """Handlers of the line's two methods that record what they were called with, in order."""

    def __init__(self):
        self.calls = []

    def handlers(self):
        def decide_many(requests):
            self.calls.append(("decide_many", requests))
            return [reply_for(r) for r in requests]

        def report(state):
            self.calls.append(("report", state))

        return {"decide_many": decide_many, "report": report}


def encoded(body, value):
    """``value`` as the line's frames carry it (without the header)."""
    frame = bytearray()
    body.encode_into(value, frame)
    return bytes(frame)


def through(body, value):
    """``value`` encoded and decoded as the line carries it."""
    return body.decode(encoded(body, value))


def raw_frame(call_id, code, body_bytes):
    return _HEADER.pack(len(body_bytes), call_id, code) + body_bytes


def client_proof(secret, hello, nonce):
    """The caller's answer to a server's hello, as the module's docstring specifies it."""
    return nonce + hmac.digest(secret, hello + nonce + b"client", "sha256")


async def read_to_close(reader):
    """What the peer sends until it closes (a reset, for unread bytes it dropped, is a close)."""
    try:
        return await asyncio.wait_for(reader.read(), 10)
    except ConnectionResetError:
        return b""


@pytest.mark.parametrize(
    ("body", "value"),
    [
        (DECIDE_MANY.argument, [REQUEST, DecisionRequest(2, 10, 1)]),
        (DECIDE_MANY.result, [REPLY, RoutingReply.fallback_for("no decode node has reported")]),
        (REPORT.argument, STATE),
        (REPORT.argument, full_state(PREFILL_VIEW)),
        (REPORT.argument, NodeState(DECODE_VIEW, "ray-node-b", 2.0)),
        (REPORT.result, None),
    ],
    ids=["requests", "replies", "decode-report", "prefill-report", "bare-report", "no-result"],
)
def test_the_real_messages_come_back_equal_and_of_their_own_types(body, value):
    back = through(body, value)
    assert back == value  # a dataclass equals only one of its own class: each view comes back as its kind
    if isinstance(value, NodeState) and isinstance(value.view, DecodeNodeView):
        assert back.view.committed_tokens == value.view.committed_tokens


ints = st.integers(-(2**63), 2**63 - 1)
int_tuples = st.lists(ints, max_size=4).map(tuple)
floats = st.floats(allow_nan=False)
texts = st.text(max_size=8)
block_hashes = st.lists(st.one_of(st.binary(max_size=32), st.integers(0, 2**64 - 1)), max_size=4).map(tuple)
views = st.one_of(
    st.builds(PrefillNodeView, texts, int_tuples, ints, int_tuples),
    st.builds(
        DecodeNodeView, texts, ints, ints, ints, st.lists(int_tuples, max_size=3).map(tuple), ints, int_tuples, ints
    ),
)
states = st.builds(
    NodeState,
    views,
    texts,
    floats,
    st.lists(st.builds(StepRecord, ints, ints, ints, floats, floats, ints), max_size=3).map(tuple),
    int_tuples,
    ints,
    ints,
    ints,
    floats,
    st.booleans(),
    st.none() | st.builds(PrefixDelta, ints, ints, st.builds(CacheDelta, st.booleans(), block_hashes, block_hashes)),
)
requests = st.builds(
    DecisionRequest,
    ints,
    ints,
    ints,
    st.lists(texts, max_size=3).map(tuple),
    st.dictionaries(ints, st.lists(st.integers(0, 2**64 - 1), max_size=4).map(tuple), max_size=3),
)
decisions = st.builds(
    Decision,
    st.sampled_from(Route),
    st.none() | texts,
    st.none() | texts,
    int_tuples,
    st.none() | floats,
    st.none() | floats,
    texts,
    ints,
    ints,
)
models = st.builds(StepLatencyModel, *([floats] * 9), tile_tokens=st.integers(1, 512))
replies = st.builds(RoutingReply, decisions, floats, floats, st.booleans(), int_tuples, st.none() | models)


@given(states, st.lists(requests, max_size=4), st.lists(replies, max_size=4))
def test_any_report_batch_and_reply_comes_back_equal(state, batch, answers):
    assert through(REPORT.argument, state) == state
    assert through(DECIDE_MANY.argument, batch) == batch
    assert through(DECIDE_MANY.result, answers) == answers


def test_calls_are_answered_by_id_and_one_way_sends_run_in_order_before_later_calls(run):
    recorder = Recorder()
    first, last = full_state(PREFILL_VIEW), STATE

    async def main():
        server = WireServer(recorder.handlers())
        client = await WireClient.connect(await server.open("127.0.0.1"), 5)
        client.send("report", first)
        batches = [[DecisionRequest(i, 100, 1), DecisionRequest(1000 + i, 100, 1)] for i in range(20)]
        results = await asyncio.gather(*(client.call("decide_many", batch) for batch in batches))
        client.send("report", last)
        assert await client.call("decide_many", [REQUEST]) == [reply_for(REQUEST)]
        client.close()
        server.close()
        return batches, results

    batches, results = run(main())
    assert results == [[reply_for(r) for r in batch] for batch in batches]
    assert recorder.calls[0] == ("report", first) and recorder.calls[-2] == ("report", last)
    assert [value for name, value in recorder.calls if name == "decide_many"][:20] == batches


def test_a_handler_s_error_comes_back_to_its_caller_and_the_line_stays_up(run):
    def fail(_):
        raise ValueError("no such node")

    async def main():
        server = WireServer({"decide_many": fail})
        client = await WireClient.connect(await server.open("127.0.0.1"), 5)
        with pytest.raises(RuntimeError, match="ValueError: no such node"):
            await client.call("decide_many", [REQUEST])
        with pytest.raises(RuntimeError, match="no method 'report' on this line"):
            await client.call("report", STATE)
        with pytest.raises(RuntimeError, match="ValueError: no such node"):
            await client.call("decide_many", [REQUEST])
        assert not client.closed
        client.close()
        server.close()

    run(main())


def test_a_method_the_line_does_not_have_is_refused_before_anything_is_sent(run):
    with pytest.raises(ValueError, match="no method \\['add'\\]"):
        WireServer({"add": lambda pair: sum(pair)})

    async def main():
        server = WireServer(Recorder().handlers())
        client = await WireClient.connect(await server.open("127.0.0.1"), 5)
        with pytest.raises(ValueError, match="no method 'add' on the router's line"):
            await client.call("add", (1, 2))
        assert await client.call("decide_many", [REQUEST]) == [reply_for(REQUEST)]
        client.close()
        server.close()

    run(main())


@pytest.mark.parametrize("secret", ["none", "wrong", "right"])
def test_a_frame_is_decoded_only_after_the_caller_proved_it_holds_the_secret(run, decodes, secret):
    """A perfectly valid report, sent without the handshake's answer or with a wrong one, is never decoded, and
    the connection closes with nothing sent but the hello; after the right answer the same frame is handled."""
    recorder = Recorder()
    frame = raw_frame(0, REPORT_CODE, encoded(REPORT.argument, STATE))

    async def main():
        server = WireServer(recorder.handlers())
        address = await server.open("127.0.0.1")
        reader, writer = await asyncio.open_connection(address.host, address.port)
        hello = await reader.readexactly(HELLO_BYTES)
        nonce = os.urandom(NONCE_BYTES)
        if secret == "wrong":
            writer.write(client_proof(os.urandom(len(address.secret)), hello, nonce))
        elif secret == "right":
            writer.write(client_proof(address.secret, hello, nonce))
        writer.write(frame)
        writer.write_eof()
        rest = await read_to_close(reader)
        writer.close()
        server.close()
        return hmac.digest(address.secret, hello + nonce + b"server", "sha256"), rest

    server_proof, rest = run(main())
    if secret == "right":
        assert rest == server_proof and recorder.calls == [("report", STATE)]
    else:
        assert rest == b"" and recorder.calls == [] and decodes == []


def test_a_caller_that_does_not_answer_the_hello_in_time_is_closed(run, monkeypatch):
    monkeypatch.setattr(wire, "HELLO_TIMEOUT_S", 0.2)

    async def main():
        server = WireServer(Recorder().handlers())
        address = await server.open("127.0.0.1")
        reader, writer = await asyncio.open_connection(address.host, address.port)
        sent = await read_to_close(reader)  # within read_to_close's 10 s, not never
        writer.close()
        server.close()
        return sent

    sent = run(main())
    assert len(sent) == HELLO_BYTES and sent.startswith(MAGIC)


def test_a_client_with_the_wrong_secret_is_refused(run):
    recorder = Recorder()

    async def main():
        server = WireServer(recorder.handlers())
        address = await server.open("127.0.0.1")
        with pytest.raises(WireClosed, match="the handshake failed: the router closed the connection"):
            await WireClient.connect(dataclasses.replace(address, secret=os.urandom(len(address.secret))), 5)
        server.close()

    run(main())
    assert recorder.calls == []


@pytest.mark.parametrize("impostor", ["random-proof", "the-caller-s-own-proof", "another-version"])
def test_the_client_refuses_a_server_that_does_not_prove_it_holds_the_secret(run, impostor):
    """Whoever took the port: a proof made without the secret, the caller's own proof sent back (a reflection:
    each side's proof names its side), or a line of another version."""

    async def serve(reader, writer):
        hello = (b"KRW\x02" if impostor == "another-version" else MAGIC) + os.urandom(NONCE_BYTES)
        writer.write(hello)
        try:
            answer = await reader.readexactly(NONCE_BYTES + 32)
        except asyncio.IncompleteReadError:
            return  # the caller hung up at the hello
        writer.write(os.urandom(32) if impostor == "random-proof" else answer[NONCE_BYTES:])
        await reader.read()

    async def main():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(
            WireClosed,
            match=r"the handshake failed: the peer (did not prove it holds the router's secret|is not a router's line)",
        ):
            await WireClient.connect(WireAddress("127.0.0.1", port, os.urandom(32)), 5)
        server.close()

    run(main())


def test_the_secret_never_crosses_the_line_nor_shows_in_a_repr(run):
    """Every byte the client sends, through a proxy that records them, over a handshake, a call and a report."""
    recorder = Recorder()
    sent = bytearray()

    async def pipe(reader, writer, record):
        while data := await reader.read(1 << 16):
            record += data
            writer.write(data)
        writer.close()

    async def main():
        server = WireServer(recorder.handlers())
        address = await server.open("127.0.0.1")

        async def forward(reader, writer):
            up_reader, up_writer = await asyncio.open_connection(address.host, address.port)
            await asyncio.gather(pipe(reader, up_writer, sent), pipe(up_reader, writer, bytearray()))

        proxy = await asyncio.start_server(forward, "127.0.0.1", 0)
        through_proxy = WireAddress("127.0.0.1", proxy.sockets[0].getsockname()[1], address.secret)
        client = await WireClient.connect(through_proxy, 5)
        client.send("report", STATE)
        assert await client.call("decide_many", [REQUEST]) == [reply_for(REQUEST)]
        client.close()
        proxy.close()
        server.close()
        return address

    address = run(main())
    assert recorder.calls[0] == ("report", STATE) and len(sent) > 64 + len(encoded(REPORT.argument, STATE))
    assert address.secret not in sent
    for shown in (repr(address), str(address), f"{address}"):
        assert repr(address.secret) not in shown and address.secret.hex() not in shown and "secret" not in shown


@pytest.mark.parametrize(
    "frame",
    [
        raw_frame(1, DECIDE_MANY_CODE, encoded(REPORT.argument, STATE)),
        raw_frame(1, DECIDE_MANY_CODE, msgspec.msgpack.encode([{"request_id": 1, "prompt_tokens": 2}])),
        raw_frame(1, REPORT_CODE, msgspec.msgpack.encode(dataclasses.asdict(STATE))),
        raw_frame(1, REPORT_CODE, pickle.dumps(STATE)),
        raw_frame(1, REPORT_CODE, encoded(REPORT.argument, STATE)[:-1]),
        raw_frame(1, 200, encoded(DECIDE_MANY.argument, [REQUEST])),
        _HEADER.pack(MAX_FRAME_BYTES + 1, 1, DECIDE_MANY_CODE),
    ],
    ids=[
        "report-as-requests",
        "requests-missing-fields",
        "untagged-report",
        "pickle",
        "cut-short",
        "no-method",
        "long",
    ],
)
def test_a_call_that_is_not_its_method_s_type_closes_the_connection_unhandled(run, frame):
    recorder = Recorder()

    async def main():
        server = WireServer(recorder.handlers())
        client = await WireClient.connect(await server.open("127.0.0.1"), 5)
        client._write(frame)
        with pytest.raises(WireClosed):  # the call after it is never answered: the server closed the line
            await client.call("decide_many", [REQUEST])
        assert client.closed
        server.close()

    run(main())
    assert recorder.calls == []


@pytest.mark.parametrize("result", [None, [REQUEST], "replies"], ids=["none", "requests", "text"])
def test_a_reply_that_is_not_the_method_s_result_closes_the_connection_and_fails_every_call(run, result):
    async def main():
        server = WireServer({"decide_many": lambda requests: result})
        client = await WireClient.connect(await server.open("127.0.0.1"), 5)
        calls = [asyncio.ensure_future(client.call("decide_many", [REQUEST])) for _ in range(2)]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert client.closed
        server.close()
        return outcomes

    outcomes = run(main())
    assert [type(outcome) for outcome in outcomes] == [WireClosed, WireClosed]
    assert "does not decode" in str(outcomes[0])


@pytest.mark.parametrize(
    "header", [_HEADER.pack(MAX_FRAME_BYTES + 1, 1, wire.OK), _HEADER.pack(1, 1, 7)], ids=["long", "no-such-status"]
)
def test_a_reply_frame_too_long_or_of_no_status_closes_the_connection_unread(run, decodes, header):
    secret = os.urandom(32)

    async def main():
        async def answer_badly(reader, writer):
            assert await prove_caller(reader, writer, secret)
            await reader.readexactly(_HEADER.size)  # the call's header: answer it with this one
            writer.write(header + b"\xc0")
            await reader.read()

        server = await asyncio.start_server(answer_badly, "127.0.0.1", 0)
        client = await WireClient.connect(WireAddress("127.0.0.1", server.sockets[0].getsockname()[1], secret), 5)
        with pytest.raises(WireClosed, match="a reply of"):
            await client.call("decide_many", [REQUEST])
        assert client.closed
        server.close()

    run(main())
    assert decodes == []


def test_a_reply_is_answered_in_the_read_that_brings_it(run):
    """No loop turn between the socket and the caller: ``Answered`` runs inside ``data_received``."""

    class Watched(WireClient):
        reading = False

        def data_received(self, data):
            self.reading = True
            try:
                super().data_received(data)
            finally:
                self.reading = False

    async def main():
        server = WireServer(Recorder().handlers())
        client = await Watched.connect(await server.open("127.0.0.1"), 5)
        answered = asyncio.Event()
        seen = []

        def took(result, error):
            seen.append((client.reading, result, error))
            answered.set()

        client.submit("decide_many", [REQUEST], took)
        await answered.wait()
        client.close()
        server.close()
        return seen

    assert run(main()) == [(True, [reply_for(REQUEST)], None)]


def test_a_call_waiting_when_the_peer_goes_fails_at_once(run):
    secret = os.urandom(32)

    async def main():
        async def swallow_then_hang_up(reader, writer):
            assert await prove_caller(reader, writer, secret)
            await reader.read(1)  # takes the call, never answers
            await asyncio.sleep(0.2)
            writer.close()

        server = await asyncio.start_server(swallow_then_hang_up, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = await WireClient.connect(WireAddress("127.0.0.1", port, secret), 5)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(WireClosed, match="closed"):
            await client.call("decide_many", [REQUEST])
        assert loop.time() - start < 5 and client.closed
        with pytest.raises(WireClosed):
            await client.call("decide_many", [REQUEST])  # and every later one, until the link reconnects
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


def test_a_call_given_up_on_is_not_answered_nor_decoded_and_a_closed_line_answers_at_once(run, decodes):
    async def main():
        server = WireServer(Recorder().handlers())
        client = await WireClient.connect(await server.open("127.0.0.1"), 5)
        answers = []
        forgotten = client.submit("decide_many", [REQUEST], lambda result, error: answers.append(("forgotten", result)))
        client.forget(forgotten)
        batch = [DecisionRequest(2, 10, 1)]
        assert await client.call("decide_many", batch) == [reply_for(batch[0])]  # after the forgotten one's reply
        client.close()
        client.submit("decide_many", batch, lambda result, error: answers.append(("after close", type(error))))
        server.close()
        return answers

    assert run(main()) == [("after close", WireClosed)]
    replies = [body for body in decodes if body == encoded(DECIDE_MANY.result, [reply_for(REQUEST)])]
    assert replies == []  # the forgotten call's reply was skipped unread
