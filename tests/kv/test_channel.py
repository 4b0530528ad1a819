"""The KV channel on real gloo pairs in a real local Ray: sequenced hand-offs, several senders, every way a pair fails.

Pairs meet in Ray's cluster store, so every test runs in one local Ray
session (the one that needs Ray's token authentication starts a cluster of
its own). Senders that must die run in Ray actors (their own processes); the
rest share this process, each end on its own threads, as engines on one host
do. NCCL needs GPUs: its failure path runs on a gloo pair behind a group
that fails as an NCCL one does.
"""

import asyncio
import dataclasses
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray
import torch
import torch.distributed as dist

from kairos_ray.kv.channel import NCCL_ERRORS_RAISE, ChannelError, KVChannel, raise_nccl_errors
from tests import shared_ray
from tests.kv.guarded_handoffs import HAND_OFFS

pytestmark = [pytest.mark.ray, pytest.mark.own_ray]

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[2]
SECRET = b"this application's secret"


def payload(i: int, ranks: int = 2) -> dict[int, bytes]:
    return {r: bytes([(i + r) % 256]) * (1000 * (i + 1) + r) for r in range(ranks)}


def size(i: int, ranks: int = 2) -> int:
    return sum(len(b) for b in payload(i, ranks).values())


class Clock:
    """A clock the test moves: idle pairs and unclaimed payloads age only when it says."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@ray.remote(num_cpus=0)
class Sender:
    """A prefill node's end of a channel, in a process of its own."""

    def __init__(self, node_id: str, timeout_s: float) -> None:
        self.channel = KVChannel(node_id, HOST, "gloo", timeout_s, SECRET)

    def ticket(self, receiver: str, request_id: int, kv_bytes: int):
        return self.channel.ticket(receiver, request_id, kv_bytes)

    async def send(self, ticket, data: dict[int, bytes]) -> None:
        await self.channel.send(ticket, data)


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    shared_ray.stop()
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # its own, whatever else runs here
    yield
    ray.shutdown()


@pytest.fixture
def channel():
    """Make channels (``KVChannel`` arguments, gloo on loopback); each is closed after the test."""
    made: list[KVChannel] = []

    def make(node_id: str, timeout_s: float = 30.0, secret: bytes = SECRET, **options) -> KVChannel:
        made.append(KVChannel(node_id, HOST, "gloo", timeout_s, secret, **options))
        return made[-1]

    yield make
    for each in made:
        each.close()


async def hand_off(sender: KVChannel, receiver: KVChannel, ticket, data) -> dict[int, bytes]:
    _, got = await asyncio.wait_for(asyncio.gather(sender.send(ticket, data), receiver.receive(ticket)), 60)
    return got


