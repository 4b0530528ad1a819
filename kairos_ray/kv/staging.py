"""Staged KV files: how the Kairos vLLM connector and the engine around it exchange a request's KV blocks.

A vLLM engine's KV lives in its EngineCore process, not in the Ray worker
that hosts the engine. The connector (``kv.connector``) bridges the two with
files in a staging directory (shared memory where there is some):

- prefill node: the connector writes the prompt's blocks, one file per
  tensor-parallel rank (``<prefix>.rank<r>.pt``), and names the prefix in the
  request's ``kv_transfer_params``; the engine reads and deletes them
  (``Staging.collect``) and hands the bytes to a ``kv.transport``;
- decode node: the engine writes the bytes it received (``Staging.stage``)
  and submits the request with ``kv_transfer_params`` naming them; the
  connector loads and deletes them. A request that ends before loading
  leaves files behind: ``Staging.discard`` removes them.

With ``hold_blocks_until_taken`` the producer keeps the blocks until the
engine leaves a ``<file>.taken`` marker (``Staging.mark_taken``).

Importable without vLLM and torch.
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from collections.abc import Iterable
from typing import Any

from kairos_ray.kv.transport import KVBytes

KV_PATH = "kairos_kv"  # kv_transfer_params key: the staged path (without the rank suffix)
KV_TOKENS = "num_tokens"  # kv_transfer_params key: prompt tokens whose KV was staged
REMOTE_DECODE = "do_remote_decode"  # kv_transfer_params key set by the caller of a producer
HOLD_KEY = "hold_blocks_until_taken"  # kv_connector_extra_config: producer keeps blocks until the KV is taken
TAKEN = ".taken"  # suffix of the marker the engine leaves once the decode node has a staged file's KV


def default_staging_dir() -> str:
    """Shared memory where there is some (it never touches a disk), else the temp dir."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, "kairos-kv")


def rank_path(prefix: str, rank: int) -> str:
    """The staged file of one tensor-parallel rank."""
    return f"{prefix}.rank{rank}.pt"


def staged_files(prefix: str) -> list[tuple[int, str]]:
    """(rank, path) of every staged file of ``prefix``."""
    paths = glob.glob(glob.escape(prefix) + ".rank*.pt")
    return [(int(path[len(prefix) + len(".rank") : -len(".pt")]), path) for path in paths]


def remote_decode_params() -> dict[str, Any]:
    """The ``kv_transfer_params`` every P/D connector understands: prefill here, decode elsewhere."""
    params: dict[str, Any] = {REMOTE_DECODE: True, "do_remote_prefill": False}
    return params | dict.fromkeys(("remote_engine_id", "remote_block_ids", "remote_host", "remote_port"))


class Staging:
    """One engine's staging directory."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory or default_staging_dir()
        os.makedirs(self.directory, exist_ok=True)

    @staticmethod
    def staged_by_connector(params: dict[str, Any]) -> bool:
        """Whether a finished prefill's ``kv_transfer_params`` name KV the Kairos connector staged."""
        return KV_PATH in params

    @staticmethod
    def collect(params: dict[str, Any]) -> KVBytes:
        """Read and delete the files a prefill's ``kv_transfer_params`` name: {rank: bytes}."""
        prefix = str(params[KV_PATH])
        payload: KVBytes = {}
        for rank, path in staged_files(prefix):
            with open(path, "rb") as f:
                payload[rank] = f.read()
            os.unlink(path)
        if not payload:
            raise FileNotFoundError(f"no staged KV at {prefix}")
        return payload

    def stage(self, name: str, payload: KVBytes, prompt_tokens: int) -> dict[str, Any]:
        """Write received KV for the decode node's connector; the ``kv_transfer_params`` that load it."""
        prefix = os.path.join(self.directory, name)
        for rank, data in payload.items():
            with open(rank_path(prefix, int(rank)), "wb") as f:
                f.write(data)
        return {KV_PATH: prefix, KV_TOKENS: prompt_tokens}

    @staticmethod
    def discard(params: dict[str, Any] | None) -> None:
        """Remove what ``stage`` wrote and the connector did not load (the request ended first)."""
        prefix = (params or {}).get(KV_PATH)
        for _, path in staged_files(str(prefix)) if prefix else ():
            with contextlib.suppress(OSError):
                os.unlink(path)

    @staticmethod
    def mark_taken(params: dict[str, Any], ranks: Iterable[int]) -> None:
        """Tell a holding producer that the decode node has the KV its params name: it frees the blocks."""
        prefix = str(params[KV_PATH])
        for rank in ranks:
            with contextlib.suppress(OSError), open(rank_path(prefix, rank) + TAKEN, "w"):
                pass
