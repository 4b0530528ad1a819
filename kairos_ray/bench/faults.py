"""Fault injection on a running Kairos app, for the chaos benchmark and the fault tests.

Nodes are Serve replicas: node ``decode-abc`` is the replica actor
``SERVE_REPLICA::<app>#decode#abc`` in the ``serve`` namespace. A vLLM node's
engine core is a process of its own, which the replica names
(``EngineServer.engine_pids``); an emulated node's engine is the replica
itself. Everything here needs a Ray
connection (``ray.init(address=...)``) to the app's cluster, on the host of the
processes it signals.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import ray

from kairos_ray.messages import Residue
from kairos_ray.serve.delivery import replica_of


def replica(app: str, node_id: str) -> Any:
    """The replica actor of a node (``prefill-<id>`` or ``decode-<id>``), or of a one-replica deployment
    (``Router``)."""
    unique = replica_of(node_id)
    if not unique:
        return _only_replica(app, node_id)
    return ray.get_actor(f"SERVE_REPLICA::{app}#{deployment_of(app, node_id)}#{unique}", namespace="serve")


def deployment_of(app: str, node_id: str) -> str:
    """The deployment whose replica a node is (its pool's, whatever the pool names it)."""
    unique = replica_of(node_id)
    prefix = f"SERVE_REPLICA::{app}#"
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if actor["namespace"] == "serve" and name.startswith(prefix) and name.endswith(f"#{unique}"):
            return str(name[len(prefix) : -len(unique) - 1])
    raise LookupError(f"no live replica of {app} is node {node_id}")


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


def deployment_handle(deployment: str, app: str) -> Any:
    """A handle on one of ``app``'s deployments for these tools' blocking calls, its request router on a loop of
    its own whatever the environment says: a shell that exports the cluster's
    ``RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0`` (``serve.app.CLUSTER_ENV``) would fail every call made outside
    an event loop."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=app)  # cached per process: initialised once
    if not handle.is_initialized:
        handle._init(_run_router_in_separate_loop=True)  # type: ignore[no-untyped-call]  # no public way to set it
    return handle


def replica_pid(actor: Any) -> int:
    """The process id of a replica actor."""
    pid: int = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
    return pid


def engine_pid(app: str, node_id: str) -> int:
    """The process that steps a node's engine: its vLLM engine core, or the replica itself (emulated)."""
    pool = deployment_handle(deployment_of(app, node_id), app)
    pids: list[int] = pool.engine_pids.remote(node=node_id).result(timeout_s=60)
    if not pids:
        raise LookupError(f"{node_id} reports no engine process")
    return pids[0]


def kill_engine(app: str, node_id: str) -> int:
    """``kill -9`` of a node's engine (its engine core, or the replica); the pid killed."""
    pid = engine_pid(app, node_id)
    os.kill(pid, signal.SIGKILL)
    return pid


def kill_replica(app: str, node_id: str) -> None:
    """``ray.kill`` of a node's replica (Serve starts a new one)."""
    ray.kill(replica(app, node_id), no_restart=True)


def router_actor(app: str, shard: str = "Router") -> Any:
    """The ``RouterActor`` that the app's ``Router`` replica (or a router shard's, ``Router-1``...) owns
    (decisions and reports go to it)."""
    return deployment_handle(shard, app).handle.remote().result(timeout_s=60)


def is_router_shard(deployment: str) -> bool:
    """Whether a deployment of the app is one of its router shards (``Router``, ``Router-1``, ...)."""
    return deployment == "Router" or (deployment.startswith("Router-") and deployment[7:].isdigit())


def router_shards(app: str) -> list[str]:
    """The deployments of ``app``'s router shards that have a live replica (``Router``, ``Router-1``, ...)."""
    prefix = f"SERVE_REPLICA::{app}#"
    named = ray.util.list_named_actors(all_namespaces=True)
    names = {a["name"][len(prefix) :].split("#")[0] for a in named if a["name"].startswith(prefix)}
    return sorted(n for n in names if is_router_shard(n))


def residues(app: str, timeout_s: float = 30.0) -> list[Residue]:
    """What each serving process of ``app`` still holds per request: the ingress, every router shard, every node
    the router sees (``messages.Residue``; all idle once the app is)."""
    router = deployment_handle("Router", app)
    found: list[Residue] = [deployment_handle("Ingress", app).residue.remote().result(timeout_s=timeout_s)]
    for shard in router_shards(app):
        found.append(deployment_handle(shard, app).residue.remote().result(timeout_s=timeout_s))
    for node in router.snapshot.remote().result(timeout_s=timeout_s):
        pool = deployment_handle(deployment_of(app, node), app)
        found.append(pool.residue.remote(node=node).result(timeout_s=timeout_s))
    return found
