"""Point-to-point KV channels between engine nodes: the collective fast path of a hand-off.

Each (prefill node, decode node) pair that carries KV gets its own two-rank
process group, gloo between CPU hosts and NCCL between GPUs, built directly
over a prefixed ``TCPStore`` that the prefill node hosts, not as
``torch.distributed``'s one default group. No world is fixed: pools grow,
shrink and restart, a pair forms the first time it carries KV, and a pair
that breaks is replaced by a new one under a new key.

A pair is a sequenced stream. Each ticket takes the pair's next sequence
number; the sender sends each hand-off (a header with the byte count of each
tensor-parallel rank, then the bytes) in sequence order, and the
receiver receives in the same order, on demand: a decode node that needs
hand-off ``k`` takes every earlier one off the stream first and keeps those for
their requests. Order, not tags, matches sends to receives, so the same code
is correct under NCCL, whose point-to-point operations carry no tags (gloo is
given the sequence number as tag as well). No receive is posted while no
request waits, so an idle node holds no blocked operation. A send completes
once the receiver takes it, so the prefill node holds a payload exactly until
the decode node has it.

Failures never hang a request: forming a pair, a send and a receive each give
up after ``timeout_s``, and gloo then closes the pair, so both ends see it
broken; a peer that dies breaks its pair at once. The decode node recomputes
what it did not receive. A ticket whose request never asks for its KV holds
its pair's stream until a later hand-off drains it or the send times out.

Who may join: the store and the process groups listen on the node's own
address only. Rendezvous keys are derived from a per-application secret
(HMAC-SHA256), so a peer that does not hold it cannot find a pair, and once
a pair forms each end proves the secret to the other before any KV moves; a
pair whose peer fails the proof is broken at once. A receive allocates at
most what the ticket says its hand-off holds (``ChannelTicket.kv_bytes``),
or ``max_receive_bytes`` for an earlier hand-off it takes off the stream for
another request; a header that claims more breaks the pair.

``ChannelTransport`` puts a channel behind the ``KVTransport`` interface:
hand-offs to a named decode node take the pair, the rest (the router fell
back and named none) the object store.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import hmac
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore  # type: ignore[attr-defined]

from kairos_ray.kv.object_store import ObjectStoreTransport
from kairos_ray.kv.transport import KVBytes, KVLost, KVPayload

logger = logging.getLogger("ray.serve")

BACKENDS = ("gloo", "nccl")
MAX_RANKS = 64  # tensor-parallel ranks one header can describe
THREADS = 64  # blocking sends, receives and pair formations in flight at once
UNCLAIMED_S = 120.0  # a received payload that no request claimed is dropped after this
MAX_RECEIVE_BYTES = 8 << 30  # the most a receive allocates for a hand-off it has no ticket for


class ChannelError(KVLost):
    """A pair broke or timed out; the hand-off it carried is lost."""


@dataclass(frozen=True, slots=True)
class ChannelTicket:
    """What the decode node needs to receive one hand-off: where the pair forms, and its place in the stream."""

    host: str
    port: int  # the sender's rendezvous store
    key: str  # the pair's rendezvous key: "<sender>-><receiver>/<generation>"
    seq: int  # place in the pair's stream
    sender: str
    receiver: str
    request_id: int
    kv_bytes: int  # the hand-off's bytes, all ranks: the most its receive allocates


@dataclass
class _Pair:
    group: Any  # the two-rank process group: rank 0 sends, rank 1 receives
    turn: threading.Condition = field(default_factory=threading.Condition)
    next_seq: int = 0  # the next hand-off to send (sender) or to take off the stream (receiver)
    unclaimed: dict[int, tuple[KVBytes, float]] = field(default_factory=dict)  # receiver: seq -> payload


def _header(payload: KVBytes) -> torch.Tensor:
    if len(payload) > MAX_RANKS or any(not 0 <= r < MAX_RANKS for r in payload):
        raise ValueError(f"at most {MAX_RANKS} tensor-parallel ranks per hand-off, got ranks {sorted(payload)}")
    header = torch.full((MAX_RANKS,), -1, dtype=torch.int64)  # bytes of each rank; -1: no such rank
    for rank, data in payload.items():
        header[rank] = len(data)
    return header


def _unpack(header: torch.Tensor, body: torch.Tensor) -> KVBytes:
    data, payload, offset = body.numpy().data, {}, 0
    for rank, n in enumerate(header.tolist()):
        if n >= 0:
            payload[rank] = bytes(data[offset : offset + n])  # one copy
            offset += n
    return payload


class KVChannel:
    """This node's ends of its KV pairs: it sends (prefill) and receives (decode) hand-offs' bytes."""

    def __init__(
        self,
        node_id: str,
        host: str,
        backend: str = "gloo",
        timeout_s: float = 30.0,
        secret: bytes = b"",
        max_receive_bytes: int = MAX_RECEIVE_BYTES,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"KV channel backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise ValueError("KV channel backend 'nccl' needs CUDA and a torch built with NCCL; use 'gloo'")
        self.node_id, self.host, self.backend, self.timeout_s = node_id, host, backend, timeout_s
        self.secret, self.max_receive_bytes = secret, max_receive_bytes
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._server: Any = None  # sender: the rendezvous store, hosted on the first ticket
        self._pairs: dict[str, _Pair] = {}  # key -> pair
        self._forming: dict[str, threading.Lock] = {}  # key -> held while the pair forms
        self._dead: set[str] = set()  # keys of broken pairs: a rendezvous is never reused
        self._keys: dict[str, str] = {}  # sender: receiver -> key of its current pair
        self._seqs: dict[str, itertools.count[int]] = {}  # sender: key -> ticket numbers
        self._generation = itertools.count()
        self._lock = threading.Lock()
        # its own threads: a send blocks until its receiver takes it, and must not starve the receiving side
        self._threads = ThreadPoolExecutor(THREADS, thread_name_prefix=f"kv-{node_id}")

    def __len__(self) -> int:
        """Pairs formed and alive."""
        return len(self._pairs)

    def close(self) -> None:
        """Drop every pair and the rendezvous store; blocked operations end with their timeouts."""
        with self._lock:
            self._dead.update(self._pairs)
            self._pairs.clear()
            self._keys.clear()
            self._server = None
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _mac(self, text: str) -> str:
        return hmac.new(self.secret, text.encode(), hashlib.sha256).hexdigest()

    def _prove(self, key: str, group: Any, rank: int) -> None:
        """Each end shows the other that it holds the secret (the sender sends first), before any KV moves."""
        peer = 1 - rank
        mine = torch.tensor(list(bytes.fromhex(self._mac(f"{key}:{rank}"))), dtype=torch.uint8, device=self.device)
        theirs = torch.empty(32, dtype=torch.uint8, device=self.device)
        steps = [(group.send, mine), (group.recv, theirs)]
        for op, tensor in steps if rank == 0 else steps[::-1]:
            op([tensor], peer, 0).wait(self._timeout)
        if not hmac.compare_digest(bytes(theirs.cpu().tolist()), bytes.fromhex(self._mac(f"{key}:{peer}"))):
            raise ChannelError(f"KV pair {key}: the peer does not hold this application's secret")

    async def _run(self, call: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._threads, call, *args)

    # ---- pairs ------------------------------------------------------------------------

    def _pair(self, key: str, rank: int, host: str, port: int) -> _Pair:
        """The pair under ``key``, formed if it is new (waiting up to ``timeout_s`` for the peer)."""
        with self._lock:
            forming = self._forming.setdefault(key, threading.Lock())
        with forming:
            if key in self._dead:
                raise ChannelError(f"KV pair {key} broke earlier")
            if key not in self._pairs:
                try:
                    # a store client per formation: one client is not safe to share between threads
                    client = TCPStore(host, port, is_master=False, timeout=self._timeout)
                    group = self._group(PrefixStore(self._mac(key), client), rank)
                    self._prove(key, group, rank)
                    self._pairs[key] = _Pair(group)
                except (RuntimeError, ChannelError) as error:
                    self._break(key)
                    raise ChannelError(f"KV pair {key} did not form: {error}") from error
            return self._pairs[key]

    def _group(self, store: Any, rank: int) -> Any:
        if self.backend == "gloo":
            options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._timeout = self._timeout
            options._devices = [ProcessGroupGloo.create_device(hostname=self.host)]
            return ProcessGroupGloo(store, rank, 2, options)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = self._timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)

    def _break(self, key: str) -> None:
        """Forget a pair for good; the sender's next ticket to that receiver forms a new one."""
        with self._lock:
            self._dead.add(key)
            self._pairs.pop(key, None)
            for receiver in [r for r, k in self._keys.items() if k == key]:
                del self._keys[receiver]

    def _transfer(self, key: str, pair: _Pair, op: str, tensor: torch.Tensor, tag: int) -> None:
        peer = 1 if op == "send" else 0
        try:
            getattr(pair.group, op)([tensor], peer, tag).wait(self._timeout)
        except RuntimeError as error:  # timed out (gloo then closes the pair) or the peer is gone
            self._break(key)
            raise ChannelError(f"KV pair {key} broke: {error}") from error

    # ---- sender (prefill node) ------------------------------------------------------------

    def ticket(self, receiver: str, request_id: int, kv_bytes: int) -> ChannelTicket:
        """A ticket for one hand-off of ``kv_bytes`` to ``receiver``; then ``send`` its bytes."""
        with self._lock:
            if self._server is None:  # listening on this node's address only, not on every interface
                listener = socket.create_server((self.host, 0), backlog=128)
                port = listener.getsockname()[1]
                self._server = TCPStore(
                    self.host, port, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach()
                )
            if receiver not in self._keys:
                key = self._keys[receiver] = f"{self.node_id}->{receiver}/{next(self._generation)}"
                self._seqs[key] = itertools.count()
            key = self._keys[receiver]
            seq = next(self._seqs[key])
            port = int(self._server.port)
        return ChannelTicket(self.host, port, key, seq, self.node_id, receiver, request_id, kv_bytes)

    async def send(self, ticket: ChannelTicket, payload: KVBytes) -> None:
        """Send the hand-off's bytes; returns once the receiver has taken them, raises ``ChannelError``."""
        await self._run(self._send, ticket, payload)

    def _send(self, ticket: ChannelTicket, payload: KVBytes) -> None:
        header = _header(payload).to(self.device)
        data = bytearray().join(payload[r] for r in sorted(payload))  # one copy
        body = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        pair = self._pair(ticket.key, 0, ticket.host, ticket.port)
        with pair.turn:  # in ticket order: the receiver takes them off the stream in that order
            if not pair.turn.wait_for(lambda: pair.next_seq >= ticket.seq, self.timeout_s):
                self._break(ticket.key)
                raise ChannelError(f"KV pair {ticket.key}: hand-off {ticket.seq} waited too long for its turn")
            try:
                self._transfer(ticket.key, pair, "send", header, ticket.seq)
                self._transfer(ticket.key, pair, "send", body.to(self.device), ticket.seq)
            finally:
                pair.next_seq += 1
                pair.turn.notify_all()

    # ---- receiver (decode node) -----------------------------------------------------------

    async def receive(self, ticket: ChannelTicket) -> KVBytes:
        """The hand-off's bytes, {rank: bytes}; raises ``ChannelError`` when they cannot come."""
        if ticket.receiver != self.node_id:
            raise ChannelError(f"KV of request {ticket.request_id} was sent to {ticket.receiver}, not {self.node_id}")
        payload: KVBytes = await self._run(self._receive, ticket)
        return payload

    def _receive(self, ticket: ChannelTicket) -> KVBytes:
        pair = self._pair(ticket.key, 1, ticket.host, ticket.port)
        with pair.turn:  # one thread takes hand-offs off the stream at a time, in order, up to this one
            while pair.next_seq <= ticket.seq:
                seq = pair.next_seq
                header = torch.empty(MAX_RANKS, dtype=torch.int64, device=self.device)
                self._transfer(ticket.key, pair, "recv", header, seq)
                header = header.cpu()
                size = int(header.clamp(min=0).sum())
                cap = ticket.kv_bytes if seq == ticket.seq else self.max_receive_bytes
                if size > cap:
                    self._break(ticket.key)
                    raise ChannelError(f"KV pair {ticket.key}: hand-off {seq} claims {size} bytes, more than {cap}")
                body = torch.empty(size, dtype=torch.uint8, device=self.device)
                self._transfer(ticket.key, pair, "recv", body, seq)
                now = time.monotonic()
                for old in [s for s, (_, since) in pair.unclaimed.items() if now - since > UNCLAIMED_S]:
                    del pair.unclaimed[old]
                pair.unclaimed[seq] = (_unpack(header, body.cpu()), now)
                pair.next_seq += 1
            if ticket.seq not in pair.unclaimed:
                raise ChannelError(f"KV hand-off {ticket.seq} of pair {ticket.key} was taken already or expired")
            return pair.unclaimed.pop(ticket.seq)[0]


