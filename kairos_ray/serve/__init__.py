"""The Kairos-Ray Ray Serve application: ``serve run serve_configs/2p2d-emulated.yaml``.

``serve run serve_configs/2p2d-cpu.yaml`` runs the same application on four
vLLM CPU engines, ``serve_configs/2p2d.yaml`` on A100 nodes.

``build_app(args)`` wires an OpenAI-compatible ``Ingress``, one ``Router``
replica and two ``EngineServer`` deployments, ``prefill`` and ``decode``, with
one replica per node, pinned to its node group through the pool's
``ray_actor_options`` (e.g. ``resources: {prefill_node: 1}``); with an
``autoscaling`` section a pool grows and shrinks on Kairos's signals.
"""

from __future__ import annotations

import secrets
from typing import Any

from ray.serve import Application

from kairos_ray.config import KairosConfig
from kairos_ray.serve.args import AppArgs, PoolConfig
from kairos_ray.serve.engine_server import EngineServer
from kairos_ray.serve.ingress import Ingress
from kairos_ray.serve.router import Router


def _pool(
    role: str,
    pool: PoolConfig,
    kairos: KairosConfig,
    kairos_args: dict[str, Any],
    serving: dict[str, Any],
    router: Application,
    app_secret: bytes,
) -> Application:
    """One deployment for the pool: a replica per node, routed per call to the chosen node."""
    options: dict[str, Any] = {
        "name": role,
        "ray_actor_options": {"num_cpus": 0, **pool.deployment_config.ray_actor_options},
        "max_ongoing_requests": pool.deployment_config.max_ongoing_requests,
        "request_router_config": {"request_router_class": "kairos_ray.serve.delivery:ChosenNodeRouter"},
    }
    if pool.accelerator_type:
        options["ray_actor_options"]["accelerator_type"] = pool.accelerator_type
    scaling = pool.autoscaling
    if scaling is None:
        options["num_replicas"] = pool.deployment_config.num_replicas
    else:
        options["autoscaling_config"] = {
            "min_replicas": scaling.min_replicas,
            "max_replicas": scaling.max_replicas,
            "initial_replicas": pool.deployment_config.num_replicas,
            "look_back_period_s": scaling.look_back_period_s,
            # KairosPoolPolicy applies its own hold times and cooldown: Serve should act on its answer at once.
            "upscale_delay_s": 0.0,
            "downscale_delay_s": 0.0,
            "policy": {
                "policy_function": "kairos_ray.serve.autoscaling:KairosPoolPolicy",
                "policy_kwargs": {
                    "role": role,
                    "ttft_slo_s": kairos.slo.ttft_s,
                    **scaling.model_dump(exclude={"min_replicas", "max_replicas", "look_back_period_s"}),
                },
            },
        }
    pool_args = pool.model_dump(mode="json")
    return EngineServer.options(**options).bind(role, kairos_args, serving, router, pool_args, app_secret)


def build_app(args: AppArgs | dict[str, Any]) -> Application:
    """The application for ``serve run`` / ``serve.run``; ``args`` as in ``kairos_ray.serve.args``."""
    args = AppArgs.model_validate(args) if isinstance(args, dict) else args
    kairos = args.kairos.model_dump(mode="json")
    serving = args.serving.model_dump(mode="json")
    router = Router.bind(kairos, args.serving.refit_every_steps)
    secret = secrets.token_bytes(32)  # this application's engines prove it to each other (KV channel pairs)
    decode = args.decode_config
    vllm = decode.engine == "vllm"  # the ingress renders prompts as the decode engines will see them
    return Ingress.bind(
        router,
        _pool("prefill", args.prefill_config, args.kairos, kairos, serving, router, secret),
        _pool("decode", decode, args.kairos, kairos, serving, router, secret),
        decode.model_loading_config.model_id,
        serving,
        decode.model_loading_config.source if vllm else None,
        dict(decode.engine_kwargs) if vllm else None,
    )
