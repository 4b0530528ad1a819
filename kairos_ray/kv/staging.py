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

Where: ``<shared memory>/kairos-kv-<uid>/<Ray node>/<application>/<node
id>`` (the Ray node id's first 12 characters, so that the engine's event
socket in it fits a socket address), every level a directory of this user
with mode 0700, checked (not assumed) each time it is opened; files are
created exclusively with mode 0600 and opened without following symbolic
links. The connector learns its engine's directory from the engine
(``staging_dir`` in its ``kv_connector_extra_config``), and the staged
paths travel in the requests' ``kv_transfer_params``, so both sides always
name the same files.

Who owns a node's directory: the engine that made it holds an ``fcntl.flock``
on its ``owner.lock`` for the engine's lifetime (the file also says the
owner's pid, for people who look). The directory is emptied and removed when
that engine shuts down, and one whose lock anyone can take (its owner is
gone: a crash) is removed by the next engine of the application that starts
on that Ray node. A lock, not a pid, decides: engines in containers that
share the shared memory but not a pid namespace cannot see each other's
pids, while the kernel's lock holds across them; and each Ray node keeps to
its own directories. A directory changed less than ``SETUP_S`` ago is left
alone whatever its lock says: its owner may be between making and locking it.

Importable without vLLM and torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable
from typing import IO, Any

from kairos_ray.kv.transport import KVBytes

KV_PATH = "kairos_kv"  # kv_transfer_params key: the staged path (without the rank suffix)
KV_TOKENS = "num_tokens"  # kv_transfer_params key: prompt tokens whose KV was staged
REMOTE_DECODE = "do_remote_decode"  # kv_transfer_params key set by the caller of a producer
SKIP_TOKENS = "kairos_skip_tokens"  # kv_transfer_params key: leading prompt tokens not staged (the receiver has them)
HOLD_KEY = "hold_blocks_until_taken"  # kv_connector_extra_config: producer keeps blocks until the KV is taken
TAKEN = ".taken"  # suffix of the marker the engine leaves once the decode node has a staged file's KV
LOCK = "owner.lock"  # in a node's directory: its owner holds an flock on it for its lifetime
SETUP_S = 60.0  # a directory younger than this may still be being set up: a sweep leaves it
RAY_NODE_CHARS = 12  # of the Ray node id, in the path: the engine's event socket in it must fit a socket address


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


def node_staging(app: str, node_id: str, ray_node_id: str, root: str | None = None) -> Staging:
    """An engine's staging, ``<root>/<Ray node id>/<app>/<node id>``, owned by this process until ``Staging.close``.

    Raises ``PermissionError`` when a live engine owns that directory already.
    """
    parent = private_dir(root or default_staging_dir())
    for level in (ray_node_id[:RAY_NODE_CHARS], app):
        parent = private_dir(os.path.join(parent, _safe(level)))
    sweep(parent)
    directory = private_dir(os.path.join(parent, _safe(node_id)))
    lock = os.open(os.path.join(directory, LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise PermissionError(f"KV staging: {directory} is owned by a live engine") from None
    os.ftruncate(lock, 0)
    os.write(lock, f"{os.getpid()}\n".encode())
    return Staging(directory, owner_lock=lock)


def sweep(parent: str) -> None:
    """Remove the node directories under ``parent`` whose owner lock is free (their engine is gone)."""
    now_s = time.time()
    for entry in os.scandir(parent):
        if entry.is_dir(follow_symlinks=False) and now_s - entry.stat(follow_symlinks=False).st_mtime > SETUP_S:
            _remove_if_abandoned(entry.path)


def _remove_if_abandoned(directory: str) -> None:
    """Remove ``directory`` if nobody holds its owner lock, holding the lock meanwhile."""
    try:
        lock = os.open(os.path.join(directory, LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:  # no owner ever locked it (it crashed first, or the directory predates locks)
        shutil.rmtree(directory, ignore_errors=True)
        return
    except OSError:  # a link or unreadable: not this user's to judge
        return
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # its owner lives, whatever pid namespace it runs in
        return
    else:
        shutil.rmtree(directory, ignore_errors=True)
    finally:
        os.close(lock)


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
    """One engine's staging directory (private: see the module docstring).

    ``owner_lock``: the descriptor whose flock makes this process the directory's owner (``node_staging``).
    """

    def __init__(self, directory: str, owner_lock: int | None = None) -> None:
        self.directory = private_dir(directory)
        self._owner_lock = owner_lock

    def close(self) -> None:
        """Remove the directory and whatever is left in it (the engine has shut down), then let its lock go."""
        shutil.rmtree(self.directory, ignore_errors=True)
        if self._owner_lock is not None:
            os.close(self._owner_lock)
            self._owner_lock = None

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
