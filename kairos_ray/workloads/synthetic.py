"""Synthetic workloads after the paper's five: LPLD, LPHD, HPLD, HPHD and Bursty.

LP/HP = low/high prompt length, LD/HD = low/high decode (output) length. All
lengths are log-normal (heavy right tail, as in production traces), drawn as
``round(median * exp(sigma * N(0, 1)))`` and then clipped so that prompt +
output fits a 32K context (the paper normalises its traces to 32K):

| name   | prompt median / sigma | output median / sigma | arrivals                        |
|--------|-----------------------|-----------------------|---------------------------------|
| lpld   | 1024 / 1.0            | 48 / 1.0              | Poisson                         |
| lphd   | 1024 / 1.0            | 384 / 0.8             | Poisson                         |
| hpld   | 6144 / 0.8            | 48 / 1.0              | Poisson                         |
| hphd   | 6144 / 0.8            | 384 / 0.8             | Poisson                         |
| bursty | 3072 / 1.1            | 128 / 1.0             | gamma, shape 0.2 (CV of gaps 2.2) |

Poisson arrivals have exponential gaps (CV 1). The bursty workload draws
gaps from a gamma distribution with shape k = 0.2 and the same mean: CV =
1/sqrt(k), so most requests come in tight clumps separated by long lulls.

``multiturn`` (``kairos_ray.workloads.multiturn``) is the one with prefix
identity: conversations sharing a system prompt, each turn's prompt holding
the earlier turns and answers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kairos_ray.workloads import Request, Workload

CONTEXT_TOKENS = 32_768


@dataclass(frozen=True)
class LogNormal:
    median: float
    sigma: float

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.maximum(1, np.round(self.median * np.exp(self.sigma * rng.standard_normal(n)))).astype(int)


@dataclass(frozen=True)
class SyntheticSpec:
    prompt: LogNormal
    output: LogNormal
    gamma_shape: float = 1.0  # 1.0 is Poisson; < 1 is burstier


LOW_PROMPT, HIGH_PROMPT = LogNormal(1024, 1.0), LogNormal(6144, 0.8)
LOW_DECODE, HIGH_DECODE = LogNormal(48, 1.0), LogNormal(384, 0.8)

SYNTHETIC: dict[str, SyntheticSpec] = {
    "lpld": SyntheticSpec(LOW_PROMPT, LOW_DECODE),
    "lphd": SyntheticSpec(LOW_PROMPT, HIGH_DECODE),
    "hpld": SyntheticSpec(HIGH_PROMPT, LOW_DECODE),
    "hphd": SyntheticSpec(HIGH_PROMPT, HIGH_DECODE),
    "bursty": SyntheticSpec(LogNormal(3072, 1.1), LogNormal(128, 1.0), gamma_shape=0.2),
}


WORKLOADS = (*SYNTHETIC, "multiturn")
"""Every synthetic workload ``synthetic`` generates, by name."""


def synthetic(
    name: str, rps: float, num_requests: int = 2000, seed: int = 0, context_tokens: int = CONTEXT_TOKENS
) -> Workload:
    """``num_requests`` requests of workload ``name`` arriving at a mean of ``rps`` per second."""
    if name.lower() == "multiturn":
        from kairos_ray.workloads.multiturn import multiturn  # it builds on this module

        return multiturn(rps, num_requests, seed, context_tokens)
    spec = SYNTHETIC.get(name.lower())
    if spec is None:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if rps <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rps}")
    if num_requests < 1:
        raise ValueError(f"need at least 1 request, got {num_requests}")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(spec.gamma_shape, 1.0 / (spec.gamma_shape * rps), num_requests)
    gaps[0] = 0.0
    arrivals = np.cumsum(gaps)
    prompts, outputs = spec.prompt.draw(rng, num_requests), spec.output.draw(rng, num_requests)
    requests = tuple(Request(float(t), int(p), int(o)) for t, p, o in zip(arrivals, prompts, outputs, strict=True))
    return Workload(name.lower(), requests).clipped_to_context(context_tokens)
