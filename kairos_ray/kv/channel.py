"""Point-to-point KV channels between engine nodes: the collective fast path of a hand-off.

Each (prefill node, decode node) pair that carries KV gets its own two-rank
process group, gloo between CPU hosts and NCCL between GPUs, built directly
over a rendezvous in Ray's cluster store (``kv.rendezvous``), not as
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

Failures never hang a request: forming a pair, a send and a receive each
give up after ``timeout_s``; a peer that dies breaks its pair at once. The
decode node recomputes what it did not receive. Any failure of a send, or of
a receive while it takes a hand-off off the stream, breaks the pair on both
ends rather than skipping the failed hand-off: after it the ends cannot
agree where the stream stands without another exchange (a send that timed
out because nobody took it cannot be withdrawn from the receiver's view;
gloo closes the pair on a timeout and NCCL aborts its communicator; a
receive that failed may have taken half a hand-off). Tickets already issued
on a broken pair fail on both ends (at once where the receiving end had
formed the pair: the breaking end lets its group go, which closes its
sockets) and their requests recompute; the sender's next ticket forms a
fresh pair, whose sequence starts at zero on both ends. A receive that only
waited too long for another receive to finish taking hand-offs off the
stream has taken nothing, and leaves the pair alone.

Bounded over a long run: hand-offs taken off the stream for requests that
have not asked yet wait in one place per channel, at most
``max_unclaimed_bytes`` in all (over it, the oldest are dropped) and
``unclaimed_s`` each. A timer, every ``prune_s``, drops the expired ones,
closes pairs idle for ``idle_s`` (a receiving end waits two ``timeout_s``
longer, so it never closes a pair its sender still uses) and forgets broken
pairs' keys after ``idle_s``, when no ticket of theirs can still come.

NCCL errors break the pair, never the process: torch's default error
handling has its watchdog end the whole process when an operation times
out (a dead peer). A channel of backend ``nccl`` sets ``NCCL_ERRORS_RAISE``
in its process, so a timeout raises in the operation's caller, and a broken
pair's communicator is aborted (``abort``), which also ends its operations
in flight.

Who may join: the rendezvous goes through Ray's cluster store, which a
process without the cluster's token cannot reach (with Ray's token
authentication on; without it, whoever reaches the cluster can do anything
to it, this store included), under keys derived from a per-application
secret (HMAC-SHA256), so a peer that does not hold it cannot find a pair;
once a pair forms each end proves the secret to the other before any KV
moves, and a pair whose peer fails the proof is broken at once. The
rendezvous's keys are deleted once the pair has formed. The process groups
listen on the node's own address only. A receive allocates at most what the
ticket says its hand-off holds (``ChannelTicket.kv_bytes``), or
``max_receive_bytes`` for an earlier hand-off it takes off the stream for
another request; a header that claims more breaks the pair.

``ChannelTransport`` puts a channel behind the ``KVTransport`` interface:
hand-offs to a named decode node take the pair, the rest (the router fell
back and named none) the object store.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import hmac
import itertools
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import ray
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

from kairos_ray.kv.object_store import ObjectStoreTransport
from kairos_ray.kv.rendezvous import RayStore
from kairos_ray.kv.transport import KVBytes, KVLost, KVPayload

logger = logging.getLogger("ray.serve")

BACKENDS = ("gloo", "nccl")
MAX_RANKS = 64  # tensor-parallel ranks one header can describe
THREADS = 64  # blocking sends, receives and pair formations in flight at once
UNCLAIMED_S = 120.0  # a received payload that no request claimed is dropped after this
MAX_RECEIVE_BYTES = 8 << 30  # the most a receive allocates for a hand-off it has no ticket for
MAX_UNCLAIMED_BYTES = 8 << 30  # the most a receiving node keeps of hand-offs no request has claimed yet
IDLE_S = 600.0  # a pair that carries nothing for this long is closed; a later ticket forms a new one
PRUNE_S = 5.0  # how often the timer drops expired payloads, idle pairs and old broken keys
# Read by torch when it builds an NCCL group: an operation that times out raises in its caller (blocking wait)
# instead of the watchdog ending the process, and no heartbeat monitor ends the process when an abort hangs.
NCCL_ERRORS_RAISE = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    "TORCH_NCCL_BLOCKING_WAIT": "1",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
}


def raise_nccl_errors() -> None:
    """Make this process's NCCL groups raise their errors in the caller instead of ending the process."""
    os.environ.update(NCCL_ERRORS_RAISE)