async def until(condition, timeout_s: float = 60.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, "condition not met in time"
        await asyncio.sleep(0.01)


def test_hand_offs_from_two_senders_arrive_whole_whatever_order_they_are_claimed_in(channel):
    async def scenario():
        senders = [channel(f"prefill-{i}") for i in range(2)]
        receiver = channel("decode-0")
        tickets = [senders[i % 2].ticket("decode-0", i, size(i, ranks=1 + i % 3)) for i in range(8)]
        assert [t.seq for t in tickets] == [0, 0, 1, 1, 2, 2, 3, 3]  # one stream per pair
        sends = [senders[i % 2].send(tickets[i], payload(i, ranks=1 + i % 3)) for i in reversed(range(8))]
        receives = [receiver.receive(tickets[i]) for i in reversed(range(8))]  # claimed last first
        got = await asyncio.wait_for(asyncio.gather(*sends, *receives), 120)
        assert got[8:] == [payload(i, ranks=1 + i % 3) for i in reversed(range(8))]
        assert {t.key for t in tickets} == {tickets[0].key, tickets[1].key}  # one pair per sender, reused
        assert len(receiver) == 2 and len(senders[0]) == len(senders[1]) == 1
        assert receiver.unclaimed_bytes == 0  # every hand-off taken off the stream was claimed
        with pytest.raises(ChannelError, match="taken already"):  # each hand-off is received once
            await receiver.receive(tickets[3])

    asyncio.run(scenario())


def test_a_ticket_for_another_node_is_refused(channel):
    async def scenario():
        sender, other = channel("prefill-0"), channel("decode-1")
        with pytest.raises(ChannelError, match="sent to decode-0"):
            await other.receive(sender.ticket("decode-0", 1, size(1)))

    asyncio.run(scenario())


def test_a_send_nobody_takes_gives_up_and_the_next_uses_a_new_pair(channel):
    async def scenario():
        sender = channel("prefill-0", timeout_s=2.0)
        first = sender.ticket("decode-0", 1, size(1))
        with pytest.raises(ChannelError, match="did not form"):
            await asyncio.wait_for(sender.send(first, payload(1)), 60)
        second = sender.ticket("decode-0", 2, size(2))
        assert second.key != first.key  # a broken rendezvous is never reused
        receiver = channel("decode-0", timeout_s=5.0)
        with pytest.raises(ChannelError):  # the old ticket's pair is gone for good
            await asyncio.wait_for(asyncio.gather(sender.send(first, payload(1)), receiver.receive(first)), 60)
        assert await hand_off(sender, receiver, second, payload(2)) == payload(2)

    asyncio.run(scenario())


def test_a_failed_ticket_does_not_fail_later_hand_offs_on_the_pair(channel):
    async def scenario():
        sender, receiver = channel("prefill-0", timeout_s=3.0), channel("decode-0", timeout_s=3.0)
        formed = sender.ticket("decode-0", 0, size(0))
        assert await hand_off(sender, receiver, formed, payload(0)) == payload(0)
        # a send that fails before its bytes reach the stream (a payload no header can describe)
        unsendable = sender.ticket("decode-0", 1, 1)
        with pytest.raises(ChannelError, match="tensor-parallel ranks"):
            await asyncio.wait_for(sender.send(unsendable, {99: b"x"}), 60)
        after = sender.ticket("decode-0", 2, size(2))
        assert await hand_off(sender, receiver, after, payload(2)) == payload(2)
        # a send whose request never asks for it (nor any later one): it times out
        orphan = sender.ticket("decode-0", 3, size(3))
        with pytest.raises(ChannelError, match="broke"):
            await asyncio.wait_for(sender.send(orphan, payload(3)), 60)
        with pytest.raises(ChannelError):  # its receive, were it to come, fails at once: the pair is gone
            await asyncio.wait_for(receiver.receive(orphan), 60)
        later = sender.ticket("decode-0", 4, size(4))
        assert await hand_off(sender, receiver, later, payload(4)) == payload(4)
        assert len(sender) == 1 and later.seq == 0  # a fresh pair, its stream from the start on both ends

    asyncio.run(scenario())


def test_unclaimed_hand_offs_stay_under_the_cap_and_expire_on_the_timer(channel):
    async def scenario():
        clock = Clock()
        sender = channel("prefill-0")
        receiver = channel("decode-0", max_unclaimed_bytes=2500, unclaimed_s=60.0, prune_s=0.01, clock=clock)
        data = [{0: bytes([i]) * 1000} for i in range(5)]
        tickets = [sender.ticket("decode-0", i, 1000) for i in range(5)]
        sends = [sender.send(t, d) for t, d in zip(tickets, data, strict=True)]
        # the last one's receive takes the four before it off the stream for their requests, which never came
        got = await asyncio.wait_for(asyncio.gather(*sends, receiver.receive(tickets[4])), 60)
        assert got[-1] == data[4]
        assert receiver.unclaimed_bytes == 2000  # the cap held two: the oldest went first
        with pytest.raises(ChannelError, match="dropped"):
            await receiver.receive(tickets[0])
        assert await receiver.receive(tickets[3]) == data[3]
        clock.now_s += 61.0
        await until(lambda: receiver.unclaimed_bytes == 0)  # the timer, no receive
        with pytest.raises(ChannelError, match="expired"):
            await receiver.receive(tickets[2])

    asyncio.run(scenario())


def test_idle_pairs_and_broken_keys_are_forgotten_and_the_channel_goes_on(channel):
    async def scenario():
        clock = Clock()
        options = {"timeout_s": 5.0, "idle_s": 10.0, "prune_s": 0.01, "clock": clock}
        sender = channel("prefill-0", **options)
        receivers = [channel(f"decode-{i}", **options) for i in range(2)]
        for i, receiver in enumerate(receivers):
            ticket = sender.ticket(receiver.node_id, i, size(i))
            assert await hand_off(sender, receiver, ticket, payload(i)) == payload(i)
        with pytest.raises(ChannelError):  # a pair breaks now and then
            await sender.send(sender.ticket("decode-0", 2, 1), {99: b"x"})
        ticket = sender.ticket("decode-0", 3, size(3))
        assert await hand_off(sender, receivers[0], ticket, payload(3)) == payload(3)
        assert len(sender._dead) == 1 and len(receivers[0]._pairs) == 2  # the receiver never saw that break
        everyone = [sender, *receivers]
        clock.now_s += 21.0  # past the receivers' idle limit too (idle_s plus two timeouts)
        await until(lambda: not any(c._pairs or c._streams for c in everyone))
        clock.now_s += 11.0  # past idle_s again: no ticket of the broken or closed pairs can still come
        await until(lambda: not any(c._dead for c in everyone))
        ticket = sender.ticket("decode-1", 4, size(4))
        assert await hand_off(sender, receivers[1], ticket, payload(4)) == payload(4)

    asyncio.run(scenario())


def test_a_sender_that_dies_fails_its_waiting_receives_at_once(channel):
    async def scenario():
        receiver = channel("decode-0", timeout_s=600.0)  # only the break can end the wait
        sender = Sender.remote("prefill-0", 600.0)
        formed = await sender.ticket.remote("decode-0", 1, size(1))
        sent = sender.send.remote(formed, payload(1))
        assert await asyncio.wait_for(receiver.receive(formed), 120) == payload(1)
        await sent
        orphan = await sender.ticket.remote("decode-0", 2, size(2))  # never sent
        waiting = asyncio.ensure_future(receiver.receive(orphan))
        await asyncio.sleep(0)
        ray.kill(sender)
        with pytest.raises(ChannelError, match="broke"):
            await asyncio.wait_for(waiting, 120)
        with pytest.raises(ChannelError):  # and later tickets of that pair fail too, without waiting
            await asyncio.wait_for(receiver.receive(orphan), 120)

    asyncio.run(scenario())


def test_a_sender_gone_before_the_pair_formed_is_unreachable(channel):
    async def scenario():
        sender = Sender.remote("prefill-0", 600.0)
        ticket = await sender.ticket.remote("decode-0", 1, size(1))
        ray.kill(sender)
        receiver = channel("decode-0", timeout_s=5.0)
        with pytest.raises(ChannelError):
            await asyncio.wait_for(receiver.receive(ticket), 120)

    asyncio.run(scenario())


def test_bad_backends_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="one of"):
        KVChannel("prefill-0", HOST, "mpi")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            KVChannel("prefill-0", HOST, "nccl")


