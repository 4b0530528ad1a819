"""Time one KV hand-off between two Ray actors: through the object store vs over a gloo KV channel.

Each actor is a process of its own, as prefill and decode replicas are. A
hand-off is timed from the sender having the staged bytes to the receiver
holding them as bytes, the path a vLLM engine's payload takes. Prints the
median over the repeats per payload size and the ratio of the two.

    python scripts/bench_kv_transport.py --sizes-mib 1 16 64 256 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray

from kairos_ray.engines.kv_channel import KVChannel


@ray.remote(num_cpus=0)
class Node:
    """One end: holds a payload to send, or receives one."""

    def __init__(self, node_id: str, backend: str) -> None:
        self.node_id = node_id
        self.channel = KVChannel(node_id, ray.util.get_node_ip_address(), backend, timeout_s=120.0)
        self.payload: dict[int, bytes] = {}

    def stage(self, size: int) -> None:
        self.payload = {0: bytes(size)}

    def put(self) -> list[ray.ObjectRef]:
        return [ray.put(self.payload)]

    async def fetch(self, refs: list[ray.ObjectRef]) -> int:
        return sum(len(b) for b in (await refs[0]).values())

    def ticket(self, receiver: str):
        return self.channel.ticket(receiver, 0)

    async def send(self, ticket) -> None:
        await self.channel.send(ticket, self.payload)

    async def receive(self, ticket) -> int:
        return sum(len(b) for b in (await self.channel.receive(ticket)).values())


def object_store(sender, receiver) -> float:
    start = time.perf_counter()
    ray.get(receiver.fetch.remote(ray.get(sender.put.remote())))
    return time.perf_counter() - start


def channel(sender, receiver) -> float:
    ticket = ray.get(sender.ticket.remote("receiver"))
    start = time.perf_counter()
    ray.get([sender.send.remote(ticket), receiver.receive.remote(ticket)])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 64, 256], help="payload sizes")
    parser.add_argument("--repeats", type=int, default=9, help="hand-offs timed per size and transport")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="the channel's backend")
    args = parser.parse_args()
    if args.repeats < 1 or any(s <= 0 for s in args.sizes_mib):
        parser.error("--repeats and --sizes-mib must be positive")
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        sender, receiver = Node.remote("sender", args.backend), Node.remote("receiver", args.backend)
        ray.get(sender.stage.remote(1))
        channel(sender, receiver)  # forms the pair once, as the first hand-off of a pair does
        print(f"{'payload':>10} {'object store':>14} {args.backend + ' channel':>14} {'ratio':>7}")
        for mib in args.sizes_mib:
            ray.get(sender.stage.remote(int(mib * 2**20)))
            times = {"store": [], "channel": []}
            for _ in range(args.repeats):
                times["store"].append(object_store(sender, receiver))
                times["channel"].append(channel(sender, receiver))
            store, chan = (statistics.median(times[k]) for k in ("store", "channel"))
            print(f"{mib:>7g} MiB {1e3 * store:>11.1f} ms {1e3 * chan:>11.1f} ms {store / chan:>6.2f}x", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
