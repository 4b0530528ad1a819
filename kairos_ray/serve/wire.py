"""A direct TCP line to the router's actor, for the calls on every request's path (decisions, reports).

A plain Ray actor call's round trip crosses several threads on each side
(the caller's core worker, gRPC, the callee's core worker, its event loop),
and once the processes have idled for a few milliseconds it costs several
times what a message on an open TCP connection between two asyncio loops
costs (``docs/live-path-performance.md``). The router's actor opens a
``WireServer`` on its node's IP; a caller's ``RouterLink`` learns its
``WireAddress`` through the actor's Ray handle and keeps one ``WireClient``
connection to it.

A connection starts with a mutual challenge and response on the address's
secret, which only a holder of the actor's Ray handle can learn and which
never crosses the line itself:

1. the server sends ``MAGIC`` (the line's version) and a random nonce;
2. the caller answers with its own nonce and HMAC-SHA256(secret, the
   server's hello, its nonce, ``client``);
3. the server, once that matches, answers HMAC-SHA256(secret, the same,
   ``server``), which the caller checks in turn: it is talking to the router,
   not to whoever took the port.

A connection that has not proved itself within ``HELLO_TIMEOUT_S`` is closed
before any frame of it is read. Then each frame is a big-endian header (a
4-byte body length, an 8-byte call id, and a byte: the method's code in a
call, ``OK`` or ``FAILED`` in a reply) and a msgpack body that only the
method's own argument or result type may decode (``METHODS``: never an
arbitrary object, never a pickle). A body that does not decode, an unknown
method or a frame over ``MAX_FRAME_BYTES`` closes the connection.

A call waits for its reply at most the caller's deadline; a closed
connection fails every call waiting on it at once, and the link then
reconnects (``serve.router_link``). The client reads replies as an
``asyncio.Protocol`` and answers each call in the turn of the event loop
that read its reply: on a busy ingress loop every turn between the socket
and the caller costs a share of a millisecond.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import itertools
import logging
import operator
import secrets
import struct
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import msgspec

from kairos_ray.core import DecodeNodeView, PrefillNodeView
from kairos_ray.messages import DecisionRequest, NodeState, Role, RoutingReply, WireAddress

logger = logging.getLogger("ray.serve")

SECRET_BYTES = 32
NONCE_BYTES = 32
MAGIC = b"KRW\x01"  # a router's line, version 1: the server's first bytes (a caller of another version hangs up)
MAX_FRAME_BYTES = 64 << 20  # a decision batch or a report is kilobytes; more is a broken or hostile peer
HELLO_TIMEOUT_S = 5.0  # a connection that has not proved itself by then is closed
OK, FAILED = 0, 1  # a reply's status: its body is the result, or what the handler raised (a string)
_HEADER = struct.Struct("!IQB")  # body length, call id (0: no reply wanted), method code or reply status
_HELLO_BYTES = len(MAGIC) + NONCE_BYTES
_PROOF_BYTES = hashlib.sha256().digest_size
_ENCODER = msgspec.msgpack.Encoder()

Handler = Callable[[Any], Any]
"""Runs one call on the server's event loop, without awaiting (calls are taken one at a time, in order)."""
Answered = Callable[[Any, BaseException | None], None]
"""Takes a call's result, or what failed it (then the result is None)."""


class WireClosed(ConnectionError):
    """The connection to the router's actor closed (the actor died or was replaced) or could not be opened."""


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True, slots=True)
class Body:
    """How one type's values cross the line: a decoder that builds nothing else, and the change of shape msgspec
    needs on the way, if any."""

    decoder: msgspec.msgpack.Decoder[Any]
    to_wire: Callable[[Any], Any] = _same
    from_wire: Callable[[Any], Any] = _same

    @classmethod
    def of(cls, kind: Any) -> Body:
        return cls(msgspec.msgpack.Decoder(kind))

    def encode_into(self, value: Any, buffer: bytearray) -> None:
        """Append ``value`` to ``buffer``."""
        _ENCODER.encode_into(self.to_wire(value), buffer, -1)

    def decode(self, data: bytes) -> Any:
        """The value; ``msgspec.DecodeError`` when ``data`` is not one of this type."""
        return self.from_wire(self.decoder.decode(data))


def _node_state_body() -> Body:
    """``NodeState`` s as a tagged struct per kind of view, its fields in order: msgspec tells two dataclasses
    apart in a union only as tagged structs, and a ``NodeState``'s view is one of two."""
    names = [f.name for f in dataclasses.fields(NodeState)]
    hints = typing.get_type_hints(NodeState)
    structs = {
        role: msgspec.defstruct(
            f"{role.value.title()}NodeState",
            [(name, view if name == "view" else hints[name]) for name in names],
            tag=role.value,
            array_like=True,
            frozen=True,
        )
        for role, view in ((Role.PREFILL, PrefillNodeView), (Role.DECODE, DecodeNodeView))
    }
    fields = operator.attrgetter(*names)
    prefill, decode = structs.values()
    return Body(
        msgspec.msgpack.Decoder(prefill | decode),
        to_wire=lambda state: structs[state.role](*fields(state)),
        from_wire=lambda struct: NodeState(*msgspec.structs.astuple(struct)),
    )


