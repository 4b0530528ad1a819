"""The engine pools: one Serve deployment per pool, one replica per node.

A replica builds the engine its pool's ``engine`` names (``engines.ENGINES``:
``vllm`` or ``emulated``) from a ``NodeSpec``. Its node id is ``<group>-<replica
unique id>`` (``messages.NodeId``; a pool of several node groups has a deployment
per group); calls name the node they want with the ``node`` keyword and
``serve.delivery.ChosenNodeRouter`` delivers them there. Each replica pushes
its engine's state to the router and reports Kairos's autoscaling signals
(``serve.autoscaling``) to Serve.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from kairos_ray.config import KairosConfig, resolve_profile
from kairos_ray.core import StepLatencyModel
from kairos_ray.engines import NodeSpec, build_engine
from kairos_ray.messages import EngineRequest, KVHandoff, NodeId, NodeState, Residue, TokenBatch
from kairos_ray.serve.args import PoolConfig, ServingConfig
from kairos_ray.serve.autoscaling import node_signals
from kairos_ray.serve.mux import Outbox, RequestKey
from kairos_ray.serve.router_link import RouterLink

SUBSCRIPTION_IDLE_S = 2.0  # a token subscription with nothing to carry for this long ends (serve.mux)
UNCLAIMED_OUTBOX_S = 60.0  # an outbox whose listener has not subscribed by then is dropped, its runs cancelled
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
    """A node of the node group ``group`` names (its role and index; ``replica`` is left empty there), its
    step-latency ``profile`` the group's."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        group: NodeId,
        config: KairosConfig,
        options: ServingConfig,
        routers: list[DeploymentHandle[Any]],
        pool_config: PoolConfig,
        profile: str,
        app_secret: bytes = b"",
    ) -> None:
        context = serve.get_replica_context()
        role = group.role
        self.node_id = str(replace(group, replica=context.replica_id.unique_id))
        profile_path = resolve_profile(profile)
        self.policy = config.build_policy(model=StepLatencyModel.load(profile_path))
        self.routers = [RouterLink(router) for router in routers]  # every shard takes every node's reports
        for link in self.routers:
            link.bind(asyncio.get_running_loop())
        self._outboxes: dict[str, Outbox] = {}  # ingress replica -> the tokens waiting for its next item
        self._runs: dict[RequestKey, asyncio.Task[None]] = {}  # (request id, attempt) -> its generation here
        spec = NodeSpec(
            node_id=self.node_id,
            role=role,
            policy=self.policy,
            profile=str(profile_path),
            prefill_chunk_tokens=config.prefill_chunk_tokens,
            options=options.engine_options(),
            model_source=pool_config.model_loading_config.source,
            engine_kwargs=pool_config.vllm_engine_kwargs(),
            engine_metrics=pool_config.log_engine_metrics,
            local_rank=context.rank.local_rank,
            ray_node_id=ray.get_runtime_context().get_node_id(),
            app_name=context.app_name,
            app_secret=app_secret,
            on_state=self._report,
        )
        self.engine = build_engine(pool_config.engine, spec)
        await self.engine.start()

    def _report(self, state: NodeState) -> None:
        """The node's state to every router shard (each keeps every node's, to take over a dead shard's)."""
        for link in self.routers:
            link.report(state)

    async def __del__(self) -> None:
        """Serve calls this when it stops the replica."""
        if hasattr(self, "engine"):
            await self.engine.shutdown()

    # ``node`` and ``avoid`` are for ``serve.delivery.ChosenNodeRouter``, which picks the replica.

    async def prefill(self, request: EngineRequest, node: str | None = None, avoid: tuple[str, ...] = ()) -> KVHandoff:
        return await self.engine.prefill(request)

    async def release(self, request_id: int, node: str | None = None) -> None:
        self.engine.release(request_id)

    # Decode nodes stream tokens over one subscription per ingress replica (``serve.mux``).

    async def start(
        self,
        request: EngineRequest,
        handoff: KVHandoff | None,
        listener: str,
        node: str | None = None,
        avoid: tuple[str, ...] = (),
    ) -> str:
        """Start generating ``request`` (from ``handoff``'s KV, or deflected) for ``listener``; this node's id.

        Its tokens go out on ``listener``'s subscription to this node.
        """
        outbox = self._outbox(listener)
        key = (request.request_id, request.attempt)
        run = asyncio.get_running_loop().create_task(self._run(request, handoff, outbox, key))
        self._runs[key] = run
        outbox.runs.add(key)

        def done(_: asyncio.Task[None]) -> None:
            self._runs.pop(key, None)
            outbox.runs.discard(key)

        run.add_done_callback(done)
        return self.node_id

    async def _run(self, request: EngineRequest, handoff: KVHandoff | None, outbox: Outbox, key: RequestKey) -> None:
        try:
            async for ready in self.engine.generate(request, handoff):
                outbox.put(key, ready)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the ingress runs it elsewhere: tell it why
            outbox.fail(key, f"{type(exc).__name__}: {exc}")

    def _outbox(self, listener: str) -> Outbox:
        outbox = self._outboxes.get(listener)
        if outbox is None:  # a new listener only: no Outbox built per call
            outbox = self._outboxes[listener] = Outbox()
            asyncio.get_running_loop().call_later(UNCLAIMED_OUTBOX_S, self._unclaimed, listener, outbox)
        return outbox

    def _unclaimed(self, listener: str, outbox: Outbox) -> None:
        """Drop an outbox no subscription ever read (its listener died between a ``start`` and its ``subscribe``)."""
        if outbox.subscribed or self._outboxes.get(listener) is not outbox:
            return
        del self._outboxes[listener]
        for key in list(outbox.runs):
            run = self._runs.get(key)
            if run is not None:
                run.cancel()

    async def cancel(self, request_id: int, attempt: int, node: str | None = None) -> None:
        """The request's client went away (or it moved on): stop generating it here."""
        run = self._runs.get((request_id, attempt))
        if run is not None:
            run.cancel()

    async def subscribe(self, listener: str, node: str | None = None) -> AsyncIterator[TokenBatch]:
        """The tokens of ``listener``'s requests on this node, a batch per item, while it listens and they run.

        It ends once idle (no request of the listener here, nothing sent for
        ``SUBSCRIPTION_IDLE_S``): an open call would keep this replica from
        draining, and the listener may be gone. The listener subscribes
        again with its next request here; tokens wait in the outbox meanwhile.
        """
        if node is not None and node != self.node_id:
            raise LookupError(f"{node} is gone (this is {self.node_id})")
        outbox = self._outbox(listener)
        outbox.subscribed = True
        try:
            while (batch := await outbox.take(SUBSCRIPTION_IDLE_S)) is not None:
                yield batch
        finally:  # idle, or the listener has gone: no one will read what its requests make here
            for key in list(outbox.runs):
                run = self._runs.get(key)
                if run is not None:
                    run.cancel()
            if self._outboxes.get(listener) is outbox:
                del self._outboxes[listener]

    def check_health(self) -> None:
        """Serve's health check: an engine that died or stalled fails it, and Serve replaces this replica."""
        self.engine.check_health()

    async def residue(self, node: str | None = None) -> Residue:
        """What this node keeps per request (``messages.Residue``): all 0 once idle."""
        counts = {"runs": len(self._runs), "outboxes": len(self._outboxes), **self.engine.residue()}
        return Residue(self.node_id, counts)

    async def engine_pids(self, node: str | None = None) -> list[int]:
        """The processes that step this node's engine (for fault injection: ``bench.faults``)."""
        return self.engine.engine_pids()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Kairos's signals for ``serve.autoscaling.KairosPoolPolicy``, from this node's own view."""
        return node_signals(self.policy, self.engine.state().view)
