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
once, and the link then reconnects (``serve.router_link``).
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
from typing import Any

from kairos_ray.messages import WireAddress, WireCall, WireReply

logger = logging.getLogger("ray.serve")

SECRET_BYTES = 32
MAX_FRAME_BYTES = 64 << 20  # a decision batch or a report is kilobytes; more is a broken or hostile peer
HELLO_TIMEOUT_S = 5.0  # a connection that has not sent the secret by then is closed
_LENGTH = struct.Struct("!I")

Handler = Callable[[Any], Any]
"""Runs one call on the server's event loop, without awaiting (calls are taken one at a time, in order)."""


class WireClosed(ConnectionError):
    """The connection to the router's actor closed (the actor died or was replaced) or could not be opened."""


def _frame(message: WireCall | WireReply) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


async def _read(reader: asyncio.StreamReader) -> Any:
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise WireClosed(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})")
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


class WireClient:
    """One connection to a ``WireServer``: calls answered by ``call_id``, in any number at once."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._listening = asyncio.get_running_loop().create_task(self._listen())

    @classmethod
    async def connect(cls, address: WireAddress, timeout_s: float) -> WireClient:
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_connection(address.host, address.port)
        except (OSError, TimeoutError) as exc:
            raise WireClosed(f"cannot reach the router at {address.host}:{address.port}: {exc}") from exc
        writer.write(address.secret)
        return cls(reader, writer)

    @property
    def closed(self) -> bool:
        return self._listening.done()

    def submit(self, method: str, argument: Any) -> asyncio.Future[Any]:
        """Send the call now; its future holds the handler's result (``WireClosed`` if the connection closes
        first, ``RuntimeError`` if the handler raised). Cancelling it forgets the call."""
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.closed:
            answer.set_exception(WireClosed("the connection to the router is closed"))
            return answer
        call_id = next(self._ids)
        self._waiting[call_id] = answer
        answer.add_done_callback(lambda _: self._waiting.pop(call_id, None))
        self._writer.write(_frame(WireCall(call_id, method, argument)))
        return answer

    async def call(self, method: str, argument: Any) -> Any:
        """``submit``, awaited."""
        return await self.submit(method, argument)

    def send(self, method: str, argument: Any) -> None:
        """A call without an answer, sent in order with the others (nothing if the connection is closed)."""
        if not self.closed:
            self._writer.write(_frame(WireCall(0, method, argument)))

    def close(self) -> None:
        self._listening.cancel()
        self._writer.close()

    async def _listen(self) -> None:
        why: BaseException
        try:
            while True:
                reply = await _read(self._reader)
                answer = self._waiting.get(reply.call_id) if isinstance(reply, WireReply) else None
                if answer is None or answer.done():
                    continue
                if reply.error is None:
                    answer.set_result(reply.result)
                else:
                    answer.set_exception(RuntimeError(f"the router's call failed: {reply.error}"))
        except asyncio.CancelledError:
            why = WireClosed("the link closed this connection")
        except Exception as exc:  # the peer closed, reset or sent garbage: the connection is done
            why = exc
        finally:
            self._writer.close()
        for answer in list(self._waiting.values()):
            if not answer.done():
                answer.set_exception(WireClosed(f"the connection to the router closed ({why})"))
