"""A direct TCP line to the router's actor, for the calls on every request's path (decisions, reports).

A plain Ray actor call's round trip crosses several threads on each side
(the caller's core worker, gRPC, the callee's core worker, its event loop)
and costs 2-3 ms on a 2-core host once the processes have idled for a few
milliseconds; a message on an open TCP connection between two asyncio loops
costs about a tenth of that (``docs/live-path-performance.md``). The router's
actor opens a ``WireServer`` on its node's IP; a caller's ``RouterLink``
learns its ``WireAddress`` through the actor's Ray handle and keeps one
``WireClient`` connection to it.

Each frame is a 4-byte big-endian length and a pickled ``WireCall`` or
``WireReply`` (``kairos_ray.messages``). Nothing is unpickled before the
caller has sent the server's secret, which only a holder of the actor's Ray
handle can learn, as the connection's first bytes; a frame over
``MAX_FRAME_BYTES`` closes the connection. A call waits for its reply at most
the caller's deadline; a closed connection fails every call waiting on it at
once, and the link then reconnects (``serve.router_link``). The client reads
replies as an ``asyncio.Protocol`` and answers each call in the turn of the
event loop that read its reply: on a busy ingress loop every turn between the
socket and the caller costs a share of a millisecond.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import pickle
import secrets
import struct
from collections.abc import Callable, Mapping
from typing import Any, cast

from kairos_ray.messages import WireAddress, WireCall, WireReply

logger = logging.getLogger("ray.serve")

SECRET_BYTES = 32
MAX_FRAME_BYTES = 64 << 20  # a decision batch or a report is kilobytes; more is a broken or hostile peer
HELLO_TIMEOUT_S = 5.0  # a connection that has not sent the secret by then is closed
_LENGTH = struct.Struct("!I")

Handler = Callable[[Any], Any]
"""Runs one call on the server's event loop, without awaiting (calls are taken one at a time, in order)."""
Answered = Callable[[Any, BaseException | None], None]
"""Takes a call's result, or what failed it (then the result is None)."""


class WireClosed(ConnectionError):
    """The connection to the router's actor closed (the actor died or was replaced) or could not be opened."""


def _frame(message: WireCall | WireReply) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


def _length(header: bytes | bytearray) -> int:
    """A frame's length, from the header at the start of ``header``; ``WireClosed`` past ``MAX_FRAME_BYTES``."""
    (length,) = _LENGTH.unpack_from(header)
    if length > MAX_FRAME_BYTES:
        raise WireClosed(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})")
    return int(length)


async def _read(reader: asyncio.StreamReader) -> Any:
    """The server's side: one frame, unpickled (only once the caller has proved itself)."""
    length = _length(await reader.readexactly(_LENGTH.size))
    return pickle.loads(await reader.readexactly(length))


class WireServer:
    """Takes ``WireCall`` s on a TCP port and answers each with its handler's result (``call_id`` 0: no answer)."""

    def __init__(self, handlers: Mapping[str, Handler]) -> None:
        self.handlers = dict(handlers)
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
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                hello = await reader.readexactly(SECRET_BYTES)
            if not hmac.compare_digest(hello, self.secret):
                return
            while True:
                call = await _read(reader)
                if not isinstance(call, WireCall):
                    return
                reply = self._answer(call)
                if call.call_id:
                    writer.write(_frame(reply))
                    await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            return  # the caller went away, or never proved itself
        finally:
            writer.close()

    def _answer(self, call: WireCall) -> WireReply:
        handler = self.handlers.get(call.method)
        if handler is None:
            return WireReply(call.call_id, None, f"no method {call.method!r}")
        try:
            return WireReply(call.call_id, handler(call.argument))
        except Exception as exc:  # the caller gets the error, as a Ray call's caller would
            logger.exception("router call %s failed", call.method)
            return WireReply(call.call_id, None, f"{type(exc).__name__}: {exc}")


class WireClient(asyncio.Protocol):
    """One connection to a ``WireServer``: calls answered by ``call_id``, in any number at once.

    Replies are read as they arrive (a protocol, not a reader task), and each
    call's ``Answered`` runs there, in the turn of the event loop that read it.
    """

    def __init__(self) -> None:
        self._transport: asyncio.WriteTransport | None = None
        self._buffer = bytearray()
        self._ids = itertools.count(1)
        self._waiting: dict[int, Answered] = {}
        self._ended: BaseException | None = None  # why the connection closed

    @classmethod
    async def connect(cls, address: WireAddress, timeout_s: float) -> WireClient:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                _, client = await loop.create_connection(cls, address.host, address.port)
        except (OSError, TimeoutError) as exc:
            raise WireClosed(f"cannot reach the router at {address.host}:{address.port}: {exc}") from exc
        client._write(address.secret)
        return client

    @property
    def closed(self) -> bool:
        return self._ended is not None

    def submit(self, method: str, argument: Any, answered: Answered) -> int:
        """Send the call now; ``answered`` runs once, with its result or with what failed it (``WireClosed``:
        the connection closed first, at once if it was; ``RuntimeError``: the handler raised). Returns the
        call's id, for ``forget``."""
        if self._ended is not None:
            answered(None, WireClosed(f"the connection to the router is closed ({self._ended})"))
            return 0
        call_id = next(self._ids)
        self._waiting[call_id] = answered
        self._write(_frame(WireCall(call_id, method, argument)))
        return call_id

    def forget(self, call_id: int) -> None:
        """Give up on a call: its ``Answered`` will not run."""
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
        if self._ended is None:
            self._write(_frame(WireCall(0, method, argument)))

    def close(self) -> None:
        self._end(WireClosed("the link closed this connection"))

    def _write(self, data: bytes) -> None:
        assert self._transport is not None, "connected"
        self._transport.write(data)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.WriteTransport, transport)  # uvloop's is not asyncio's class

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while len(self._buffer) >= _LENGTH.size:
            try:
                length = _length(self._buffer)
            except WireClosed as exc:
                self._end(exc)
                return
            if len(self._buffer) < _LENGTH.size + length:
                return
            body = bytes(self._buffer[_LENGTH.size : _LENGTH.size + length])
            del self._buffer[: _LENGTH.size + length]
            try:
                reply = pickle.loads(body)
            except Exception as exc:  # garbage from the peer: the connection is done
                self._end(exc)
                return
            answered = self._waiting.pop(reply.call_id, None) if isinstance(reply, WireReply) else None
            if answered is None:
                continue  # a call given up on
            if reply.error is None:
                answered(reply.result, None)
            else:
                answered(None, RuntimeError(f"the router's call failed: {reply.error}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc or WireClosed("the router closed the connection"))

    def _end(self, why: BaseException) -> None:
        """Closed for good: every call waiting fails with ``WireClosed``."""
        if self._ended is None:
            self._ended = why
        if self._transport is not None:
            self._transport.close()
        waiting, self._waiting = self._waiting, {}
        for answered in waiting.values():
            answered(None, WireClosed(f"the connection to the router closed ({why})"))
