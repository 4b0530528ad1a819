"""KV hand-offs in a Ray cluster with token authentication while strangers without the token attack its store.

``python -m tests.kv.guarded_handoffs HOME`` (with ``RAY_AUTH_MODE=token`` and
``RAY_AUTH_TOKEN`` set) starts its own Ray, starts two strangers (no token;
a wrong one, ``HOME`` their home, without a token file) that keep trying to
list, overwrite and delete every key of the rendezvous's namespace, forms a
new pair per hand-off meanwhile, and prints one JSON line: whether the
cluster ran with token auth, the hand-offs that arrived whole, and each
stranger's report. It runs in a process of its own because the test session
runs Ray without token authentication (tests/conftest.py), and a process
keeps the mode it first read.
"""

import asyncio
import json
import os
import subprocess
import sys

import ray
from ray._raylet import AuthenticationMode, get_authentication_mode

from kairos_ray.kv.channel import KVChannel
from kairos_ray.kv.rendezvous import NAMESPACE

HOST = "127.0.0.1"
HAND_OFFS = 6

STRANGER = """
import json, select, sys
from ray._raylet import GcsClient

address, namespace = sys.argv[1], sys.argv[2].encode()
attempts, refused, succeeded = 0, set(), 0
while True:
    attempts += 1
    try:  # everything a store client could do to a rendezvous: list, overwrite, delete
        client = GcsClient(address=address)
        keys = client.internal_kv_keys(b"", namespace, timeout=5)
        for key in keys:
            client.internal_kv_put(key, b"forged", True, namespace, timeout=5)
        client.internal_kv_del(b"", True, namespace, timeout=5)
        succeeded += 1
    except Exception as error:
        refused.add(type(error).__name__)
    if attempts == 1:
        print("attacking", flush=True)
    if select.select([sys.stdin], [], [], 0.005)[0]:  # its parent closed its end: stop
        break
print(json.dumps({"attempts": attempts, "refused": sorted(refused), "succeeded": succeeded}), flush=True)
"""


async def hand_offs() -> int:
    """Hand-offs that arrived whole, each over a new pair (a new sender: a new rendezvous)."""
    receiver = KVChannel("decode-0", HOST, "gloo", 10.0, b"secret")
    arrived = 0
    try:
        for i in range(HAND_OFFS):
            sender = KVChannel(f"prefill-{i}", HOST, "gloo", 10.0, b"secret")
            data = {0: bytes([i]) * (1000 + i)}
            ticket = sender.ticket("decode-0", i, len(data[0]))
            try:
                both = sender.send(ticket, data), receiver.receive(ticket)
                _, got = await asyncio.gather(*both, return_exceptions=True)  # a lost one counts as not arrived
                arrived += got == data
            finally:
                sender.close()
    finally:
        receiver.close()
    return arrived


def main() -> None:
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {"HOME": sys.argv[1]}
        command = [sys.executable, "-c", STRANGER, ray.get_runtime_context().gcs_address, NAMESPACE.decode()]
        wrong = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 32}
        strangers = [
            subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env | extra)
            for extra in ({}, wrong)
        ]
        try:
            started = [stranger.stdout.readline().strip() == "attacking" for stranger in strangers]
            arrived = asyncio.run(hand_offs()) if all(started) else 0
        finally:
            reports = []
            for stranger in strangers:
                stranger.stdin.close()
                reports.append(json.loads(stranger.stdout.readline() or "{}"))
                stranger.wait(timeout=60)
        token_auth = get_authentication_mode() == AuthenticationMode.TOKEN
    finally:
        ray.shutdown()
    print(json.dumps({"token_auth": token_auth, "arrived": arrived, "strangers": reports}), flush=True)


if __name__ == "__main__":
    main()