def test_a_peer_without_the_secret_cannot_form_a_pair(channel):
    async def scenario():
        sender, stranger = channel("prefill-0", timeout_s=3.0), channel("decode-0", 3.0, secret=b"another app")
        ticket = sender.ticket("decode-0", 1, size(1))
        with pytest.raises(ChannelError, match="did not form"):
            await asyncio.wait_for(asyncio.gather(sender.send(ticket, payload(1)), stranger.receive(ticket)), 60)

    asyncio.run(scenario())


def test_strangers_without_the_clusters_token_cannot_make_a_hand_off_fail(tmp_path):
    """Clients without the token hammer the rendezvous's store (Ray's GCS) while pairs form; each still carries KV.

    In a Ray cluster of its own with token authentication (``guarded_handoffs``): this session's runs without.
    """
    env = os.environ | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), "HOME": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", "tests.kv.guarded_handoffs", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["token_auth"] and result["arrived"] == HAND_OFFS, result
    for stranger in result["strangers"]:  # each tried many times, and was refused every time
        assert stranger["attempts"] > 1 and stranger["succeeded"] == 0 and stranger["refused"], result


def test_a_pair_listens_on_the_nodes_address_only(channel):
    async def scenario():
        me = psutil.Process()
        before = {c.laddr for c in me.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        sender, receiver = channel("prefill-0"), channel("decode-0")
        ticket = sender.ticket("decode-0", 1, size(1))
        assert await hand_off(sender, receiver, ticket, payload(1)) == payload(1)
        opened = {c.laddr for c in me.net_connections("tcp") if c.status == psutil.CONN_LISTEN} - before
        assert opened and {address.ip for address in opened} == {HOST}

    asyncio.run(scenario())


def test_a_header_claiming_more_than_the_ticket_breaks_the_pair(channel):
    async def scenario():
        sender, receiver = channel("prefill-0", timeout_s=5.0), channel("decode-0", timeout_s=5.0)
        honest = sender.ticket("decode-0", 1, size(1))
        lying = dataclasses.replace(sender.ticket("decode-0", 2, size(2)), kv_bytes=10)  # the sender sends more
        assert await hand_off(sender, receiver, honest, payload(1)) == payload(1)
        sent = asyncio.ensure_future(sender.send(lying, payload(2)))
        with pytest.raises(ChannelError, match=f"claims {size(2)} bytes, more than 10"):
            await asyncio.wait_for(receiver.receive(lying), 60)
        with pytest.raises(ChannelError):
            await asyncio.wait_for(sent, 60)

    asyncio.run(scenario())


class FailingGroup:
    """A pair's group that fails as an NCCL one does once ``fail`` is set: ``wait`` raises ``DistBackendError``.

    Until then it passes every operation to a real gloo group; ``abort`` lets that group go, as NCCL's
    ``abort`` destroys its communicator, and records that it was called.
    """

    def __init__(self, group) -> None:
        self.group, self.fail, self.aborted = group, threading.Event(), False

    def _op(self, name: str, tensors, peer: int, tag: int):
        if self.fail.is_set():
            raise dist.DistBackendError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SEND)")
        return getattr(self.group, name)(tensors, peer, tag)

    def send(self, tensors, peer: int, tag: int):
        return self._op("send", tensors, peer, tag)

    def recv(self, tensors, peer: int, tag: int):
        return self._op("recv", tensors, peer, tag)

    def abort(self) -> None:
        self.aborted, self.group = True, None


