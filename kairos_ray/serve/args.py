"""Arguments of ``kairos_ray.serve:build_app``: Ray Serve LLM's ``build_pd_openai_app`` arguments, plus Kairos's.

A Ray Serve LLM user switches by changing ``import_path`` alone. Each pool
(``prefill_config``, ``decode_config``) takes what Ray Serve LLM's ``LLMConfig``
takes; a vLLM pool is also checked with that very model (``ray.serve.llm``,
which imports where vLLM does), an emulated pool with this module's models
alone. On top of ``LLMConfig``: ``engine`` (``vllm``, the default, or
``emulated``), ``autoscaling`` (scaling on Kairos's signals), ``profile`` (the
nodes' step-latency profile) and the app's ``kairos`` and ``serving`` sections.
Each replica of a pool is one node; a pool given as a list is a list of node
groups (a mixed fleet), each a deployment of its own (``AppArgs``).

What ``LLMConfig``'s fields mean here, as in Ray Serve LLM:

- ``model_loading_config``: ``model_id`` is the name clients send;
  ``model_source`` a path, a Hub name or a model shipped in
  ``kairos_ray/models``; ``tokenizer_source`` the ingress's and vLLM's tokenizer.
- ``engine_kwargs``: vLLM's engine arguments, as-is (``model`` and
  ``served_model_name`` come from ``model_loading_config``).
- ``accelerator_config``, ``placement_group_config``, ``accelerator_type``:
  each replica's placement group, built by Ray Serve LLM's own code: a bundle
  per vLLM worker (tensor x pipeline parallel) asking for the accelerator,
  the replica's own ``ray_actor_options`` added to the first. On GPU bundles
  vLLM runs its workers as Ray actors in them (``distributed_executor_backend:
  ray``), on CPU ones inside the replica. An emulated pool's replica asks for
  ``accelerator_type`` itself.
- ``runtime_env``: the replicas' ``runtime_env`` (over
  ``ray_actor_options.runtime_env``); vLLM's processes inherit it.
- ``deployment_config``: the pool deployment's Serve options;
  ``autoscaling_config`` is Serve's request-based autoscaling, with Ray Serve
  LLM's default target.
- ``log_engine_metrics``: vLLM's own metrics as Ray metrics (``ray_vllm_*``),
  on by default.
- ``llm_engine``: ``vLLM``, the only value Ray Serve LLM knows.

Tool calling, as Ray Serve LLM users set it: vLLM's OpenAI-server arguments
``enable_auto_tool_choice``, ``tool_call_parser``, ``tool_strict_level`` and
``exclude_tools_when_tool_choice_none`` in the decode pool's ``engine_kwargs``
(``OUTPUT_PARSING``) go to the ingress, which renders and parses chats with
them (``serve.parsing``), not to the engines; ``reasoning_parser``, an engine
argument, goes to both.

Refused with the reason, never ignored: ``lora_config``, ``server_cls``,
``experimental_configs``, ``callback_config``, a cloud ``model_source``,
TPUs, vLLM's other OpenAI front-end arguments in ``engine_kwargs`` (and tool
calling set on the prefill pool alone), and the
``deployment_config`` options Kairos sets itself (``request_router_config``,
``user_config``, ``placement_group_bundles`` / ``_strategy``).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray.llm._internal.serve.constants import DEFAULT_MAX_TARGET_ONGOING_REQUESTS
from ray.serve.config import AutoscalingConfig

from kairos_ray.config import KairosConfig, resolve_profile
from kairos_ray.core import parse_spec
from kairos_ray.engines import ENGINES, EngineOptions
from kairos_ray.messages import NodeId, Role
from kairos_ray.serve.autoscaling import ScalingRule
from kairos_ray.serve.types import RouterOptions

SHIPPED_MODELS = resources.files("kairos_ray") / "models"
RULE = ScalingRule()
ENGINE = EngineOptions()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _refuse(data: Any, refused: dict[str, str]) -> Any:
    """``data`` without the keys of ``refused`` left empty; a key given a value is an error naming it and why."""
    if not isinstance(data, dict):
        return data
    given = [key for key in refused if data.get(key) not in (None, {}, [])]
    if given:
        raise ValueError("; ".join(f"{key}: {refused[key]}" for key in given))
    return {key: value for key, value in data.items() if key not in refused}


class ModelLoadingConfig(_Strict):
    """Ray Serve LLM's ``model_loading_config``."""

    model_id: str = Field(description="name clients send as `model`")
    model_source: str | None = Field(
        None, description="weights: a path, a Hub name or a model shipped in kairos_ray/models (tiny-llama)"
    )
    tokenizer_source: str | None = Field(None, description="tokenizer, if not the model's (a path or a Hub name)")

    @field_validator("model_source", mode="before")
    @classmethod
    def _no_cloud_mirror(cls, value: Any) -> Any:
        if isinstance(value, dict):
            raise ValueError(
                "cloud mirrors (bucket_uri) are not fetched by Kairos-Ray: download the weights and give their path"
            )
        return value

    @property
    def source(self) -> str:
        """Where vLLM loads the model from (a shipped model's name becomes its folder)."""
        name = self.model_source or self.model_id
        shipped = SHIPPED_MODELS / name
        return str(shipped) if not Path(name).exists() and shipped.is_dir() else name

    @property
    def tokenizer(self) -> str:
        """Where the tokenizer comes from: ``tokenizer_source``, else the model's."""
        return self.tokenizer_source or self.source


