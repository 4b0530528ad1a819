"""The KV channel on real gloo pairs: sequenced hand-offs, several senders, and every way a pair fails.

Senders that must die run in Ray actors (their own processes); the rest
share this process, each end on its own threads, as engines on one host do.
"""

import asyncio

import pytest
import ray
import torch

from kairos_ray.kv.channel import ChannelError, KVChannel

HOST = "127.0.0.1"


def payload(i: int, ranks: int = 2) -> dict[int, bytes]:
    return {r: bytes([(i + r) % 256]) * (1000 * (i + 1) + r) for r in range(ranks)}


@ray.remote(num_cpus=0)
class Sender:
    """A prefill node's end of a channel, in a process of its own."""

    def __init__(self, node_id: str, timeout_s: float) -> None:
        self.channel = KVChannel(node_id, HOST, "gloo", timeout_s)

    def ticket(self, receiver: str, request_id: int):
        return self.channel.ticket(receiver, request_id)

    async def send(self, ticket, data: dict[int, bytes]) -> None:
        await self.channel.send(ticket, data)


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def test_hand_offs_from_two_senders_arrive_whole_whatever_order_they_are_claimed_in():
    async def scenario():
        senders = [KVChannel(f"prefill-{i}", HOST, "gloo", 30.0) for i in range(2)]
        receiver = KVChannel("decode-0", HOST, "gloo", 30.0)
        tickets = [senders[i % 2].ticket("decode-0", i) for i in range(8)]
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
        sender, other = KVChannel("prefill-0", HOST), KVChannel("decode-1", HOST)
        with pytest.raises(ChannelError, match="sent to decode-0"):
            await other.receive(sender.ticket("decode-0", 1))

    asyncio.run(scenario())


def test_a_send_nobody_takes_gives_up_and_the_next_uses_a_new_pair():
    async def scenario():
        sender = KVChannel("prefill-0", HOST, "gloo", timeout_s=2.0)
        first = sender.ticket("decode-0", 1)
        with pytest.raises(ChannelError, match="did not form"):
            await asyncio.wait_for(sender.send(first, payload(1)), 60)
        second = sender.ticket("decode-0", 2)
        assert second.key != first.key  # a broken rendezvous is never reused
        receiver = KVChannel("decode-0", HOST, "gloo", timeout_s=5.0)
        with pytest.raises(ChannelError):  # the old ticket's pair is gone for good
            await asyncio.wait_for(asyncio.gather(sender.send(first, payload(1)), receiver.receive(first)), 60)
        got = await asyncio.wait_for(asyncio.gather(sender.send(second, payload(2)), receiver.receive(second)), 60)
        assert got[1] == payload(2)

    asyncio.run(scenario())


def test_a_sender_that_dies_fails_its_waiting_receives_at_once(ray_session):
    async def scenario():
        receiver = KVChannel("decode-0", HOST, "gloo", timeout_s=600.0)  # only the break can end the wait
        sender = Sender.remote("prefill-0", 600.0)
        formed = await sender.ticket.remote("decode-0", 1)
        sent = sender.send.remote(formed, payload(1))
        assert await asyncio.wait_for(receiver.receive(formed), 120) == payload(1)
        await sent
        orphan = await sender.ticket.remote("decode-0", 2)  # never sent
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
        ticket = await sender.ticket.remote("decode-0", 1)
        ray.kill(sender)
        receiver = KVChannel("decode-0", HOST, "gloo", timeout_s=5.0)
        with pytest.raises(ChannelError):
            await asyncio.wait_for(receiver.receive(ticket), 120)

    asyncio.run(scenario())


def test_bad_backends_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="one of"):
        KVChannel("prefill-0", HOST, "mpi")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            KVChannel("prefill-0", HOST, "nccl")
