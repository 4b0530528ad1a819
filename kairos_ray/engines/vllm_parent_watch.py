"""A node's vLLM engine core ends with the replica that started it.

vLLM runs a node's engine core in a process of its own and ends it when the replica shuts the engine down; a
replica that is killed (``ray.kill``, a failed health check, Ray's memory monitor, ``ray stop --force``) shuts
nothing down, and its engine core lives on with its workers and its KV cache (on a GPU, its memory, so that the
replacement may not fit beside it). vLLM loads its general plugins (entry point group ``vllm.general_plugins``)
in every process it starts; ``end_with_parent`` is one, and acts only in an engine core whose parent is the
replica named by ``PARENT_ENV`` (``VllmEngine.start`` sets it): it watches that parent and, once it is gone,
ends the engine core as a stop would (SIGTERM: vLLM shuts the core and its workers down), then for certain.
Every other process (the replica itself, the core's workers, which vLLM ends with their core, any other vLLM
server) is left alone.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil

PARENT_ENV = "KAIROS_ENGINE_PARENT"  # the pid of the replica process that starts an engine core
POLL_S = 1.0  # how often the engine core looks for its parent
GRACE_S = 10.0  # how long a shutdown may take before the engine core is killed


def end_with_parent() -> None:
    """In an engine core of a Kairos node, watch the replica that started it (a no-op in any other process)."""
    value = os.environ.get(PARENT_ENV, "")
    if not value.isdigit():
        return
    parent = int(value)
    if os.getppid() == parent:
        threading.Thread(target=_watch, args=(parent,), name="kairos-parent-watch", daemon=True).start()
    elif not psutil.pid_exists(parent):  # the replica died while the engine core started: before its watch could begin
        _end()


def _watch(parent: int) -> None:
    while os.getppid() == parent:  # once the parent dies this process is handed to another (init, a subreaper)
        time.sleep(POLL_S)
    _end()


def _end() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)
