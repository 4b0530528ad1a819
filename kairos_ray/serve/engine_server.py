"""The engine pools: one Serve deployment per pool, one replica per node.

A pool's ``engine`` is ``emulated`` (the simulator's node model in wall-clock
time) or ``vllm`` (``engines.vllm_engine``: an ``AsyncLLM`` with the pool's
``engine_kwargs``). A replica's node id is ``<role>-<replica unique id>``; calls name the node
they want with the ``node`` keyword and ``serve.routing.NodeRouter`` delivers
them there. Each replica pushes its state to the router after its steps and
reports Kairos's autoscaling signals (``serve.autoscaling``) to Serve.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from kairos_ray.config import KairosConfig, resolve_profile
from kairos_ray.core import PrefillNodeView, StepLatencyModel
from kairos_ray.core.estimate import queue_wait_exact_s
from kairos_ray.emulation import ClusterHardware, GroundTruth
from kairos_ray.engines import EngineRequest, KVHandoff, TokenEvent
from kairos_ray.engines.emulated import EmulatedEngine
from kairos_ray.engines.vllm_args import guard_spec
from kairos_ray.engines.vllm_engine import VllmEngine, bind_cpu_core
from kairos_ray.serve.args import PoolConfig, ServingConfig
from kairos_ray.serve.autoscaling import KV_FREE_SHARE, PREFILL_WAIT, TBT_HEADROOM
from kairos_ray.serve.router import node_view


@serve.deployment(ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=120)
class EngineServer:
    """A node of the ``role`` pool."""

    async def __init__(
        self, role: str, kairos: dict[str, Any], serving: dict[str, Any], router: DeploymentHandle, pool: dict[str, Any]
    ) -> None:
        config = KairosConfig.model_validate(kairos)
        opts = ServingConfig.model_validate(serving)
        pool_config = PoolConfig.model_validate(pool)
        profile = resolve_profile(config.predictor.profile)
        self.model = model = StepLatencyModel.load(profile)
        hardware = ClusterHardware.from_profile(profile)
        self.params = params = config.policy_params()
        policy = config.build_policy(model=model)

        self.node_id = f"{role}-{serve.get_replica_context().replica_id.unique_id}"
        self.ray_node_id = ray.get_runtime_context().get_node_id()
        self.router = router
        self._reports: deque[Any] = deque(maxlen=32)
        self.engine: EmulatedEngine | VllmEngine
        if pool_config.engine == "vllm":
            bind_cpu_core(role, serve.get_replica_context().rank.local_rank)
            self.engine = VllmEngine(
                self.node_id,
                role,
                pool_config.model_loading_config.source,
                pool_config.engine_kwargs,
                predictor=model,
                guard=guard_spec(model, params.chunk_candidates, params.tbt_budget_s) if policy.guards_chunks else None,
                kv_timeout_s=opts.kv_timeout_s,
                report_interval_s=opts.report_interval_s,
                on_state=self._push,
                kv_channel=opts.kv_channel,
                hold_blocks=opts.kv_hold_blocks,
            )
            await self.engine.start()
            return
        self.engine = EmulatedEngine(
            self.node_id,
            role,
            GroundTruth(model, hardware),
            model,
            hardware,
            config.prefill_chunk_tokens,
            guard=policy.chunk_guard(),
            time_scale=opts.time_scale,
            kv_scale=opts.kv_scale,
            seed=opts.seed + zlib.crc32(self.node_id.encode()),
            report_interval_s=opts.report_interval_s,
            on_state=self._push,
        )
        self.engine.start()

    def __del__(self) -> None:
        if isinstance(getattr(self, "engine", None), VllmEngine):
            self.engine.shutdown()

    def _push(self, state: dict[str, Any]) -> None:
        # Fire and forget; the last few responses stay referenced while they are in flight.
        self._reports.append(self.router.report.remote({**state, "ray_node_id": self.ray_node_id}))

    async def prefill(self, request: EngineRequest, node: str | None = None) -> KVHandoff:
        return await self.engine.prefill(request)

    async def release(self, request_id: int, node: str | None = None) -> None:
        self.engine.release(request_id)

    async def generate(
        self, request: EngineRequest, handoff: KVHandoff | None, node: str | None = None
    ) -> AsyncIterator[TokenEvent]:
        async for event in self.engine.generate(request, handoff):
            yield event

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Kairos's signals for ``serve.autoscaling.KairosPoolPolicy``, from this node's own view."""
        view = node_view(self.engine.state())
        if isinstance(view, PrefillNodeView):
            return {PREFILL_WAIT: queue_wait_exact_s(self.model, view, self.params.prefill_chunk_tokens)}
        headroom = self.params.tbt_budget_s - self.model.step_s(view.batch_size, view.kv_tokens, 0)
        capacity = view.kv_tokens + view.free_kv_tokens
        return {TBT_HEADROOM: headroom, KV_FREE_SHARE: view.headroom_kv_tokens / capacity if capacity else 1.0}