DeploymentName = Annotated[str, Field(min_length=1)]


class DeploymentConfig(_Strict):
    """The pool deployment's Serve options (Ray Serve LLM's ``deployment_config``): a replica per node."""

    name: DeploymentName | None = Field(None, description="deployment name (default: the pool's role)")
    num_replicas: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        None, description="nodes in this pool (default 1; with an autoscaling section, its initial number)"
    )
    max_ongoing_requests: int = Field(1024, ge=1)
    max_queued_requests: int | None = None
    max_replicas_per_node: int | None = Field(None, ge=1)
    ray_actor_options: dict[str, Any] = Field(
        default_factory=dict, description="the replica's own resources, e.g. {resources: {prefill_node: 1}}"
    )
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Serve's request-based autoscaling (Kairos's own: the pool's autoscaling section)"
    )
    health_check_period_s: float | None = Field(None, gt=0)
    health_check_timeout_s: float | None = Field(None, gt=0)
    graceful_shutdown_wait_loop_s: float | None = Field(None, gt=0)
    graceful_shutdown_timeout_s: float | None = Field(None, ge=0)
    logging_config: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _kairos_options(cls, data: Any) -> Any:
        return _refuse(
            data,
            {
                "request_router_config": "Kairos delivers each call to the node its router chose "
                "(kairos_ray.serve.delivery)",
                "user_config": "the engine servers take no user_config",
                "placement_group_bundles": "set the pool's placement_group_config, as with Ray Serve LLM",
                "placement_group_strategy": "set the pool's placement_group_config, as with Ray Serve LLM",
            },
        )

    @field_validator("autoscaling_config")
    @classmethod
    def _serve_autoscaling(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            unknown = sorted(set(value) - set(AutoscalingConfig.model_fields))
            if unknown:
                raise ValueError(f"unknown autoscaling_config options {unknown}")
            AutoscalingConfig.model_validate(value)
        return value

    @model_validator(mode="after")
    def _replicas_or_autoscaling(self) -> DeploymentConfig:
        if isinstance(self.num_replicas, int) and self.autoscaling_config is not None:
            raise ValueError("give num_replicas or autoscaling_config, not both (as Serve requires)")
        return self

    def serve_options(self) -> dict[str, Any]:
        """The Serve options given here that pass as they are (not name, replicas, actor options)."""
        return self.model_dump(
            exclude={"name", "num_replicas", "ray_actor_options", "autoscaling_config"}, exclude_none=True
        )

    def replicas(self) -> dict[str, Any]:
        """Serve's ``num_replicas`` or ``autoscaling_config`` (Ray Serve LLM's default target filled in)."""
        if self.autoscaling_config is not None:
            ray_default = {"target_ongoing_requests": DEFAULT_MAX_TARGET_ONGOING_REQUESTS}
            return {"autoscaling_config": {**ray_default, **self.autoscaling_config}}
        return {"num_replicas": self.num_replicas or 1}


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


@dataclass(frozen=True, slots=True)
class Placement:
    """The placement group of each replica of a vLLM pool, as Ray Serve LLM builds it."""

    bundles: tuple[dict[str, float], ...]  # a bundle per vLLM worker; the first also holds the replica's own resources
    strategy: str  # PACK, STRICT_PACK, SPREAD or STRICT_SPREAD
    gpu: bool  # GPU bundles: vLLM runs its workers as Ray actors in them (distributed_executor_backend ray)


OUTPUT_PARSING = (
    "enable_auto_tool_choice",
    "tool_call_parser",
    "tool_strict_level",
    "exclude_tools_when_tool_choice_none",
)
"""vLLM OpenAI-server arguments a pool's ``engine_kwargs`` may carry: the ingress's tool calling (``serve.parsing``)."""

VLLM_ONLY = ("engine_kwargs", "llm_engine", "accelerator_config", "placement_group_config", "log_engine_metrics")
"""Pool fields that only vLLM engines use: an emulated pool that sets one is refused."""


class PoolConfig(_Strict):
    """One pool (prefill or decode): Ray Serve LLM's ``LLMConfig`` plus ``engine`` and ``autoscaling``."""

    model_loading_config: ModelLoadingConfig
    engine: str = Field("vllm", description=f"engine backend of every node: {', '.join(ENGINES)}")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="passed to vLLM as-is")
    llm_engine: Literal["vLLM"] = "vLLM"
    accelerator_type: str | None = Field(None, description="e.g. A100: replicas run on nodes with that accelerator")
    accelerator_config: dict[str, Any] | None = Field(None, description="{kind: gpu | cpu} (default: inferred)")
    placement_group_config: dict[str, Any] | None = Field(
        None, description="{bundle_per_worker: {...}} or {bundles: [...]}, and a strategy (default PACK)"
    )
    runtime_env: dict[str, Any] | None = Field(None, description="the replicas' runtime_env (env_vars, ...)")
    deployment_config: DeploymentConfig = DeploymentConfig()
    log_engine_metrics: bool = Field(True, description="export vLLM's engine metrics as Ray metrics (ray_vllm_*)")
    autoscaling: PoolAutoscaling | None = Field(None, description="absent: a fixed num_replicas nodes")
    profile: str | None = Field(
        None,
        description="step-latency profile of these nodes, a shipped name or a path (default: "
        "kairos.predictor.profile): the router prices them with it, emulated engines run at its speed",
    )

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return _refuse(
            data,
            {
                "lora_config": "LoRA adapters are not served by Kairos-Ray",
                "server_cls": "every pool runs Kairos's engine server",
                "experimental_configs": "Ray Serve LLM's experimental options do not apply to Kairos-Ray",
                "callback_config": "model-initialization callbacks are not run by Kairos-Ray",
            },
        )

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        if value not in ENGINES:
            raise ValueError(f"unknown engine; known: {', '.join(ENGINES)}")
        return value

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, value: str | None) -> str | None:
        if value is not None:
            resolve_profile(value)
        return value

    @field_validator("engine_kwargs")
    @classmethod
    def _model_from_loading_config(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in ("model", "served_model_name"):
            if key in value:
                raise ValueError(f"{key} comes from model_loading_config, not engine_kwargs (as in Ray Serve LLM)")
        if value.get("disable_log_stats"):
            raise ValueError("disable_log_stats: Kairos needs vLLM's per-step stats for the router")
        return value

    @model_validator(mode="after")
    def _engine_fields(self) -> PoolConfig:
        if self.engine != "vllm":
            given = [f for f in VLLM_ONLY if f in self.model_fields_set]
            if self.model_loading_config.tokenizer_source is not None:
                given.append("model_loading_config.tokenizer_source")
            if given:
                raise ValueError(f"{', '.join(given)}: for vLLM engines; this pool runs {self.engine} engines")
        scaling, replicas = self.autoscaling, self.deployment_config.num_replicas
        if scaling is not None:
            if self.deployment_config.autoscaling_config is not None or replicas == "auto":
                raise ValueError(
                    "autoscaling (Kairos's signals) and deployment_config.autoscaling_config or num_replicas: auto "
                    "(Serve's) both scale the pool: keep one"
                )
            if replicas is not None and not scaling.min_replicas <= replicas <= scaling.max_replicas:
                raise ValueError(
                    f"deployment_config.num_replicas ({replicas}) must lie within autoscaling "
                    f"[{scaling.min_replicas}, {scaling.max_replicas}]"
                )
        return self

    def vllm_engine_kwargs(self) -> dict[str, Any]:
        """vLLM's arguments for a node: ``engine_kwargs`` but the ingress's (``OUTPUT_PARSING``), the served name
        and tokenizer (as Ray Serve LLM)."""
        engine = {k: v for k, v in self.engine_kwargs.items() if k not in OUTPUT_PARSING}
        kwargs = {"served_model_name": self.model_loading_config.model_id, **engine}
        if self.model_loading_config.tokenizer_source is not None:
            kwargs.setdefault("tokenizer", self.model_loading_config.tokenizer_source)
        return kwargs

    def output_parsing(self) -> dict[str, Any]:
        """The ingress's tool-calling arguments among ``engine_kwargs`` (``OUTPUT_PARSING``)."""
        return {k: v for k, v in self.engine_kwargs.items() if k in OUTPUT_PARSING}

    def placement(self) -> Placement:
        """A vLLM pool's placement group, from Ray Serve LLM's own ``LLMConfig``, which checks the pool first."""
        try:
            from ray.serve.llm import LLMConfig
        except ImportError as exc:
            raise ValueError(f"a vLLM pool needs Ray Serve LLM (ray.serve.llm), which does not import: {exc}") from exc
        fields = self.model_dump(exclude={"engine", "autoscaling", "profile"}, exclude_unset=True)
        try:
            llm = LLMConfig.model_validate(fields)
            engine = llm.get_engine_config()
        except ValueError as exc:  # pydantic's ValidationError included
            raise ValueError(f"Ray Serve LLM's LLMConfig refuses it: {exc}") from exc
        assert llm.accelerator_config is not None and engine is not None, "LLMConfig fills both in"
        kind = llm.accelerator_config.kind
        if kind not in ("gpu", "cpu"):
            raise ValueError(f"accelerator_config: kind {kind!r}: Kairos-Ray runs vLLM on GPUs or CPUs")
        served = set(engine.frontend_kwargs) - set(OUTPUT_PARSING)
        if served:
            raise ValueError(
                f"engine_kwargs {sorted(served)}: arguments of vLLM's OpenAI server, which Kairos-Ray does not run "
                f"(its ingress answers the OpenAI API, and takes only {', '.join(OUTPUT_PARSING)})"
            )
        loading = self.model_loading_config
        tokenizer = loading.tokenizer_source or loading.source
        _check_parsers(self.output_parsing(), self.engine_kwargs.get("reasoning_parser"), tokenizer)
        actor = self.deployment_config.ray_actor_options
        own = {"CPU": actor.get("num_cpus", 0), "GPU": actor.get("num_gpus", 0), **actor.get("resources", {})}
        if "memory" in actor:
            own["memory"] = actor["memory"]
        bundles = [dict(b) for b in engine.placement_bundles]
        bundles[0] = {k: bundles[0].get(k, 0) + own.get(k, 0) for k in bundles[0].keys() | own.keys()}
        bundles = [{k: v for k, v in b.items() if v} for b in bundles]
        gpu = kind == "gpu"
        executor = self.engine_kwargs.get("distributed_executor_backend", "ray")
        if gpu and executor != "ray":
            raise ValueError(
                f"engine_kwargs.distributed_executor_backend {executor!r}: on GPUs vLLM's workers run as Ray actors "
                "in the placement group (ray), as in Ray Serve LLM"
            )
        if gpu and len(bundles) > 1 and engine.placement_strategy != "STRICT_PACK" and not self.kv_connector:
            raise ValueError(
                f"placement_group_config.strategy {engine.placement_strategy}: Kairos's KV connector stages KV "
                "on the replica's host, so a GPU pool's workers must share it (STRICT_PACK)"
            )
        return Placement(tuple(bundles), engine.placement_strategy, gpu)

    @property
    def kv_connector(self) -> str | None:
        """The vLLM KV connector named in ``engine_kwargs`` (None: Kairos's own)."""
        config = self.engine_kwargs.get("kv_transfer_config") or {}
        return str(config["kv_connector"]) if "kv_connector" in config else None


class ServingConfig(_Strict):
    """Knobs of the live service."""

    max_in_flight: int = Field(
        256, ge=1, description="requests (prompts of a list each count) admitted at once; beyond: 429 with Retry-After"
    )
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
    admin_api_keys: tuple[str, ...] = Field(
        (), description="keys that may also read GET /kairos/state, the API docs and cached-token counts"
    )
    admin_api_key_env: str | None = Field(
        "KAIROS_ADMIN_API_KEY", description="environment variable with more admin keys (comma-separated)"
    )
    expose_routing: bool = Field(
        False,
        description="responses carry the route (x-kairos-* headers, the body's kairos field): nodes, chunk "
        "schedule, TTFT breakdown, the router's reason; cached-token counts to admin keys only",
    )
    api_docs: bool = Field(False, description="serve FastAPI's /docs and /openapi.json (to admin keys)")
    body_timeout_s: float = Field(30.0, gt=0, description="a request body not read whole by then gets 408")
    input_timeout_s: float = Field(
        10.0, gt=0, description="parsing, rendering and checking a request (its grammar included) past this: 400"
    )
    state_refresh_s: float = Field(
        1.0, ge=0, description="GET /kairos/state asks the router at most this often (callers share one answer)"
    )
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
        RouterOptions.refit_every_steps,
        ge=0,
        description="router refits the step-latency model every N reported steps (0: never)",
    )
    handoff_ttl_s: float = Field(
        RouterOptions.handoff_ttl_s,
        gt=0,
        description="router counts a prefill-routed request on its decode node until that node takes it "
        "(its KV arrived, or was recomputed), or this long",
    )
    router_tcp: bool = Field(
        RouterOptions.tcp_line,
        description="the ingress and the engines reach the router over a TCP line to a port on its node's IP "
        "(cheaper than a Ray call's round trip); false: Ray actor calls only (nodes that cannot reach each other's "
        "ports beyond Ray's)",
    )
    router_shards: int = Field(
        RouterOptions.shards,
        ge=1,
        le=64,
        description="router shards (deployments Router, Router-1, ...): each decides on the decode nodes it owns, "
        "every prefill node shared, on the requests the ingress sends it in turn; a dead shard's nodes go to the "
        "others at once. 1: one router (enough below a few hundred decode nodes)",
    )
    seed: int = Field(ENGINE.seed, description="emulated engines: step-noise seed")

    def router_options(self) -> RouterOptions:
        """What the router uses of this section (shard 0's: ``build_app`` numbers the others)."""
        return RouterOptions(
            refit_every_steps=self.refit_every_steps,
            handoff_ttl_s=self.handoff_ttl_s,
            tcp_line=self.router_tcp,
            shards=self.router_shards,
        )

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


