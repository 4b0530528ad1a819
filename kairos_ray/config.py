"""Configuration: one pydantic model tree for the simulator, the CLI and the Serve app.

``admission`` turns on SLO-aware admission and decode-side protection
(``core.admission``); it is off by default, the paper's behaviour.

Every section forbids unknown keys, so a typo fails loudly. Invalid values fail
with a message that names the field and quotes the value (``format_errors``).
The tree turns into the core's plain ``PolicyParams`` and a ready ``Policy``
(``KairosConfig.build_policy``, the one place policies are built); the
defaults are the core's own (``PolicyParams()``, ``Thresholds()``).
"""

from __future__ import annotations

import itertools
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kairos_ray.core import (
    AdmissionMode,
    AdmissionParams,
    Policy,
    PolicyParams,
    StepLatency,
    StepLatencyModel,
    Thresholds,
    make_policy,
    parse_spec,
)
from kairos_ray.core.estimate import PrefillEstimatorName
from kairos_ray.emulation import ClusterHardware

DEFAULT_PARAMS = PolicyParams()
DEFAULT_THRESHOLDS = Thresholds()
DEFAULT_ADMISSION = AdmissionParams()
SHIPPED_PROFILES = resources.files("kairos_ray") / "profiles"


def shipped_profile_names() -> list[str]:
    """Names of the step-latency profiles that ship with the package (file stems)."""
    return sorted(p.name.removesuffix(".json") for p in SHIPPED_PROFILES.iterdir() if p.name.endswith(".json"))


