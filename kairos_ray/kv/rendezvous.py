"""Where the KV channel's pairs meet: a ``torch.distributed`` store over Ray's cluster store (the GCS's internal KV).

A gloo or NCCL process group needs a key-value store for its rendezvous:
each rank publishes its address (gloo) or the communicator id (NCCL) and
reads its peer's. torch's ``TCPStore`` accepts any client that reaches its
port, and any such client may list, overwrite or delete keys, so a
stranger on the network could make every pair fail to form. The GCS's
internal KV is reachable only through Ray's own gRPC, which Ray's token
authentication guards (``RAY_AUTH_MODE=token``; Ray 2.60 turns it on by
default where it finds a token): a process without the cluster's token
cannot connect at all, and one with it can already run any code on the
cluster. Keys live under a per-pair prefix that only holders of the
application's secret can derive (``kv.channel``).

The store implements what gloo's and NCCL's rendezvous call (``set``,
``get``, ``wait``; ``check``, which ``wait`` polls); ``get`` and ``wait``
block until the key is set, as ``TCPStore``'s do. It works in any process connected to Ray (a Ray
worker, or a driver after ``ray.init``).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist
from ray.exceptions import RayError
from ray.experimental import internal_kv
from torch._C._distributed_c10d import Store

NAMESPACE = b"kairos_kv_rendezvous"
POLL_S = (0.001, 0.05)  # the first and the longest pause between two looks for a key not set yet

T = TypeVar("T")


class RayStore(Store):
    """Keys under ``prefix`` in Ray's cluster store; every call gives up after ``timeout_s``.

    torch holds only the C++ half of a Python store: keep this object referenced as long as a
    process group built on it may call it.
    """

    def __init__(self, prefix: str, timeout_s: float) -> None:
        super().__init__()
        gcs = internal_kv.internal_kv_get_gcs_client()  # type: ignore[no-untyped-call]
        if gcs is None:
            raise dist.DistStoreError("the KV channel's rendezvous needs Ray: call ray.init() or run in a Ray worker")
        self.prefix, self.timeout_s, self._gcs = prefix, timeout_s, gcs

    def _key(self, key: str) -> bytes:
        return f"{self.prefix}/{key}".encode()

    def _call(self, method: Callable[..., T], *args: Any) -> T:
        try:
            return method(*args, NAMESPACE, timeout=self.timeout_s)
        except RayError as error:  # the GCS did not answer in time, or refused
            raise dist.DistStoreError(f"Ray's cluster store: {error}") from error

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else value
        self._call(self._gcs.internal_kv_put, self._key(key), data, True)

    def get(self, key: str) -> bytes:
        self.wait([key])
        value: bytes | None = self._call(self._gcs.internal_kv_get, self._key(key))
        if value is None:
            raise dist.DistStoreError(f"rendezvous key {key} was deleted while it was read")
        return value

    def check(self, keys: list[str]) -> bool:
        found: dict[bytes, bytes] = self._call(self._gcs.internal_kv_multi_get, [self._key(k) for k in keys])
        return len(found) == len(set(keys))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit_s = (timeout.total_seconds() if timeout else 0.0) or self.timeout_s  # zero: the store's own
        deadline_s, pause_s = time.monotonic() + limit_s, POLL_S[0]
        while not self.check(keys):
            if time.monotonic() >= deadline_s:
                raise dist.DistStoreError(f"rendezvous keys {keys} not set within {limit_s} s")
            time.sleep(pause_s)
            pause_s = min(2 * pause_s, POLL_S[1])

    def clear(self) -> None:
        """Delete every key under the prefix (the rendezvous is over, or failed)."""
        self._call(self._gcs.internal_kv_del, f"{self.prefix}/".encode(), True)
