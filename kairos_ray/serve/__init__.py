"""The Kairos-Ray Ray Serve application: ``serve run serve_configs/2p2d-emulated.yaml``.

``build_app(args)`` wires an OpenAI-compatible ``Ingress``, one ``Router``
replica and one ``EngineServer`` deployment per node (``prefill-0``, ...,
``decode-0``, ...), each pinned to its node group through the pool's
``ray_actor_options`` (e.g. ``resources: {prefill_node: 0.01}``).
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from kairos_ray.serve.args import AppArgs, PoolConfig
from kairos_ray.serve.engine_server import EngineServer
from kairos_ray.serve.ingress import Ingress
from kairos_ray.serve.router import Router


def _actor_options(pool: PoolConfig) -> dict[str, Any]:
    options = {"num_cpus": 0, **pool.deployment_config.ray_actor_options}
    if pool.accelerator_type:
        options["accelerator_type"] = pool.accelerator_type
    return options


def build_app(args: AppArgs | dict[str, Any]) -> Application:
    """The application for ``serve run`` / ``serve.run``; ``args`` as in ``kairos_ray.serve.args``."""
    args = AppArgs.model_validate(args) if isinstance(args, dict) else args
    for name, pool in (("prefill_config", args.prefill_config), ("decode_config", args.decode_config)):
        if pool.engine != "emulated":
            raise ValueError(
                f"{name}.engine = {pool.engine!r}: only the 'emulated' engine is available in this version; "
                "the vLLM backend is not built yet"
            )
    kairos = args.kairos.model_dump(mode="json")
    serving = args.serving.model_dump(mode="json")
    prefill_ids = [f"prefill-{i}" for i in range(args.prefill_config.deployment_config.num_replicas)]
    decode_ids = [f"decode-{i}" for i in range(args.decode_config.deployment_config.num_replicas)]
    router = Router.bind(kairos, prefill_ids, decode_ids)

    def nodes(ids: list[str], role: str, pool: PoolConfig) -> dict[str, Application]:
        return {
            node: EngineServer.options(
                name=node,
                ray_actor_options=_actor_options(pool),
                max_ongoing_requests=pool.deployment_config.max_ongoing_requests,
            ).bind(node, role, kairos, serving, router)
            for node in ids
        }

    return Ingress.bind(
        router,
        nodes(prefill_ids, "prefill", args.prefill_config),
        nodes(decode_ids, "decode", args.decode_config),
        args.decode_config.model_loading_config.model_id,
        serving,
    )