def resolve_profile(name_or_path: str) -> Path:
    """A profile file path, given a path or the name of a shipped profile."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    shipped = SHIPPED_PROFILES / f"{name_or_path}.json"
    if shipped.is_file():
        return Path(str(shipped))
    raise ValueError(
        f"no profile file {name_or_path!r} (and no shipped profile of that name; shipped: "
        f"{', '.join(shipped_profile_names())})"
    )


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SLOConfig(_Section):
    """Service-level objectives, checked together (paper: P95 TTFT <= 4 s and P95 TBT <= 70 ms)."""

    ttft_s: float = Field(4.0, gt=0, description="TTFT objective, seconds")
    tbt_s: float = Field(DEFAULT_PARAMS.tbt_slo_s, gt=0, description="time-between-tokens objective tau, seconds")


class ThresholdsConfig(_Section):
    """Thresholds of the static baselines when the policy name carries none (``sq`` rather than ``sq:4``)."""

    sq_queued_requests: int = Field(
        DEFAULT_THRESHOLDS.sq_queued_requests,
        ge=1,
        description="SQ(theta): deflect when the shortest queue holds >= theta",
    )
    sl_prompt_tokens: int = Field(
        DEFAULT_THRESHOLDS.sl_prompt_tokens, ge=1, description="SL(l): deflect prompts of <= l tokens"
    )


class PolicyConfig(_Section):
    """Which routing policy decides, and its knobs."""

    name: str = Field("kairos", description="policy spec: kairos, pd, sq:<theta>, sl:<tokens>, oracle (simulator only)")
    alpha: float = Field(
        DEFAULT_PARAMS.alpha, ge=1, description="deflect only if alpha * TTFT_dec < TTFT_pf (clearly faster)"
    )
    beta: float = Field(
        DEFAULT_PARAMS.beta,
        gt=0,
        le=1,
        description="TBT safety factor: each step must fit beta * tbt_s (Eq. 5); above 1 steps would overrun tau",
    )
    chunk_candidates: tuple[int, ...] = Field(
        DEFAULT_PARAMS.chunk_candidates, description="chunk sizes LargestSafe may pick, strictly decreasing"
    )
    prefill_estimator: PrefillEstimatorName = Field(
        DEFAULT_PARAMS.prefill_estimator,
        description="prefill TTFT estimator: 'paper' (Eq. 1-2) or 'exact' (walks the FIFO)",
    )
    static_chunk_tokens: int = Field(
        DEFAULT_PARAMS.static_chunk_tokens, ge=1, description="fixed chunk the sq/sl baselines deflect with"
    )
    handoff_setup_tokens: int | None = Field(
        None,
        ge=0,
        description="a KV transfer's setup in tokens its link carries meanwhile: the decode node a hand-off goes "
        "to has the fewest tokens on its link, each transfer counting this many more (default: from the predictor "
        "profile's cluster section, setup s x link bytes/s / KV bytes per token)",
    )
    handoff_tokens_per_s: float | None = Field(
        None,
        gt=0,
        description="KV tokens a decode node's link carries per second: with admission on, a hand-off's estimated "
        "TTFT includes its transfer behind those bound there (default: from the predictor profile's cluster section, "
        "link bytes/s / KV bytes per token)",
    )
    prefix_aware: bool = Field(
        DEFAULT_PARAMS.prefix_aware,
        description="price each node's uncached prompt suffix from the cached context, given the prefix hits the "
        "caller knows (a spec ending in +prefix or +blind overrides it)",
    )
    prune: bool = Field(
        DEFAULT_PARAMS.prune,
        description="price only the nodes whose lower bound can still win (docs/architecture.md, 'Decisions at "
        "fleet scale'): the same decisions as pricing every node, at a cost that does not grow with the fleet",
    )
    thresholds: ThresholdsConfig = ThresholdsConfig()

    @field_validator("name")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        parse_spec(value)
        return value

    @field_validator("chunk_candidates")
    @classmethod
    def _strictly_decreasing(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value:
            raise ValueError("chunk_candidates must not be empty, got []")
        if any(c < 1 for c in value):
            raise ValueError(f"chunk_candidates must all be >= 1, got {list(value)}")
        if any(a <= b for a, b in itertools.pairwise(value)):
            raise ValueError(f"chunk_candidates must be strictly decreasing, got {list(value)}")
        return value


class AdmissionConfig(_Section):
    """SLO-aware admission: shed at once what no route can serve within the TTFT objective, ordered by priority,
    and keep every decode step of admitted requests within beta * tbt_s (``core.admission``)."""

    mode: AdmissionMode = Field(
        DEFAULT_ADMISSION.mode,
        description="'off' (admit everything: the paper's behaviour) or 'shed' (admission and decode-side protection)",
    )
    slack: float = Field(
        DEFAULT_ADMISSION.slack,
        gt=0,
        description="admit while the best route's estimated TTFT is within slack x slo.ttft_s",
    )
    priority_reserve: float = Field(
        DEFAULT_ADMISSION.priority_reserve,
        ge=0,
        lt=1,
        description="each priority level above 0 (less important, as in vLLM) is admitted only up to (1 - this) of "
        "the threshold of the level above it: the rest is kept for the more important ones",
    )
    never_shed_priorities: tuple[int, ...] = Field(
        (), description="priority classes that are never shed: their requests queue instead"
    )
    kv_wait_max_s: float = Field(
        DEFAULT_ADMISSION.kv_wait_max_s,
        gt=0,
        description="longest a hand-off's KV waits on its prefill node for a decode node that can take it within "
        "beta x tbt_s; then it waits in that decode node's queue",
    )
    retry_after_min_s: float = Field(
        DEFAULT_ADMISSION.retry_after_min_s, ge=0, description="floor of a shed request's Retry-After, seconds"
    )
    retry_after_max_s: float = Field(
        DEFAULT_ADMISSION.retry_after_max_s, gt=0, description="cap of a shed request's Retry-After, seconds"
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _bare_off(cls, value: object) -> object:
        return AdmissionMode.OFF if value is False else value  # YAML reads a bare off as false

    @model_validator(mode="after")
    def _floor_below_cap(self) -> AdmissionConfig:
        if self.retry_after_min_s > self.retry_after_max_s:
            raise ValueError(
                f"retry_after_min_s ({self.retry_after_min_s}) must not exceed retry_after_max_s "
                f"({self.retry_after_max_s})"
            )
        return self

    def params(self, ttft_slo_s: float) -> AdmissionParams:
        """The core's admission knobs, judging against the TTFT objective ``ttft_slo_s``."""
        return AdmissionParams(
            mode=self.mode,
            ttft_slo_s=ttft_slo_s,
            slack=self.slack,
            priority_reserve=self.priority_reserve,
            never_shed_priorities=frozenset(self.never_shed_priorities),
            kv_wait_max_s=self.kv_wait_max_s,
            retry_after_min_s=self.retry_after_min_s,
            retry_after_max_s=self.retry_after_max_s,
        )