class ChannelTransport:
    """KV over a channel to the decode node the router named; through the object store when it named none.

    A send runs in the background and returns once the decode node took the
    bytes: until then the hand-off counts as ``held``; then the object store's
    ``on_taken`` runs for it, as a ``release`` would.
    """

    def __init__(self, channel: KVChannel, object_store: ObjectStoreTransport) -> None:
        self.channel, self.object_store = channel, object_store
        self._sending: dict[int, asyncio.Task[None]] = {}  # request id -> its send, until taken or failed

    async def hand_off(self, request_id: int, payload: KVPayload, receiver: str) -> tuple[Any, str]:
        if not receiver:
            return await self.object_store.hand_off(request_id, payload, receiver)
        ticket = self.channel.ticket(receiver, request_id, sum(len(b) for b in cast(KVBytes, payload).values()))
        task = asyncio.get_running_loop().create_task(self._send(ticket, payload))
        self._sending[request_id] = task
        task.add_done_callback(lambda _: self._sending.pop(request_id, None))
        return ticket, self.channel.backend

    async def _send(self, ticket: ChannelTicket, payload: KVPayload) -> None:
        try:
            await self.channel.send(ticket, cast(KVBytes, payload))
        except ChannelError as error:  # the decode node recomputes when it does not receive
            logger.warning("%s: %s", self.channel.node_id, error)
        finally:
            if self.object_store.on_taken is not None:
                self.object_store.on_taken(ticket.request_id)

    async def receive(self, reference: Any) -> KVPayload:
        if not isinstance(reference, ChannelTicket):
            return await self.object_store.receive(reference)
        try:  # forming the pair and taking earlier hand-offs off the stream count too
            return await asyncio.wait_for(self.channel.receive(reference), timeout=self.channel.timeout_s)
        except TimeoutError:
            raise ChannelError(
                f"KV of request {reference.request_id} not received within {self.channel.timeout_s} s"
            ) from None

    def release(self, request_id: int) -> None:
        self.object_store.release(request_id)

    @property
    def held(self) -> int:
        return self.object_store.held + len(self._sending)

    def close(self) -> None:
        for task in list(self._sending.values()):
            task.cancel()
        self.object_store.close()
        self.channel.close()