class ChannelError(KVLost):
    """A pair broke or timed out; the hand-off it carried is lost."""


@dataclass(frozen=True, slots=True)
class ChannelTicket:
    """What the decode node needs to receive one hand-off: which pair carries it, and its place in the stream."""

    key: str  # the pair's rendezvous key: "<sender>-><receiver>/<sender channel's nonce>.<generation>"
    seq: int  # place in the pair's stream
    sender: str
    receiver: str
    request_id: int
    kv_bytes: int  # the hand-off's bytes, all ranks: the most its receive allocates


@dataclass(eq=False)
class _Pair:
    """This node's end of one pair."""

    key: str
    rank: int  # 0: this end sends, 1: it receives
    used_s: float  # when it last carried a hand-off or issued a ticket (the channel's clock)
    peer: str = ""  # sender: the receiving node
    group: Any = None  # the two-rank process group, once formed
    store: RayStore | None = None  # its rendezvous: torch holds only the C++ half of this Python store
    forming: threading.Lock = field(default_factory=threading.Lock)  # held while the group forms
    turn: threading.Condition = field(default_factory=threading.Condition)  # guards next_seq and draining
    next_seq: int = 0  # the next hand-off to send (sender) or to take off the stream (receiver)
    draining: bool = False  # receiver: a receive is taking hand-offs off the stream
    tickets: int = 0  # sender: tickets issued (the channel's lock guards it, busy and broken)
    busy: int = 0  # sends and receives using the pair now: an idle pair has none
    broken: str = ""  # why it broke; "" while it lives


@dataclass(frozen=True, slots=True)
class _Unclaimed:
    payload: KVBytes
    kv_bytes: int
    since_s: float


def _header(payload: KVBytes) -> torch.Tensor:
    if len(payload) > MAX_RANKS or any(not 0 <= r < MAX_RANKS for r in payload):
        raise ValueError(f"at most {MAX_RANKS} tensor-parallel ranks per hand-off, got ranks {sorted(payload)}")
    header = torch.full((MAX_RANKS,), -1, dtype=torch.int64)  # bytes of each rank; -1: no such rank
    for rank, data in payload.items():
        header[rank] = len(data)
    return header


def _clear(store: RayStore | None) -> None:
    """Delete a rendezvous's keys; if Ray's store fails to, a few bytes stay there: no reason to fail a hand-off."""
    if store is not None:
        with contextlib.suppress(RuntimeError):
            store.clear()


def _unpack(header: torch.Tensor, body: torch.Tensor) -> KVBytes:
    data, payload, offset = body.numpy().data, {}, 0
    for rank, n in enumerate(header.tolist()):
        if n >= 0:
            payload[rank] = bytes(data[offset : offset + n])  # one copy
            offset += n
    return payload