@dataclass(frozen=True, slots=True)
class Method:
    """A method on the line, with the one type its argument and its result may each decode to."""

    name: str
    argument: Body
    result: Body


METHODS = (
    Method("decide_many", Body.of(list[DecisionRequest]), Body.of(list[RoutingReply])),
    Method("report", _node_state_body(), Body.of(None)),
)
"""The line's methods; a call names one by its index here."""
_CODES = {method.name: code for code, method in enumerate(METHODS)}
_ERROR = Body.of(str)


def _code(method: str) -> int:
    code = _CODES.get(method)
    if code is None:
        raise ValueError(f"no method {method!r} on the router's line (it has {', '.join(_CODES)})")
    return code


def _frame(call_id: int, code: int, body: Body, value: Any) -> bytearray:
    """A frame: the header, then ``value`` encoded as ``body`` says."""
    frame = bytearray(_HEADER.size)
    body.encode_into(value, frame)
    _HEADER.pack_into(frame, 0, len(frame) - _HEADER.size, call_id, code)
    return frame


def _proof(secret: bytes, hello: bytes, nonce: bytes, side: bytes) -> bytes:
    """What proves ``side`` holds ``secret``, for the connection whose server hello and caller nonce these are."""
    return hmac.digest(secret, hello + nonce + side, "sha256")


async def prove_caller(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes) -> bool:
    """The server's side of the handshake: whether the caller proved it holds ``secret`` (then the server has
    answered its proof)."""
    hello = MAGIC + secrets.token_bytes(NONCE_BYTES)
    writer.write(hello)
    answer = await reader.readexactly(NONCE_BYTES + _PROOF_BYTES)
    nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _proof(secret, hello, nonce, b"client")):
        return False
    writer.write(_proof(secret, hello, nonce, b"server"))
    return True


