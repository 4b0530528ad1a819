"""Fault injection on a running Kairos app, for the chaos benchmark and the fault tests.

Nodes are Serve replicas: node ``decode-abc`` is the replica actor
``SERVE_REPLICA::<app>#decode#abc`` in the ``serve`` namespace. A vLLM node's
engine core is a child process of its replica (``VLLM::EngineCore``); an
emulated node's engine is the replica itself. Everything here needs a Ray
connection (``ray.init(address=...)``) to the app's cluster, on the host of the
processes it signals.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import psutil
import ray

from kairos_ray.serve.delivery import replica_of


def replica(app: str, node_id: str) -> Any:
    """The replica actor of a node (``prefill-<id>`` or ``decode-<id>``), or of the router (``Router``)."""
    deployment = node_id.split("-", 1)[0] if "-" in node_id else node_id
    unique = replica_of(node_id) if "-" in node_id else None
    if unique is None:
        return _only_replica(app, deployment)
    return ray.get_actor(f"SERVE_REPLICA::{app}#{deployment}#{unique}", namespace="serve")


def replica_names(app: str, deployment: str) -> list[str]:
    """Names of the live replica actors of a deployment."""
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in named if a["namespace"] == "serve" and a["name"].startswith(prefix))


def _only_replica(app: str, deployment: str) -> Any:
    names = replica_names(app, deployment)
    if not names:
        raise LookupError(f"no live replica of {app}/{deployment}")
    return ray.get_actor(names[0], namespace="serve")


def replica_pid(actor: Any) -> int:
    """The process id of a replica actor."""
    pid: int = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
    return pid


def engine_core_pids(pid: int) -> list[int]:
    """The vLLM engine core processes under a replica's process (none for an emulated engine)."""
    return [p.pid for p in psutil.Process(pid).children(recursive=True) if "EngineCore" in _name(p)]


def _name(process: psutil.Process) -> str:
    try:
        return " ".join([process.name(), *process.cmdline()[:1]])
    except psutil.Error:
        return ""


def engine_pid(app: str, node_id: str) -> int:
    """The process that steps a node's engine: its vLLM engine core, or the replica itself (emulated)."""
    pid = replica_pid(replica(app, node_id))
    cores = engine_core_pids(pid)
    return cores[0] if cores else pid


def kill_engine(app: str, node_id: str) -> int:
    """``kill -9`` of a node's engine (its engine core, or the replica); the pid killed."""
    pid = engine_pid(app, node_id)
    os.kill(pid, signal.SIGKILL)
    return pid


def kill_replica(app: str, node_id: str) -> None:
    """``ray.kill`` of a node's replica (Serve starts a new one)."""
    ray.kill(replica(app, node_id), no_restart=True)
