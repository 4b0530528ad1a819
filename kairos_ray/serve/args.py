"""Arguments of ``kairos_ray.serve:build_app``, close to Ray Serve LLM's ``build_pd_openai_app``.

A Ray Serve LLM user switches by changing ``import_path`` and adding the
``kairos`` section. Each pool's ``deployment_config.num_replicas`` is its
number of nodes (its initial number with an ``autoscaling`` section).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kairos_ray.config import KairosConfig
from kairos_ray.core import parse_spec
from kairos_ray.engines import ENGINES, EngineOptions
from kairos_ray.serve.autoscaling import ScalingRule

SHIPPED_MODELS = resources.files("kairos_ray") / "models"
RULE = ScalingRule()
ENGINE = EngineOptions()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelLoadingConfig(_Strict):
    model_id: str = Field(description="name clients send as `model`")
    model_source: str | None = Field(
        None, description="weights for vLLM: a path, a Hub name or a model shipped in kairos_ray/models (tiny-llama)"
    )

    @property
    def source(self) -> str:
        """Where vLLM loads the model from (a shipped model's name becomes its folder)."""
        name = self.model_source or self.model_id
        shipped = SHIPPED_MODELS / name
        return str(shipped) if not Path(name).exists() and shipped.is_dir() else name


class DeploymentConfig(_Strict):
    num_replicas: int = Field(1, ge=1, description="nodes in this pool")
    max_ongoing_requests: int = Field(1024, ge=1)
    ray_actor_options: dict[str, Any] = Field(
        default_factory=dict, description="e.g. {num_gpus: 8, resources: {prefill_node: 1}}"
    )


class PoolAutoscaling(_Strict):
    """Scale the pool on Kairos's signals (``kairos_ray.serve.autoscaling``)."""

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(4, ge=1)
    wait_share: float = Field(
        RULE.wait_share, gt=0, description="prefill: scale out when the mean wait > this share of TTFT SLO"
    )
    quiet_share: float = Field(RULE.quiet_share, ge=0, description="prefill: scale in when the mean wait < this share")
    min_tbt_headroom_s: float = Field(
        RULE.min_tbt_headroom_s, ge=0, description="decode: scale out below this TBT headroom"
    )
    min_kv_free_share: float = Field(
        RULE.min_kv_free_share, ge=0, le=1, description="decode: scale out below this free KV share"
    )
    upscale_after_s: float = Field(RULE.upscale_after_s, ge=0, description="pressure must hold this long")
    downscale_after_s: float = Field(RULE.downscale_after_s, ge=0, description="quiet must hold this long")
    cooldown_s: float = Field(RULE.cooldown_s, ge=0, description="least time between two changes")
    look_back_period_s: float = Field(
        30.0,
        gt=0,
        description="Serve averages the signals over this window (replicas push them every 10 s, "
        "or every RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S)",
    )

    @model_validator(mode="after")
    def _bounds(self) -> PoolAutoscaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas})")
        if self.quiet_share >= self.wait_share:
            raise ValueError(f"quiet_share ({self.quiet_share}) must be below wait_share ({self.wait_share})")
        return self


class PoolConfig(_Strict):
    """One pool (prefill or decode): LLMConfig-like."""

    model_loading_config: ModelLoadingConfig
    engine: str = Field("emulated", description=f"engine backend of every node: {', '.join(ENGINES)}")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="passed to vLLM as-is")
    deployment_config: DeploymentConfig = DeploymentConfig()
    accelerator_type: str | None = None
    autoscaling: PoolAutoscaling | None = Field(None, description="absent: a fixed num_replicas nodes")

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        if value not in ENGINES:
            raise ValueError(f"unknown engine; known: {', '.join(ENGINES)}")
        return value

    @model_validator(mode="after")
    def _initial_within_bounds(self) -> PoolConfig:
        scaling, initial = self.autoscaling, self.deployment_config.num_replicas
        if scaling is not None and not scaling.min_replicas <= initial <= scaling.max_replicas:
            raise ValueError(
                f"deployment_config.num_replicas ({initial}) must lie within autoscaling "
                f"[{scaling.min_replicas}, {scaling.max_replicas}]"
            )
        return self