class WireServer:
    """Takes calls on a TCP port and answers each with its handler's result (call id 0: no answer)."""

    def __init__(self, handlers: Mapping[str, Handler]) -> None:
        unknown = set(handlers) - set(_CODES)
        if unknown:
            raise ValueError(f"no method {sorted(unknown)} on the router's line (it has {', '.join(_CODES)})")
        self.handlers = [handlers.get(method.name) for method in METHODS]
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self._server: asyncio.Server | None = None

    async def open(self, host: str) -> WireAddress:
        """Listen on ``host`` (the node's IP) at a free port; the address callers connect to."""
        self._server = await asyncio.start_server(self._serve, host, 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return WireAddress(host, port, self.secret)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                if not await prove_caller(reader, writer, self.secret):
                    logger.warning("router's TCP line: a caller at %s failed the handshake; closed", peer)
                    return
            while True:
                length, call_id, code = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                if length > MAX_FRAME_BYTES or code >= len(METHODS):
                    logger.warning(
                        "router's TCP line: a frame of %d bytes for method %d from %s; closed", length, code, peer
                    )
                    return
                argument = METHODS[code].argument.decode(await reader.readexactly(length))
                reply = self._answer(call_id, code, argument)
                if reply is not None:
                    writer.write(reply)
                    await writer.drain()
        except msgspec.DecodeError as exc:
            logger.warning("router's TCP line: a call from %s that does not decode (%s); closed", peer, exc)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            return  # the caller went away, or never proved itself
        finally:
            writer.close()

    def _answer(self, call_id: int, code: int, argument: Any) -> bytearray | None:
        """Run the call; the frame of its reply if one is wanted (call id not 0): the handler's result, or what
        failed it, as a Ray call's caller would get it."""
        method, handler = METHODS[code], self.handlers[code]
        if handler is None:
            error = f"no method {method.name!r} on this line"
        else:
            try:
                result = handler(argument)
                return _frame(call_id, OK, method.result, result) if call_id else None
            except Exception as exc:
                logger.exception("router call %s failed", method.name)
                error = f"{type(exc).__name__}: {exc}"
        return _frame(call_id, FAILED, _ERROR, error) if call_id else None


class WireClient(asyncio.Protocol):
    """One connection to a ``WireServer``: calls answered by call id, in any number at once.

    Replies are read as they arrive (a protocol, not a reader task), and each
    call's ``Answered`` runs there, in the turn of the event loop that read it.
    """

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._transport: asyncio.WriteTransport | None = None
        self._buffer = bytearray()
        self._server_proof: bytes | None = None  # what the server must answer, once the caller has proved itself
        # the handshake's end: None once both ends have proved themselves, else what ended the connection
        self._proven: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[Body, Answered]] = {}  # call id -> its result's type, who takes it
        self._ended: BaseException | None = None  # why the connection closed

    @classmethod
    async def connect(cls, address: WireAddress, timeout_s: float) -> WireClient:
        """A connection to ``address`` once both ends proved they hold its secret (``WireClosed`` otherwise)."""
        loop = asyncio.get_running_loop()
        client = cls(address.secret)
        where = f"{address.host}:{address.port}"
        try:
            async with asyncio.timeout(timeout_s):
                await loop.create_connection(lambda: client, address.host, address.port)
                failure = await client._proven
        except TimeoutError as exc:
            client.close()
            raise WireClosed(f"cannot reach the router at {where} within {timeout_s:g} s") from exc
        except OSError as exc:
            client.close()
            raise WireClosed(f"cannot reach the router at {where}: {exc}") from exc
        if failure is not None:
            raise WireClosed(f"cannot reach the router at {where}: the handshake failed: {failure}")
        return client

    @property
    def closed(self) -> bool:
        return self._ended is not None

    def submit(self, method: str, argument: Any, answered: Answered) -> int:
        """Send the call now; ``answered`` runs once, with its result or with what failed it (``WireClosed``:
        the connection closed first, at once if it was; ``RuntimeError``: the handler raised). Returns the
        call's id, for ``forget``."""
        code = _code(method)
        if self._ended is not None:
            answered(None, WireClosed(f"the connection to the router is closed ({self._ended})"))
            return 0
        call_id = next(self._ids)
        self._waiting[call_id] = (METHODS[code].result, answered)
        self._write(_frame(call_id, code, METHODS[code].argument, argument))
        return call_id

    def forget(self, call_id: int) -> None:
        """Give up on a call: its ``Answered`` will not run (and its reply is not decoded)."""
        self._waiting.pop(call_id, None)

    async def call(self, method: str, argument: Any) -> Any:
        """``submit``, awaited: the result, or what failed the call raised."""
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def answered(result: Any, error: BaseException | None) -> None:
            if answer.done():
                return
            if error is None:
                answer.set_result(result)
            else:
                answer.set_exception(error)

        call_id = self.submit(method, argument, answered)
        try:
            return await answer
        finally:
            self.forget(call_id)

    def send(self, method: str, argument: Any) -> None:
        """A call without an answer, sent in order with the others (nothing if the connection is closed)."""
        code = _code(method)
        if self._ended is None:
            self._write(_frame(0, code, METHODS[code].argument, argument))

    def close(self) -> None:
        self._end(WireClosed("the link closed this connection"))

    def _write(self, data: bytes | bytearray) -> None:
        assert self._transport is not None, "connected"
        self._transport.write(data)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.WriteTransport, transport)  # uvloop's is not asyncio's class

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if not self._proven.done():
            self._handshake()
        if self._proven.done() and self._ended is None:
            self._read_replies()

    def _handshake(self) -> None:
        """The caller's side: answer the server's hello, then check the server's proof (``connect`` waits)."""
        if self._server_proof is None:
            if len(self._buffer) < _HELLO_BYTES:
                return
            hello = bytes(self._buffer[:_HELLO_BYTES])
            del self._buffer[:_HELLO_BYTES]
            if not hello.startswith(MAGIC):
                self._end(WireClosed(f"the peer is not a router's line of this version ({hello[: len(MAGIC)]!r})"))
                return
            nonce = secrets.token_bytes(NONCE_BYTES)
            self._write(nonce + _proof(self._secret, hello, nonce, b"client"))
            self._server_proof = _proof(self._secret, hello, nonce, b"server")
        if len(self._buffer) < _PROOF_BYTES:
            return
        proof = bytes(self._buffer[:_PROOF_BYTES])
        del self._buffer[:_PROOF_BYTES]
        if not hmac.compare_digest(proof, self._server_proof):
            self._end(WireClosed("the peer did not prove it holds the router's secret"))
            return
        self._proven.set_result(None)

    def _read_replies(self) -> None:
        while len(self._buffer) >= _HEADER.size:
            length, call_id, status = _HEADER.unpack_from(self._buffer)
            if length > MAX_FRAME_BYTES or status not in (OK, FAILED):
                self._end(WireClosed(f"a reply of {length} bytes (at most {MAX_FRAME_BYTES}), status {status}"))
                return
            end = _HEADER.size + length
            if len(self._buffer) < end:
                return
            body = bytes(self._buffer[_HEADER.size : end])
            del self._buffer[:end]
            waiting = self._waiting.get(call_id)
            if waiting is None:
                continue  # a call given up on
            result, answered = waiting
            try:
                value = result.decode(body) if status == OK else _ERROR.decode(body)
            except msgspec.DecodeError as exc:  # not what the method answers: a broken peer, the connection is done
                self._end(WireClosed(f"a reply that does not decode: {exc}"))
                return
            del self._waiting[call_id]
            if status == OK:
                answered(value, None)
            else:
                answered(None, RuntimeError(f"the router's call failed: {value}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc or WireClosed("the router closed the connection"))

    def _end(self, why: BaseException) -> None:
        """Closed for good: every call waiting fails with ``WireClosed``, and so does ``connect`` if it waits."""
        if self._ended is None:
            self._ended = why
        if self._transport is not None:
            self._transport.close()
        if not self._proven.done():
            self._proven.set_result(why)
        waiting, self._waiting = self._waiting, {}
        for _, answered in waiting.values():
            answered(None, WireClosed(f"the connection to the router closed ({why})"))
