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

from kairos_ray.kv import KVTransport, build_transport


@ray.remote(num_cpus=0)
class Node:
    """One end, behind the KV transport interface engines use: hands a payload off, or receives one."""

    def __init__(self, node_id: str, backend: str) -> None:
        host = ray.util.get_node_ip_address()
        self.kv: KVTransport = build_transport(node_id, host, 120.0, backend)
        self.payload: dict[int, bytes] = {}
        self.request_id = 0

    def stage(self, size: int) -> None:
        self.payload = {0: bytes(size)}

    async def hand_off(self, receiver: str) -> list:
        """The reference, in a list so that Ray passes it on as it is."""
        self.request_id += 1
        reference, _ = await self.kv.hand_off(self.request_id, self.payload, receiver)
        return [reference]

    async def receive(self, references: list) -> int:
        return sum(len(b) for b in (await self.kv.receive(references[0])).values())

    def release(self) -> None:
        self.kv.release(self.request_id)


def handed_off(sender, receiver, named: str) -> float:
    """One hand-off's seconds: to a named receiver (the channel) or to any (""): the object store."""
    start = time.perf_counter()
    ray.get(receiver.receive.remote(ray.get(sender.hand_off.remote(named))))
    elapsed = time.perf_counter() - start
    ray.get(sender.release.remote())
    return elapsed


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
        handed_off(sender, receiver, "receiver")  # forms the pair once, as the first hand-off of a pair does
        print(f"{'payload':>10} {'object store':>14} {args.backend + ' channel':>14} {'ratio':>7}")
        for mib in args.sizes_mib:
            ray.get(sender.stage.remote(int(mib * 2**20)))
            times = {"store": [], "channel": []}
            for _ in range(args.repeats):
                times["store"].append(handed_off(sender, receiver, ""))
                times["channel"].append(handed_off(sender, receiver, "receiver"))
            store, chan = (statistics.median(times[k]) for k in ("store", "channel"))
            print(f"{mib:>7g} MiB {1e3 * store:>11.1f} ms {1e3 * chan:>11.1f} ms {store / chan:>6.2f}x", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