class ServingConfig(_Strict):
    """Knobs of the live service."""

    max_in_flight: int = Field(256, ge=1, description="requests admitted at once; beyond: 429 with Retry-After")
    retry_after_s: int = Field(1, ge=1)
    max_body_bytes: int = Field(4 << 20, ge=1024, description="larger request bodies get 413 at once")
    context_tokens: int = Field(32_768, ge=2, description="prompt + max_tokens must fit")
    decision_timeout_s: float = Field(1.0, gt=0, description="past it, plain disaggregation (counted)")
    first_token_timeout_s: float = Field(
        120.0, gt=0, description="a request with no first token by then ends with 504 (retries included)"
    )
    token_stall_timeout_s: float = Field(
        30.0, gt=0, description="a stream with no new token for this long ends with an error event"
    )
    max_attempts: int = Field(
        3, ge=1, description="tries before the first token: a failed node's request is re-decided on the others"
    )
    max_migrations: int = Field(
        2, ge=0, description="after the first token, moves of a request whose decode node failed to another one"
    )
    engine_stall_timeout_s: float = Field(
        ENGINE.stall_timeout_s,
        gt=0,
        description="an engine with work that makes no progress (or does not answer a ping) this long is unhealthy",
    )
    api_keys: tuple[str, ...] = Field((), description="accepted API keys (Authorization: Bearer); none: open")
    api_key_env: str | None = Field(
        "KAIROS_API_KEY", description="environment variable with more API keys (comma-separated)"
    )
    api_key_file: str | None = Field(None, description="file with more API keys, one per line")
    require_api_key: bool = Field(False, description="refuse to start without an API key")
    report_interval_s: float = Field(
        ENGINE.report_interval_s, gt=0, description="engines push a change of queue, batch or commitments this often"
    )
    report_refresh_s: float = Field(
        ENGINE.report_refresh_s, gt=0, description="engines push their state otherwise this often while they step"
    )
    time_scale: float = Field(ENGINE.time_scale, gt=0, description="emulated engines: wall seconds per emulated second")
    kv_scale: int = Field(ENGINE.kv_scale, ge=1, description="emulated engines: KV payload bytes divided by this")
    kv_timeout_s: float = Field(
        ENGINE.kv_timeout_s,
        gt=0,
        description="decode nodes: past this wait for a hand-off's KV, recompute the prompt",
    )
    kv_channel: Literal["gloo", "nccl"] | None = Field(
        ENGINE.kv_channel,
        description="vLLM engines: send hand-off KV straight to the decode node over point-to-point gloo "
        "(CPU) or NCCL (GPU) pairs instead of the Ray object store",
    )
    kv_hold_blocks: bool = Field(
        ENGINE.kv_hold_blocks,
        description="vLLM prefill nodes keep a hand-off's KV blocks until the decode node has the KV "
        "(default: free them once the staged host copy is whole)",
    )
    refit_every_steps: int = Field(
        0, ge=0, description="router refits the step-latency model every N reported steps (0: never)"
    )
    seed: int = Field(ENGINE.seed, description="emulated engines: step-noise seed")

    def engine_options(self) -> EngineOptions:
        """What the engines use of this section."""
        return EngineOptions(
            report_interval_s=self.report_interval_s,
            report_refresh_s=self.report_refresh_s,
            kv_timeout_s=self.kv_timeout_s,
            kv_channel=self.kv_channel,
            kv_hold_blocks=self.kv_hold_blocks,
            time_scale=self.time_scale,
            kv_scale=self.kv_scale,
            seed=self.seed,
            stall_timeout_s=self.engine_stall_timeout_s,
        )


class AppArgs(_Strict):
    prefill_config: PoolConfig
    decode_config: PoolConfig
    kairos: KairosConfig = KairosConfig()
    serving: ServingConfig = ServingConfig()

    @model_validator(mode="after")
    def _pools_match(self) -> AppArgs:
        """A decode node continues what a prefill node started: same engine, same model."""
        prefill, decode = self.prefill_config, self.decode_config
        if parse_spec(self.kairos.policy.name)[0].decides_with_ground_truth:
            raise ValueError(
                f"kairos.policy.name {self.kairos.policy.name!r} decides with the emulator's ground truth: "
                "the simulator only"
            )
        if prefill.engine != decode.engine:
            raise ValueError(
                f"prefill_config.engine ({prefill.engine}) and decode_config.engine ({decode.engine}) differ"
            )
        for knob in ("kv_channel", "kv_hold_blocks"):
            if getattr(self.serving, knob) and prefill.engine != "vllm":
                raise ValueError(f"serving.{knob} is for vLLM engines' KV; the pools run {prefill.engine} engines")
        p_model, d_model = prefill.model_loading_config, decode.model_loading_config
        if (p_model.model_id, p_model.source) != (d_model.model_id, d_model.source):
            raise ValueError(
                f"both pools must serve one model: prefill has {p_model.model_id!r} from {p_model.source!r}, "
                f"decode {d_model.model_id!r} from {d_model.source!r}"
            )
        return self