def _check_parsers(parsing: dict[str, Any], reasoning_parser: str | None, tokenizer_source: str) -> None:
    """vLLM's server's checks of its tool-calling arguments, before any replica starts: a parser each that vLLM
    knows, auto tool choice with a tool-call parser, and parsers that find their markup in the model's tokenizer."""
    from vllm.parser import ParserManager
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    tool_parser = parsing.get("tool_call_parser")
    if parsing.get("enable_auto_tool_choice") and not tool_parser:
        raise ValueError("engine_kwargs.enable_auto_tool_choice needs engine_kwargs.tool_call_parser (as in vLLM)")
    for field, name, known in (
        ("tool_call_parser", tool_parser, ToolParserManager.list_registered()),
        ("reasoning_parser", reasoning_parser, ReasoningParserManager.list_registered()),
    ):
        if name and name not in known:
            raise ValueError(f"engine_kwargs.{field} {name!r}: vLLM knows {', '.join(sorted(known))}")
    if not tool_parser and not reasoning_parser:
        return
    from vllm.tokenizers import get_tokenizer

    try:
        tokenizer = get_tokenizer(tokenizer_source)
    except (OSError, ValueError):  # not readable from here (a Hub name off-line): the ingress checks it as it starts
        return
    try:
        ParserManager.get_parser(
            tool_parser_name=tool_parser,
            reasoning_parser_name=reasoning_parser,
            enable_auto_tools=bool(parsing.get("enable_auto_tool_choice")),
            model_name=tokenizer_source,
            tokenizer=tokenizer,
        )
    except TypeError as exc:  # vLLM's own message names the parser and the tokenizer
        raise ValueError(f"engine_kwargs: {exc}") from None


