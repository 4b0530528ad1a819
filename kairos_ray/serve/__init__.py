"""The Kairos-Ray Ray Serve application: ``serve run serve_configs/2p2d-cpu.yaml``.

``serve run serve_configs/2p2d-emulated.yaml`` runs the same application on
emulated engines, ``serve_configs/2p2d.yaml`` on A100 nodes; a Ray Serve LLM
``build_pd_openai_app`` configuration runs as it is with
``import_path: kairos_ray.serve:build_app`` (``serve.args``).

``build_app(args)`` wires an OpenAI-compatible ``Ingress``, one ``Router``
replica and two ``EngineServer`` deployments, ``prefill`` and ``decode``, with
one replica per node, pinned to its node group through the pool's
``ray_actor_options`` (e.g. ``resources: {prefill_node: 1}``); a vLLM pool's
replicas hold the placement group Ray Serve LLM would give them. With an
``autoscaling`` section a pool grows and shrinks on Kairos's signals, with a
``deployment_config.autoscaling_config`` on Serve's.

The cluster the app runs on should start with ``CLUSTER_ENV`` in its
environment (``use_cluster_env`` before ``ray.init``; exported before
``ray start``): Serve reads it in its proxy, which the app cannot configure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kairos_ray.serve.lean_transformers import hide_sklearn_from_transformers

if TYPE_CHECKING:
    from kairos_ray.serve.app import CLUSTER_ENV, REQUEST_TIMEOUT_S, build_app, pool_options, use_cluster_env

hide_sklearn_from_transformers()

__all__ = ["CLUSTER_ENV", "REQUEST_TIMEOUT_S", "build_app", "pool_options", "use_cluster_env"]


def __getattr__(name: str) -> Any:
    """The application's names, imported on first use (``serve.app``).

    The router's actor and replica import ``kairos_ray.serve.router``, which
    must not pull in the ingress (vLLM's OpenAI protocol: seconds of import on
    every start of a router process).
    """
    if name in __all__:
        from kairos_ray.serve import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
