"""The engine pools: one Serve deployment per pool, one replica per node.

A replica builds the engine its pool's ``engine`` names (``engines.ENGINES``:
``vllm`` or ``emulated``) from a ``NodeSpec``. Its node id is ``<role>-<replica
unique id>``; calls name the node they want with the ``node`` keyword and
``serve.delivery.ChosenNodeRouter`` delivers them there. Each replica pushes
its engine's state to the router and reports Kairos's autoscaling signals
(``serve.autoscaling``) to Serve.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from kairos_ray.config import KairosConfig, resolve_profile
from kairos_ray.core import PrefillNodeView
from kairos_ray.core.estimate import queue_wait_exact_s
from kairos_ray.engines import NodeSpec, build_engine
from kairos_ray.messages import EngineRequest, KVHandoff, NodeState, Role, TokenEvent
from kairos_ray.serve.args import PoolConfig, ServingConfig
from kairos_ray.serve.autoscaling import KV_FREE_SHARE, PREFILL_WAIT, TBT_HEADROOM

HEALTH_CHECK_PERIOD_S = 2.0  # Serve asks every replica this often whether its engine is healthy
HEALTH_CHECK_TIMEOUT_S = 20.0  # a replica that does not answer in time (its process hung) is replaced


@serve.deployment(
    ray_actor_options={"num_cpus": 0},
    graceful_shutdown_timeout_s=120,
    health_check_period_s=HEALTH_CHECK_PERIOD_S,
    health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
    logging_config={"enable_access_log": False},  # calls are per request and per release: the ingress logs requests
)
class EngineServer:
    """A node of the ``role`` pool."""

    async def __init__(
        self,
        role: str,
        kairos: dict[str, Any],
        serving: dict[str, Any],
        router: DeploymentHandle,
        pool: dict[str, Any],
        app_secret: bytes = b"",
    ) -> None:
        config = KairosConfig.model_validate(kairos)
        options = ServingConfig.model_validate(serving)
        pool_config = PoolConfig.model_validate(pool)
        context = serve.get_replica_context()
        self.node_id = f"{role}-{context.replica_id.unique_id}"
        self.policy = config.build_policy()
        self.router = router
        self._reports: deque[Any] = deque(maxlen=32)
        spec = NodeSpec(
            node_id=self.node_id,
            role=Role(role),
            policy=self.policy,
            profile=str(resolve_profile(config.predictor.profile)),
            prefill_chunk_tokens=config.prefill_chunk_tokens,
            options=options.engine_options(),
            model_source=pool_config.model_loading_config.source,
            engine_kwargs=pool_config.vllm_engine_kwargs(),
            engine_metrics=pool_config.log_engine_metrics,
            local_rank=context.rank.local_rank,
            ray_node_id=ray.get_runtime_context().get_node_id(),
            app_name=context.app_name,
            app_secret=app_secret,
            on_state=self._push,
        )
        self.engine = build_engine(pool_config.engine, spec)
        await self.engine.start()

    async def __del__(self) -> None:
        """Serve calls this when it stops the replica."""
        if hasattr(self, "engine"):
            await self.engine.shutdown()

    def _push(self, state: NodeState) -> None:
        # Fire and forget; the last few responses stay referenced while they are in flight.
        self._reports.append(self.router.report.remote(state))

    # ``node`` and ``avoid`` are for ``serve.delivery.ChosenNodeRouter``, which picks the replica.

    async def prefill(self, request: EngineRequest, node: str | None = None, avoid: tuple[str, ...] = ()) -> KVHandoff:
        return await self.engine.prefill(request)

    async def release(self, request_id: int, node: str | None = None) -> None:
        self.engine.release(request_id)

    async def generate(
        self, request: EngineRequest, handoff: KVHandoff | None, node: str | None = None, avoid: tuple[str, ...] = ()
    ) -> AsyncIterator[list[TokenEvent]]:
        async for ready in self.engine.generate(request, handoff):
            yield ready

    def check_health(self) -> None:
        """Serve's health check: an engine that died or stalled fails it, and Serve replaces this replica."""
        self.engine.check_health()

    async def engine_pids(self, node: str | None = None) -> list[int]:
        """The processes that step this node's engine (for fault injection: ``bench.faults``)."""
        return self.engine.engine_pids()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Kairos's signals for ``serve.autoscaling.KairosPoolPolicy``, from this node's own view."""
        view = self.engine.state().view
        params, model = self.policy.params, self.policy.decode_model
        if isinstance(view, PrefillNodeView):
            return {PREFILL_WAIT: queue_wait_exact_s(model, view, params.prefill_chunk_tokens)}
        headroom = params.tbt_budget_s - model.step_s(view.batch_size, view.kv_tokens, 0)
        capacity = view.kv_tokens + view.free_kv_tokens
        return {TBT_HEADROOM: headroom, KV_FREE_SHARE: view.headroom_kv_tokens / capacity if capacity else 1.0}