class KVChannel:
    """This node's ends of its KV pairs: it sends (prefill) and receives (decode) hand-offs' bytes.

    Needs Ray (a Ray worker, or a driver after ``ray.init``): pairs meet in Ray's cluster store.
    ``clock`` times idle pairs and unclaimed payloads (tests move it).
    """

    def __init__(
        self,
        node_id: str,
        host: str,
        backend: str = "gloo",
        timeout_s: float = 30.0,
        secret: bytes = b"",
        max_receive_bytes: int = MAX_RECEIVE_BYTES,
        *,
        max_unclaimed_bytes: int = MAX_UNCLAIMED_BYTES,
        unclaimed_s: float = UNCLAIMED_S,
        idle_s: float = IDLE_S,
        prune_s: float = PRUNE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"KV channel backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise ValueError("KV channel backend 'nccl' needs CUDA and a torch built with NCCL; use 'gloo'")
        if not ray.is_initialized():
            raise RuntimeError("a KV channel's pairs meet in Ray's cluster store: call ray.init() or run in Ray")
        if backend == "nccl":
            raise_nccl_errors()
        self.node_id, self.host, self.backend, self.timeout_s = node_id, host, backend, timeout_s
        self.secret, self.max_receive_bytes, self.max_unclaimed_bytes = secret, max_receive_bytes, max_unclaimed_bytes
        self.unclaimed_s, self.idle_s, self.prune_s = unclaimed_s, idle_s, prune_s
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self._clock = clock
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._nonce = secrets.token_hex(4)  # this channel's keys never meet an earlier channel's leftovers
        self._generation = itertools.count()
        self._pairs: dict[str, _Pair] = {}  # key -> this node's end of the pair, formed or not yet
        self._streams: dict[str, str] = {}  # sender: receiver -> key of its current pair
        self._dead: dict[str, float] = {}  # key -> when it broke: a broken rendezvous is never reused
        self._unclaimed: OrderedDict[tuple[str, int], _Unclaimed] = OrderedDict()  # (key, seq) -> it, oldest first
        self._unclaimed_bytes = 0
        self._lock = threading.Lock()
        # its own threads: a send blocks until its receiver takes it, and must not starve the receiving side
        self._threads = ThreadPoolExecutor(THREADS, thread_name_prefix=f"kv-{node_id}")
        self._closed = threading.Event()
        threading.Thread(target=self._prune_every, name=f"kv-prune-{node_id}", daemon=True).start()

    def __len__(self) -> int:
        """Pairs formed and alive."""
        with self._lock:
            return sum(pair.group is not None for pair in self._pairs.values())

    @property
    def unclaimed_bytes(self) -> int:
        """Bytes of received hand-offs that no request has claimed yet."""
        return self._unclaimed_bytes

    def close(self) -> None:
        """Break every pair, stop the timer, drop unclaimed payloads; blocked operations end with their timeouts."""
        self._closed.set()
        with self._lock:
            pairs = [pair for pair in list(self._pairs.values()) if self._forget(pair, "the channel closed")]
            self._unclaimed.clear()
            self._unclaimed_bytes = 0
        for pair in pairs:
            self._release(pair)
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

    @contextlib.contextmanager
    def _using(self, key: str, rank: int) -> Iterator[_Pair]:
        """This node's end of the pair under ``key``, formed if it is new; it counts as busy meanwhile."""
        with self._lock:
            if key in self._dead:
                raise ChannelError(f"KV pair {key} broke earlier")
            pair = self._pairs.get(key)
            if pair is None:
                if rank == 0:  # a sender's pairs are made by its tickets
                    raise ChannelError(f"KV pair {key} is not one of {self.node_id}'s")
                pair = self._pairs[key] = _Pair(key, rank, self._clock())
            pair.busy += 1
        try:
            with pair.forming:
                if pair.group is None and not pair.broken:
                    self._form(pair)
            if pair.broken:
                raise ChannelError(f"KV pair {key} broke: {pair.broken}")
            yield pair
        finally:
            with self._lock:
                pair.busy -= 1
                pair.used_s = self._clock()

    def _form(self, pair: _Pair) -> None:
        """Form the pair's group, waiting up to ``timeout_s`` for the peer; both ends prove the secret."""
        try:
            pair.store = RayStore(self._mac(pair.key), self.timeout_s)
            group = self._group(pair.store, pair.rank)
            self._prove(pair.key, group, pair.rank)
        except RuntimeError as error:  # the store's, the group's (DistError) and the proof's (ChannelError)
            _clear(pair.store)
            self._break(pair, f"did not form: {error}")
            raise ChannelError(f"KV pair {pair.key} did not form: {error}") from error
        pair.group = group
        if pair.rank == 0:  # both ends are past the rendezvous (the proof went both ways): its keys can go
            _clear(pair.store)

    def _group(self, store: RayStore, rank: int) -> Any:
        if self.backend == "gloo":
            options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._timeout = self._timeout
            options._devices = [ProcessGroupGloo.create_device(hostname=self.host)]
            return ProcessGroupGloo(store, rank, 2, options)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = self._timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)

    def _forget(self, pair: _Pair, reason: str) -> bool:
        """Under the channel's lock: mark the pair broken and drop it; whether it was alive until now."""
        if pair.broken:
            return False
        pair.broken = reason
        if self._pairs.get(pair.key) is pair:
            del self._pairs[pair.key]
        if self._streams.get(pair.peer) == pair.key:
            del self._streams[pair.peer]
        self._dead[pair.key] = self._clock()
        return True

    def _release(self, pair: _Pair) -> None:
        """Wake whoever waits on a broken pair, abort its group's operations in flight and let the group go.

        The group is dropped here, not when the last reference to the pair goes (an exception's traceback
        may hold one): gloo closes its sockets once the group is gone, which is how the peer learns at once.
        """
        with pair.turn:
            pair.turn.notify_all()
        group, pair.group = pair.group, None
        if group is not None:  # NCCL: ncclCommAbort; gloo: nothing to abort
            with contextlib.suppress(RuntimeError):
                group.abort()

    def _break(self, pair: _Pair, reason: str) -> None:
        """Give a pair up for good; the sender's next ticket to that receiver forms a new one."""
        with self._lock:
            alive = self._forget(pair, reason)
        if alive:
            self._release(pair)

    # ---- the timer ----------------------------------------------------------------------

    def _prune_every(self) -> None:
        while not self._closed.wait(self.prune_s):
            self.prune()

    def prune(self) -> None:
        """Drop expired unclaimed payloads, close idle pairs and forget old broken keys (the timer's work)."""
        now = self._clock()
        with self._lock:
            while self._unclaimed:
                where, kept = next(iter(self._unclaimed.items()))
                if now - kept.since_s <= self.unclaimed_s:
                    break
                del self._unclaimed[where]
                self._unclaimed_bytes -= kept.kv_bytes
            for key in [key for key, since_s in self._dead.items() if now - since_s > self.idle_s]:
                del self._dead[key]
            idle = [
                pair
                for pair in list(self._pairs.values())
                if pair.busy == 0
                and now - pair.used_s > self.idle_s + (2 * self.timeout_s if pair.rank else 0.0)
                and self._forget(pair, "idle")
            ]
        for pair in idle:
            self._release(pair)

    # ---- sender (prefill node) ------------------------------------------------------------

    def ticket(self, receiver: str, request_id: int, kv_bytes: int) -> ChannelTicket:
        """A ticket for one hand-off of ``kv_bytes`` to ``receiver``; then ``send`` its bytes."""
        with self._lock:
            key = self._streams.get(receiver)
            if key is None:
                key = self._streams[receiver] = f"{self.node_id}->{receiver}/{self._nonce}.{next(self._generation)}"
                self._pairs[key] = _Pair(key, 0, self._clock(), peer=receiver)
            pair = self._pairs[key]
            seq, pair.tickets, pair.used_s = pair.tickets, pair.tickets + 1, self._clock()
        return ChannelTicket(key, seq, self.node_id, receiver, request_id, kv_bytes)

    async def send(self, ticket: ChannelTicket, payload: KVBytes) -> None:
        """Send the hand-off's bytes; returns once the receiver has taken them, raises ``ChannelError``."""
        await self._run(self._send, ticket, payload)

    def _send(self, ticket: ChannelTicket, payload: KVBytes) -> None:
        with self._using(ticket.key, 0) as pair:
            try:
                header = _header(payload).to(self.device)
                data = bytearray().join(payload[r] for r in sorted(payload))  # one copy
                body = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
                with pair.turn:  # in ticket order: the receiver takes them off the stream in that order
                    if not pair.turn.wait_for(lambda: pair.next_seq == ticket.seq or bool(pair.broken), self.timeout_s):
                        raise ChannelError("it waited too long for its turn")
                    if pair.broken:
                        raise ChannelError(pair.broken)
                pair.group.send([header], 1, ticket.seq).wait(self._timeout)
                pair.group.send([body.to(self.device)], 1, ticket.seq).wait(self._timeout)
            except Exception as error:  # the receiver's view of the stream is unknown now (module docstring)
                self._break(pair, f"hand-off {ticket.seq} failed: {error}")
                raise ChannelError(f"KV pair {ticket.key} broke: hand-off {ticket.seq} failed: {error}") from error
            with pair.turn:
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
        kept = self._claim(ticket)
        if kept is not None:  # taken off the stream earlier, for a later hand-off (its pair may be gone since)
            return kept
        with self._using(ticket.key, 1) as pair:
            with pair.turn:  # one receive takes hand-offs off the stream at a time
                if not pair.turn.wait_for(lambda: not pair.draining or bool(pair.broken), self.timeout_s):
                    raise ChannelError(f"KV hand-off {ticket.seq} of pair {ticket.key} waited too long for the stream")
                if pair.broken:
                    raise ChannelError(f"KV pair {ticket.key} broke: {pair.broken}")
                pair.draining = True
            try:
                return self._drain(pair, ticket)
            finally:
                with pair.turn:
                    pair.draining = False
                    pair.turn.notify_all()

    def _drain(self, pair: _Pair, ticket: ChannelTicket) -> KVBytes:
        """Take hand-offs off the stream up to the ticket's; keep the earlier ones for their requests."""
        while pair.next_seq <= ticket.seq:
            seq = pair.next_seq
            cap = ticket.kv_bytes if seq == ticket.seq else self.max_receive_bytes
            try:
                payload = self._take(pair, seq, cap)
            except Exception as error:  # part of a hand-off may be taken: the ends no longer agree
                self._break(pair, str(error))
                raise ChannelError(f"KV pair {ticket.key} broke: {error}") from error
            pair.next_seq += 1
            if seq == ticket.seq:
                return payload
            self._keep(ticket.key, seq, payload)
        kept = self._claim(ticket)
        if kept is None:
            raise ChannelError(f"KV hand-off {ticket.seq} of pair {ticket.key} was taken already, expired or dropped")
        return kept

    def _take(self, pair: _Pair, seq: int, cap: int) -> KVBytes:
        header = torch.empty(MAX_RANKS, dtype=torch.int64, device=self.device)
        pair.group.recv([header], 0, seq).wait(self._timeout)
        header = header.cpu()
        size = int(header.clamp(min=0).sum())
        if size > cap:
            raise ChannelError(f"hand-off {seq} claims {size} bytes, more than {cap}")
        body = torch.empty(size, dtype=torch.uint8, device=self.device)
        pair.group.recv([body], 0, seq).wait(self._timeout)
        return _unpack(header, body.cpu())

    def _keep(self, key: str, seq: int, payload: KVBytes) -> None:
        """Park a hand-off for its request; over ``max_unclaimed_bytes`` the oldest parked ones are dropped."""
        size = sum(len(data) for data in payload.values())
        with self._lock:
            self._unclaimed[(key, seq)] = _Unclaimed(payload, size, self._clock())
            self._unclaimed_bytes += size
            while self._unclaimed_bytes > self.max_unclaimed_bytes:
                _, dropped = self._unclaimed.popitem(last=False)
                self._unclaimed_bytes -= dropped.kv_bytes

    def _claim(self, ticket: ChannelTicket) -> KVBytes | None:
        with self._lock:
            kept = self._unclaimed.pop((ticket.key, ticket.seq), None)
            if kept is None:
                return None
            self._unclaimed_bytes -= kept.kv_bytes
        return kept.payload


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