def router_names(shards: int) -> list[str]:
    """The router shards' deployments: ``Router``, ``Router-1``, ..."""
    return ["Router", *(f"Router-{i}" for i in range(1, shards))]


class AppArgs(_Strict):
    """``build_pd_openai_app``'s ``prefill_config`` and ``decode_config``, plus Kairos's sections.

    Either pool may be a list of node groups (a mixed fleet: A100 and H100 nodes, different tensor-parallel
    sizes): each group is a deployment of its own, with its own settings and step-latency ``profile``, its
    nodes' ids naming it (``messages.NodeId``). Every group serves the same model with the same engine.
    """

    prefill_config: PoolConfig | Annotated[list[PoolConfig], Field(min_length=1)]
    decode_config: PoolConfig | Annotated[list[PoolConfig], Field(min_length=1)]
    kairos: KairosConfig = KairosConfig()
    serving: ServingConfig = ServingConfig()
    ingress_deployment_config: dict[str, Any] = Field(
        default_factory=dict, description="Serve options of the ingress deployment (num_replicas, ...)"
    )

    @model_validator(mode="before")
    @classmethod
    def _ray_ingress(cls, data: Any) -> Any:
        return _refuse(data, {"ingress_cls_config": "Kairos-Ray runs its own OpenAI ingress"})

    def groups(self, role: Role) -> tuple[PoolConfig, ...]:
        """The role's node groups, in order (one, unless its ``*_config`` is a list)."""
        pools = self.prefill_config if role is Role.PREFILL else self.decode_config
        return tuple(pools) if isinstance(pools, list) else (pools,)

    @staticmethod
    def deployment_name(role: Role, group: int, pool: PoolConfig) -> str:
        """A group's deployment: ``deployment_config.name``, else the group's name (``decode``, ``decode-1``)."""
        return pool.deployment_config.name or NodeId(role, "", group).group_name

    def _named(self) -> list[tuple[str, PoolConfig]]:
        """Every group with the name it is reported by (``decode_config``, ``decode_config[1]``, ...)."""
        named = []
        for role in Role:
            field = f"{role.value}_config"
            groups = self.groups(role)
            named += [(f"{field}[{i}]" if len(groups) > 1 else field, pool) for i, pool in enumerate(groups)]
        return named

    @model_validator(mode="after")
    def _pools_match(self) -> AppArgs:
        """A decode node continues what a prefill node started: same engine, same model, in every group."""
        if parse_spec(self.kairos.policy.name)[0].decides_with_ground_truth:
            raise ValueError(
                f"kairos.policy.name {self.kairos.policy.name!r} decides with the emulator's ground truth: "
                "the simulator only"
            )
        named = self._named()
        (first_name, first), *rest = named
        for name, pool in rest:
            if pool.engine != first.engine:
                raise ValueError(f"{first_name}.engine ({first.engine}) and {name}.engine ({pool.engine}) differ")
            want, got = first.model_loading_config, pool.model_loading_config
            if (want.model_id, want.source) != (got.model_id, got.source):
                raise ValueError(
                    f"every group must serve one model: {first_name} has {want.model_id!r} from {want.source!r}, "
                    f"{name} {got.model_id!r} from {got.source!r}"
                )
        for knob in ("kv_channel", "kv_hold_blocks"):
            if getattr(self.serving, knob) and first.engine != "vllm":
                raise ValueError(f"serving.{knob} is for vLLM engines' KV; the pools run {first.engine} engines")
        decode = self.groups(Role.DECODE)
        parsing = decode[0].output_parsing()
        if any(pool.output_parsing() != parsing for pool in decode):
            raise ValueError(
                "tool calling differs between decode_config's groups: the ingress parses every answer one way"
            )
        for pool in self.groups(Role.PREFILL):
            if pool.output_parsing() and pool.output_parsing() != parsing:
                raise ValueError(
                    f"prefill_config.engine_kwargs {sorted(pool.output_parsing())}: tool calling is the decode "
                    "pool's (its answers are parsed): set it in decode_config.engine_kwargs"
                )
        deployments = [self.deployment_name(role, i, pool) for role in Role for i, pool in enumerate(self.groups(role))]
        apps = {"Ingress", *router_names(self.serving.router_shards)}
        clashing = sorted({d for d in deployments if deployments.count(d) > 1} | (apps & {*deployments}))
        if clashing:
            raise ValueError(f"node groups' deployment names must differ from each other's and the app's: {clashing}")
        if first.engine == "vllm":
            for name, pool in named:
                try:
                    pool.placement()
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from exc
        return self
