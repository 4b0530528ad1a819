"""The KV channel on real gloo pairs: sequenced hand-offs, several senders, and every way a pair fails.

Senders that must die run in Ray actors (their own processes); the rest
share this process, each end on its own threads, as engines on one host do.
"""

import asyncio
import dataclasses

import psutil
import pytest
import ray
import torch

from kairos_ray.kv.channel import ChannelError, KVChannel

HOST = "127.0.0.1"


SECRET = b"this application's secret"


def payload(i: int, ranks: int = 2) -> dict[int, bytes]:
    return {r: bytes([(i + r) % 256]) * (1000 * (i + 1) + r) for r in range(ranks)}


def size(i: int, ranks: int = 2) -> int:
    return sum(len(b) for b in payload(i, ranks).values())


def channel(node_id: str, timeout_s: float = 30.0, secret: bytes = SECRET) -> KVChannel:
    return KVChannel(node_id, HOST, "gloo", timeout_s, secret)


@ray.remote(num_cpus=0)
class Sender:
    """A prefill node's end of a channel, in a process of its own."""

    def __init__(self, node_id: str, timeout_s: float) -> None:
        self.channel = KVChannel(node_id, HOST, "gloo", timeout_s, SECRET)

    def ticket(self, receiver: str, request_id: int, kv_bytes: int):
        return self.channel.ticket(receiver, request_id, kv_bytes)

    async def send(self, ticket, data: dict[int, bytes]) -> None:
        await self.channel.send(ticket, data)


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # its own, whatever else runs here
    yield
    ray.shutdown()


def test_hand_offs_from_two_senders_arrive_whole_whatever_order_they_are_claimed_in():
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
        with pytest.raises(ChannelError, match="taken already"):  # each hand-off is received once
            await receiver.receive(tickets[3])

    asyncio.run(scenario())


def test_a_ticket_for_another_node_is_refused():
    async def scenario():
        sender, other = channel("prefill-0"), channel("decode-1")
        with pytest.raises(ChannelError, match="sent to decode-0"):
            await other.receive(sender.ticket("decode-0", 1, size(1)))

    asyncio.run(scenario())


def test_a_send_nobody_takes_gives_up_and_the_next_uses_a_new_pair():
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
        got = await asyncio.wait_for(asyncio.gather(sender.send(second, payload(2)), receiver.receive(second)), 60)
        assert got[1] == payload(2)

    asyncio.run(scenario())


def test_a_sender_that_dies_fails_its_waiting_receives_at_once(ray_session):
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


def test_a_sender_gone_before_the_pair_formed_is_unreachable(ray_session):
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


def test_a_peer_without_the_secret_cannot_form_a_pair():
    async def scenario():
        sender, stranger = channel("prefill-0", timeout_s=3.0), channel("decode-0", 3.0, secret=b"another app")
        ticket = sender.ticket("decode-0", 1, size(1))
        with pytest.raises(ChannelError, match="did not form"):
            await asyncio.wait_for(asyncio.gather(sender.send(ticket, payload(1)), stranger.receive(ticket)), 60)

    asyncio.run(scenario())


def test_the_store_listens_on_the_nodes_address_only():
    sender = channel("prefill-0")
    ticket = sender.ticket("decode-0", 1, size(1))
    listening = [
        c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == ticket.port
    ]
    assert listening and {c.laddr.ip for c in listening} == {HOST}
    sender.close()


def test_a_header_claiming_more_than_the_ticket_breaks_the_pair():
    async def scenario():
        sender, receiver = channel("prefill-0", timeout_s=5.0), channel("decode-0", timeout_s=5.0)
        honest = sender.ticket("decode-0", 1, size(1))
        lying = dataclasses.replace(sender.ticket("decode-0", 2, size(2)), kv_bytes=10)  # the sender sends more
        got = await asyncio.wait_for(asyncio.gather(sender.send(honest, payload(1)), receiver.receive(honest)), 60)
        assert got[1] == payload(1)
        sent = asyncio.ensure_future(sender.send(lying, payload(2)))
        with pytest.raises(ChannelError, match=f"claims {size(2)} bytes, more than 10"):
            await asyncio.wait_for(receiver.receive(lying), 60)
        with pytest.raises(ChannelError):
            await asyncio.wait_for(sent, 60)

    asyncio.run(scenario())