class PredictorConfig(_Section):
    """The step-latency model (Eq. 4) of every node, prefill and decode alike (the paper's one hardware type):
    a shipped profile name or a profile JSON file."""

    profile: str = Field("a100-deepseek-v2-lite", description="step-latency profile (name or path)")

    @field_validator("profile")
    @classmethod
    def _exists(cls, value: str) -> str:
        resolve_profile(value)
        return value

    def load(self) -> StepLatencyModel:
        return StepLatencyModel.load(resolve_profile(self.profile))

    def hardware(self) -> ClusterHardware:
        """The profile's ``cluster`` section: the nodes' KV links and limits."""
        return ClusterHardware.from_profile(resolve_profile(self.profile))


class KairosConfig(_Section):
    """The whole Kairos section."""

    slo: SLOConfig = SLOConfig()
    policy: PolicyConfig = PolicyConfig()
    predictor: PredictorConfig = PredictorConfig()
    admission: AdmissionConfig = AdmissionConfig()
    prefill_chunk_tokens: int = Field(
        DEFAULT_PARAMS.prefill_chunk_tokens, ge=1, description="chunk size chi_p of the prefill nodes"
    )

    def policy_params(self, hardware: ClusterHardware | None = None) -> PolicyParams:
        """The policies' knobs; a hand-off's setup and link rate from ``hardware`` (default: the predictor
        profile's) unless set."""
        p = self.policy
        setup, rate = p.handoff_setup_tokens, p.handoff_tokens_per_s
        if setup is None or rate is None:
            hardware = hardware or self.predictor.hardware()
            setup = hardware.setup_tokens if setup is None else setup
            rate = hardware.link_tokens_per_s if rate is None else rate
        return PolicyParams(
            prefill_chunk_tokens=self.prefill_chunk_tokens,
            chunk_candidates=p.chunk_candidates,
            tbt_slo_s=self.slo.tbt_s,
            alpha=p.alpha,
            beta=p.beta,
            prefill_estimator=p.prefill_estimator,
            static_chunk_tokens=p.static_chunk_tokens,
            prefix_aware=p.prefix_aware,
            prune=p.prune,
            handoff_setup_tokens=setup,
            handoff_tokens_per_s=rate,
            admission=self.admission.params(self.slo.ttft_s),
        )

    def thresholds(self) -> Thresholds:
        t = self.policy.thresholds
        return Thresholds(t.sq_queued_requests, t.sl_prompt_tokens)

    def build_policy(
        self,
        spec: str | None = None,
        model: StepLatency | None = None,
        truth: StepLatency | None = None,
        hardware: ClusterHardware | None = None,
    ) -> Policy:
        """The configured policy, or the one ``spec`` names, with this config's knobs: the one policy builder.

        It decides with ``model`` (default: the predictor's profile). ``truth`` is
        the emulator's noise-free ground truth, which the ``oracle`` decides with;
        without it (on live engines) the oracle is refused.
        """
        spec = spec or self.policy.name
        cls, _ = parse_spec(spec)
        if cls.decides_with_ground_truth:
            if truth is None:
                raise ValueError(f"policy {spec!r} decides with the emulator's ground truth: the simulator only")
            model = truth
        model = model or self.predictor.load()
        return make_policy(spec, self.policy_params(hardware), model, model, self.thresholds())


class ConfigError(ValueError):
    """A config that failed validation, with one readable line per problem."""


def format_errors(exc: ValidationError) -> str:
    """One line per error: ``dotted.field = value: message``."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(part) for part in err["loc"]) or "(top level)"
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown field")
        else:
            lines.append(f"{where} = {err['input']!r}: {message}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any] | None) -> KairosConfig:
    """Validate a mapping; raises ``ConfigError`` with ``format_errors`` text."""
    try:
        return KairosConfig.model_validate(data or {})
    except ValidationError as exc:
        raise ConfigError(format_errors(exc)) from None


def load_config(path: str | Path) -> KairosConfig:
    """Read and validate a YAML file holding the Kairos section, or a Serve config whose app has one."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (slo, policy, ...), got {type(data).__name__}")
    if data and "applications" in data:  # a Serve config: its (first) Kairos app's kairos section
        apps = [a for a in data["applications"] or () if isinstance(a, dict) and "kairos" in (a.get("args") or {})]
        if not apps:
            raise ConfigError(f"{path}: a Serve config with no application that has a kairos section")
        data = apps[0]["args"]["kairos"]
    try:
        return parse_config(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}:\n{exc}") from None
