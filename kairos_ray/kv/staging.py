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

Where: ``<shared memory>/kairos-kv-<uid>/<application>/<node id>``, every
level a directory of this user with mode 0700, checked (not assumed) each
time it is opened; files are created exclusively with mode 0600 and opened
without following symbolic links. A node's directory holds the pid of the
process that owns it: it is emptied and removed when that engine shuts down,
and a directory whose owner is gone (a crash) is removed by the next engine
of the application that starts on the host.

Importable without vLLM and torch.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable
from typing import IO, Any

from kairos_ray.kv.transport import KVBytes

KV_PATH = "kairos_kv"  # kv_transfer_params key: the staged path (without the rank suffix)
KV_TOKENS = "num_tokens"  # kv_transfer_params key: prompt tokens whose KV was staged
REMOTE_DECODE = "do_remote_decode"  # kv_transfer_params key set by the caller of a producer
SKIP_TOKENS = "kairos_skip_tokens"  # kv_transfer_params key: leading prompt tokens not staged (the receiver has them)
HOLD_KEY = "hold_blocks_until_taken"  # kv_connector_extra_config: producer keeps blocks until the KV is taken
TAKEN = ".taken"  # suffix of the marker the engine leaves once the decode node has a staged file's KV


OWNER = "owner.pid"  # in a node's directory: the pid of the process that owns it


def default_staging_dir() -> str:
    """This user's staging root: in shared memory where there is some (it never touches a disk), else the temp dir."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"kairos-kv-{os.getuid()}")


def private_dir(path: str) -> str:
    """``path`` as a directory only this user can enter (created with mode 0700); raises ``PermissionError``.

    Checked with ``lstat``: a symbolic link, another owner or any group or other
    permission is refused, so a directory someone else prepared is never used.
    """
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"KV staging: {path} is not a directory (a symbolic link?)")
    if info.st_uid != os.getuid():
        raise PermissionError(f"KV staging: {path} belongs to uid {info.st_uid}, not to this user ({os.getuid()})")
    if info.st_mode & 0o077:
        raise PermissionError(f"KV staging: {path} has mode {stat.S_IMODE(info.st_mode):o}; it must be 700")
    return path


def node_staging_dir(app: str, node_id: str, root: str | None = None) -> str:
    """A node's private staging directory, ``<root>/<app>/<node id>``, owned by this process."""
    parent = private_dir(os.path.join(private_dir(root or default_staging_dir()), _safe(app)))
    sweep(parent)
    directory = private_dir(os.path.join(parent, _safe(node_id)))
    with open_private(os.path.join(directory, OWNER), "w", replace=True) as f:
        f.write(str(os.getpid()))
    return directory


def sweep(parent: str) -> None:
    """Remove the node directories under ``parent`` whose owning process is gone (left by a crash)."""
    for entry in os.scandir(parent):
        if entry.is_dir(follow_symlinks=False) and not _owner_alive(entry.path):
            shutil.rmtree(entry.path, ignore_errors=True)


def _owner_alive(directory: str) -> bool:
    try:
        with open_private(os.path.join(directory, OWNER), "r") as f:
            pid = int(f.read().strip() or 0)
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError):  # unreadable or half written: a process is setting it up now
        return True
    return True


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "_"


def open_private(path: str, mode: str, replace: bool = False) -> IO[Any]:
    """Open without following a symbolic link; a new file is created exclusively (or replaced) with mode 0600."""
    flags = os.O_NOFOLLOW | os.O_CLOEXEC
    if "w" in mode:
        flags |= os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if replace else os.O_EXCL)
    else:
        flags |= os.O_RDONLY
    return os.fdopen(os.open(path, flags, 0o600), mode)


def rank_path(prefix: str, rank: int) -> str:
    """The staged file of one tensor-parallel rank."""
    return f"{prefix}.rank{rank}.pt"


def staged_files(prefix: str) -> list[tuple[int, str]]:
    """(rank, path) of every staged file of ``prefix``."""
    paths = glob.glob(glob.escape(prefix) + ".rank*.pt")
    return [(int(path[len(prefix) + len(".rank") : -len(".pt")]), path) for path in paths]


def remote_decode_params(receiver_cached_tokens: int = 0) -> dict[str, Any]:
    """The ``kv_transfer_params`` every P/D connector understands: prefill here, decode elsewhere.

    ``receiver_cached_tokens``: leading prompt tokens the decode node's prefix cache holds; the Kairos
    connector does not stage their blocks (other connectors ignore the key).
    """
    params: dict[str, Any] = {REMOTE_DECODE: True, "do_remote_prefill": False}
    if receiver_cached_tokens > 0:
        params[SKIP_TOKENS] = receiver_cached_tokens
    return params | dict.fromkeys(("remote_engine_id", "remote_block_ids", "remote_host", "remote_port"))


class Staging:
    """One engine's staging directory (private: see the module docstring)."""

    def __init__(self, directory: str) -> None:
        self.directory = private_dir(directory)

    def close(self) -> None:
        """Remove the directory and whatever is left in it (the engine has shut down)."""
        shutil.rmtree(self.directory, ignore_errors=True)

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
            with open_private(path, "rb") as f:
                payload[rank] = f.read()
            os.unlink(path)
        if not payload:
            raise FileNotFoundError(f"no staged KV at {prefix}")
        return payload

    def stage(self, name: str, payload: KVBytes, prompt_tokens: int, skipped_tokens: int = 0) -> dict[str, Any]:
        """Write received KV for the decode node's connector; the ``kv_transfer_params`` that load it.

        ``skipped_tokens``: the leading prompt tokens whose blocks the producer left out (``SKIP_TOKENS``).
        """
        prefix = os.path.join(self.directory, name)
        for rank, data in payload.items():
            with open_private(rank_path(prefix, int(rank)), "wb") as f:
                f.write(data)
        return {KV_PATH: prefix, KV_TOKENS: prompt_tokens, SKIP_TOKENS: skipped_tokens}

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
            with contextlib.suppress(OSError), open_private(rank_path(prefix, rank) + TAKEN, "w"):
                pass
