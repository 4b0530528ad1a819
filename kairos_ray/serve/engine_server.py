"""A Serve deployment wrapping one engine (one prefill or decode node)."""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from kairos_ray.config import KairosConfig, resolve_profile
from kairos_ray.core import StepLatencyModel
from kairos_ray.core.sweep import largest_safe_chunk
from kairos_ray.engines import EngineRequest, KVHandoff, TokenEvent
from kairos_ray.engines.emulated import EmulatedEngine
from kairos_ray.serve.args import ServingConfig
from kairos_ray.sim.hardware import ClusterHardware, GroundTruth


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class EngineServer:
    """Node ``node_id`` of the ``role`` pool; pushes its state to the router after its steps."""

    async def __init__(
        self, node_id: str, role: str, kairos: dict[str, Any], serving: dict[str, Any], router: DeploymentHandle
    ) -> None:
        config = KairosConfig.model_validate(kairos)
        opts = ServingConfig.model_validate(serving)
        profile = resolve_profile(config.predictor.profile)
        model = StepLatencyModel.load(profile)
        hardware = ClusterHardware.from_profile(profile)
        params = config.policy_params()

        def guard(batch_size: int, kv_tokens: int, planned: int) -> int:
            return largest_safe_chunk(
                model, batch_size, kv_tokens, planned, params.chunk_candidates, params.tbt_budget_s
            )

        self.router = router
        self._reports: deque[Any] = deque(maxlen=32)
        self.engine = EmulatedEngine(
            node_id,
            role,
            GroundTruth(model, hardware),
            model,
            hardware,
            config.prefill_chunk_tokens,
            guard=guard if config.policy.name == "kairos" else None,
            time_scale=opts.time_scale,
            kv_scale=opts.kv_scale,
            seed=opts.seed + zlib.crc32(node_id.encode()),
            report_interval_s=opts.report_interval_s,
            on_state=self._push,
        )
        self.engine.start()

    def _push(self, state: dict[str, Any]) -> None:
        # Fire and forget; the last few responses stay referenced while they are in flight.
        self._reports.append(self.router.report.remote(state))

    async def prefill(self, request: EngineRequest) -> KVHandoff:
        return await self.engine.prefill(request)

    async def release(self, request_id: int) -> None:
        self.engine.release(request_id)

    async def generate(self, request: EngineRequest, handoff: KVHandoff | None) -> AsyncIterator[TokenEvent]:
        async for event in self.engine.generate(request, handoff):
            yield event

    async def state(self) -> dict[str, Any]:
        return self.engine.state()
