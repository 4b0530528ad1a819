"""Arguments of ``kairos_ray.serve:build_app``, close to Ray Serve LLM's ``build_pd_openai_app``.

A Ray Serve LLM user switches by changing ``import_path`` and adding the
``kairos`` section. Each pool's ``deployment_config.num_replicas`` is its
number of nodes: every node is its own one-replica deployment
(``prefill-0``, ``decode-1``, ...) so the router can address it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kairos_ray.config import KairosConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelLoadingConfig(_Strict):
    model_id: str = Field(description="name clients send as `model`")
    model_source: str | None = Field(None, description="weights location for vLLM (defaults to model_id)")


class DeploymentConfig(_Strict):
    num_replicas: int = Field(1, ge=1, description="nodes in this pool")
    max_ongoing_requests: int = Field(1024, ge=1)
    ray_actor_options: dict[str, Any] = Field(
        default_factory=dict, description="e.g. {num_gpus: 8, resources: {prefill_node: 1}}"
    )


class PoolConfig(_Strict):
    """One pool (prefill or decode): LLMConfig-like."""

    model_loading_config: ModelLoadingConfig
    engine: Literal["emulated", "vllm"] = Field("emulated", description="engine backend of every node")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="passed to vLLM as-is")
    deployment_config: DeploymentConfig = DeploymentConfig()
    accelerator_type: str | None = None


class ServingConfig(_Strict):
    """Knobs of the live service."""

    max_in_flight: int = Field(256, ge=1, description="requests admitted at once; beyond: 429 with Retry-After")
    retry_after_s: int = Field(1, ge=1)
    context_tokens: int = Field(32_768, ge=2, description="prompt + max_tokens must fit")
    decision_timeout_s: float = Field(1.0, gt=0, description="past it, plain disaggregation (counted)")
    report_interval_s: float = Field(0.02, gt=0, description="engines push state at most this often")
    time_scale: float = Field(1.0, gt=0, description="emulated engines: wall seconds per emulated second")
    kv_scale: int = Field(1000, ge=1, description="emulated engines: KV payload bytes divided by this")
    seed: int = 0


class AppArgs(_Strict):
    prefill_config: PoolConfig
    decode_config: PoolConfig
    kairos: KairosConfig = KairosConfig()
    serving: ServingConfig = ServingConfig()
