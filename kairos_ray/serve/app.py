"""``build_app``: the Kairos-Ray Serve application's wiring (imported lazily through ``kairos_ray.serve``)."""

from __future__ import annotations

import os
import secrets
from dataclasses import replace
from typing import Any, cast

from ray.serve import Application, Deployment

from kairos_ray.config import KairosConfig
from kairos_ray.messages import NodeId, Role
from kairos_ray.serve.args import AppArgs, PoolConfig, router_names
from kairos_ray.serve.engine_server import EngineServer
from kairos_ray.serve.ingress import Ingress
from kairos_ray.serve.router import Router

CLUSTER_ENV = {
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}
"""Serve's HTTP proxy takes each response's items from the ingress over Serve's gRPC transport: a streamed item
costs a fraction of the CPU of a Ray streaming-generator item; Serve's processes hand their cached request metrics to
Ray's metrics every second, not ten times a second (Ray's metrics agent collects them every 10 s); each replica runs
its deployment's code and its handles' request routers on its one event loop rather than on threads of their own (as
Serve's own ``RAY_SERVE_THROUGHPUT_OPTIMIZED`` mode does), which saves a cross-thread hop per streamed item and call.
Why each, and what it saves: ``docs/live-path-performance.md``."""


INGRESS_ENV = {"MALLOC_ARENA_MAX": "2"}
"""The ingress's process environment (a user's own ``runtime_env.env_vars`` win): glibc's malloc gives each thread
that allocates an arena of its own, up to eight per core, and seldom hands their freed pages back; the ingress parses
bodies and renders prompts on threads, and with two arenas its RSS stops creeping with requests served. The engines
keep the default (their kernels allocate from many threads at once). Figures: ``docs/failures.md``, Soak."""


REQUEST_TIMEOUT_S = 1800.0
"""Serve's ``http_options.request_timeout_s`` in the shipped configs and local runs: the app ends what it can
sooner (its own deadlines), and this bounds whatever it cannot (a stream that still runs after 30 minutes)."""


def _deployment(cls: type) -> Deployment:
    """A class ``@serve.deployment`` made a ``Deployment`` (Serve's decorator is not typed through)."""
    return cast(Deployment, cls)


def use_cluster_env() -> None:
    """Put ``CLUSTER_ENV`` in this process's environment (where not set already), for the Ray it starts."""
    for name, value in CLUSTER_ENV.items():
        os.environ.setdefault(name, value)


def ingress_options(config: dict[str, Any]) -> dict[str, Any]:
    """The ingress deployment's Serve options: ``ingress_deployment_config`` with ``INGRESS_ENV`` in its actor's
    environment and no CPU reserved, unless the user's options say otherwise."""
    actor = {"num_cpus": 0, **config.get("ray_actor_options", {})}
    runtime_env = actor.get("runtime_env", {})
    actor["runtime_env"] = {**runtime_env, "env_vars": {**INGRESS_ENV, **runtime_env.get("env_vars", {})}}
    return {**config, "ray_actor_options": actor}


def pool_options(role: Role, pool: PoolConfig, kairos: KairosConfig, group: int = 0) -> dict[str, Any]:
    """The Serve options of a node group's deployment: a replica per node, routed per call to the chosen node."""
    deployment = pool.deployment_config
    actor: dict[str, Any] = {"num_cpus": 0, **deployment.ray_actor_options}
    if pool.runtime_env:
        actor["runtime_env"] = {**actor.get("runtime_env", {}), **pool.runtime_env}
    options: dict[str, Any] = {
        "name": AppArgs.deployment_name(role, group, pool),
        "ray_actor_options": actor,
        "request_router_config": {"request_router_class": "kairos_ray.serve.delivery:ChosenNodeRouter"},
        **deployment.serve_options(),
    }
    if pool.engine == "vllm":
        placement = pool.placement()
        options["placement_group_bundles"] = [dict(b) for b in placement.bundles]
        options["placement_group_strategy"] = placement.strategy
    elif pool.accelerator_type:
        actor["accelerator_type"] = pool.accelerator_type
    scaling = pool.autoscaling
    if scaling is None:
        options.update(deployment.replicas())
    else:
        options["autoscaling_config"] = {
            "min_replicas": scaling.min_replicas,
            "max_replicas": scaling.max_replicas,
            "initial_replicas": deployment.num_replicas or scaling.min_replicas,
            "look_back_period_s": scaling.look_back_period_s,
            # KairosPoolPolicy applies its own hold times and cooldown: Serve should act on its answer at once.
            "upscale_delay_s": 0.0,
            "downscale_delay_s": 0.0,
            "policy": {
                "policy_function": "kairos_ray.serve.autoscaling:KairosPoolPolicy",
                "policy_kwargs": {
                    "role": role.value,
                    "ttft_slo_s": kairos.slo.ttft_s,
                    **scaling.model_dump(exclude={"min_replicas", "max_replicas", "look_back_period_s"}),
                },
            },
        }
    return options


def _groups(role: Role, args: AppArgs, routers: list[Application], app_secret: bytes) -> list[Application]:
    """A deployment per node group of the role; its replicas get the validated sections themselves, not dicts to
    validate again."""
    kairos, serving = args.kairos, args.serving
    apps = []
    for group, pool in enumerate(args.groups(role)):
        options = pool_options(role, pool, kairos, group)
        if pool.engine == "vllm" and pool.placement().gpu:  # vLLM's workers go into the GPU bundles, as Serve LLM's
            kwargs = {"distributed_executor_backend": "ray", **pool.engine_kwargs}
            pool = pool.model_copy(update={"engine_kwargs": kwargs})
        profile = pool.profile or kairos.predictor.profile
        server = _deployment(EngineServer).options(**options)
        apps.append(server.bind(NodeId(role, "", group), kairos, serving, routers, pool, profile, app_secret))
    return apps


def build_app(args: AppArgs | dict[str, Any]) -> Application:
    """The application for ``serve run`` / ``serve.run``; ``args`` as in ``kairos_ray.serve.args``."""
    args = AppArgs.model_validate(args) if isinstance(args, dict) else args
    kairos, serving = args.kairos, args.serving
    group_profiles = tuple(
        (NodeId(role, "", group).group_name, pool.profile)
        for role in Role
        for group, pool in enumerate(args.groups(role))
        if pool.profile is not None
    )
    router_options = replace(serving.router_options(), group_profiles=group_profiles)
    routers = [  # a deployment per router shard, each with its own options (its shard number)
        _deployment(Router).options(name=name).bind(kairos, replace(router_options, shard=shard))
        for shard, name in enumerate(router_names(serving.router_shards))
    ]
    secret = secrets.token_bytes(32)  # this application's engines prove it to each other (KV channel pairs)
    decode = args.groups(Role.DECODE)[0]  # the groups serve one model one way: the ingress reads the first's
    vllm = decode.engine == "vllm"  # the ingress renders prompts as the decode engines will see them
    ingress = _deployment(Ingress).options(**ingress_options(args.ingress_deployment_config))
    return ingress.bind(
        routers,
        _groups(Role.PREFILL, args, routers, secret),
        _groups(Role.DECODE, args, routers, secret),
        decode.model_loading_config.model_id,
        serving,
        kairos.slo,
        decode.model_loading_config.source if vllm else None,
        decode.vllm_engine_kwargs() if vllm else None,  # its tokenizer and served name included
        decode.output_parsing() if vllm else None,  # its tool calling: the ingress parses the answers
    )
