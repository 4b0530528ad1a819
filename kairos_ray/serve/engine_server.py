"""The engine pools: one Serve deployment per pool, one replica per node.

A replica's node id is ``<role>-<replica unique id>``; calls name the node
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
from kairos_ray.core import StepLatencyModel
from kairos_ray.core.estimate import queue_wait_exact_s
from kairos_ray.core.policy import chunk_guard
from kairos_ray.engines import EngineRequest, KVHandoff, TokenEvent
from kairos_ray.engines.emulated import EmulatedEngine
from kairos_ray.serve.args import ServingConfig
from kairos_ray.serve.autoscaling import KV_FREE_SHARE, PREFILL_WAIT, TBT_HEADROOM
from kairos_ray.sim.hardware import ClusterHardware, GroundTruth


@serve.deployment(ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=120)
class EngineServer:
    """A node of the ``role`` pool."""

    async def __init__(
        self, role: str, kairos: dict[str, Any], serving: dict[str, Any], router: DeploymentHandle
    ) -> None:
        config = KairosConfig.model_validate(kairos)
        opts = ServingConfig.model_validate(serving)
        profile = resolve_profile(config.predictor.profile)
        self.model = model = StepLatencyModel.load(profile)
        self.hardware = hardware = ClusterHardware.from_profile(profile)
        self.params = params = config.policy_params()

        self.node_id = f"{role}-{serve.get_replica_context().replica_id.unique_id}"
        self.ray_node_id = ray.get_runtime_context().get_node_id()
        self.router = router
        self._reports: deque[Any] = deque(maxlen=32)
        self.engine = EmulatedEngine(
            self.node_id,
            role,
            GroundTruth(model, hardware),
            model,
            hardware,
            config.prefill_chunk_tokens,
            guard=chunk_guard(model, params) if config.policy.name == "kairos" else None,
            time_scale=opts.time_scale,
            kv_scale=opts.kv_scale,
            seed=opts.seed + zlib.crc32(self.node_id.encode()),
            report_interval_s=opts.report_interval_s,
            on_state=self._push,
        )
        self.engine.start()

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
        """Kairos's signals for ``serve.autoscaling.KairosPoolPolicy``."""
        if self.engine.role == "prefill":
            wait = queue_wait_exact_s(self.model, self.engine.prefill_node.view(), self.params.prefill_chunk_tokens)
            return {PREFILL_WAIT: wait}
        view = self.engine.decode_node.view()
        headroom = self.params.tbt_budget_s - self.model.step_s(view.batch_size, view.kv_tokens, 0)
        return {TBT_HEADROOM: headroom, KV_FREE_SHARE: view.headroom_kv_tokens / self.hardware.kv_capacity_tokens}