class FailingChannel(KVChannel):
    """A channel whose pairs' groups are ``FailingGroup``s (kept in ``groups``, the newest last)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.groups: list[FailingGroup] = []

    def _group(self, store, rank: int):
        self.groups.append(FailingGroup(super()._group(store, rank)))
        return self.groups[-1]


def test_an_nccl_style_failure_breaks_the_pair_not_the_channel(channel):
    async def scenario():
        sender = FailingChannel("prefill-0", HOST, "gloo", 30.0, SECRET)
        receiver = channel("decode-0")
        try:
            formed = sender.ticket("decode-0", 0, size(0))
            assert await hand_off(sender, receiver, formed, payload(0)) == payload(0)
            sender.groups[-1].fail.set()  # the peer is gone, say: the next operation times out
            failing = sender.ticket("decode-0", 1, size(1))
            with pytest.raises(ChannelError, match="Watchdog caught collective operation timeout"):
                await asyncio.wait_for(sender.send(failing, payload(1)), 60)
            assert sender.groups[-1].aborted and len(sender) == 0  # broken, its communicator aborted
            with pytest.raises(ChannelError):  # the receiving end learns at once, not after its timeout
                await asyncio.wait_for(receiver.receive(failing), 10)
            again = sender.ticket("decode-0", 2, size(2))  # the same channel forms a new pair
            assert await hand_off(sender, receiver, again, payload(2)) == payload(2)
            assert len(sender.groups) == 2 and not sender.groups[-1].aborted and len(sender) == 1
        finally:
            sender.close()

    asyncio.run(scenario())


def test_an_nccl_channel_makes_nccl_errors_raise_in_the_caller(monkeypatch):
    for name in NCCL_ERRORS_RAISE:
        monkeypatch.setenv(name, "3")  # torch's default async handling: tear the process down
    raise_nccl_errors()
    assert {name: os.environ[name] for name in NCCL_ERRORS_RAISE} == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",  # no teardown by the watchdog
        "TORCH_NCCL_BLOCKING_WAIT": "1",  # a timed-out wait raises in its caller
        "TORCH_NCCL_ENABLE_MONITORING": "0",  # no monitor thread that ends the process
    }
