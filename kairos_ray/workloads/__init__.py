"""Request streams for the simulator and the live load generator: synthetic workloads and trace loaders.

A ``Workload`` is an ordered tuple of ``Request(arrival_s, prompt_tokens,
output_tokens)`` with arrival times relative to the first request. Both
``kairos sim`` and the load generator take one, so a what-if run and a live
replay see the same requests.

A request may carry its prefix identity: ``block_hashes``, the chained
hashes of its full blocks of ``Workload.block_tokens`` tokens (``core.prefix``),
its prompt's first, then those of its answer where the workload knows them
(the synthetic multi-turn workload does; a trace knows only the prompt's).
Two requests share exactly the leading blocks whose hashes agree.

A request may carry a priority (vLLM's ``priority``: lower is more
important, 0 the default), which orders admission's shedding; a workload
gets a seeded mix of classes with ``Workload.with_priorities``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from kairos_ray.core import BlockHash


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float  # seconds since the start of the workload
    prompt_tokens: int
    output_tokens: int  # tokens to generate, the first one included
    block_hashes: tuple[BlockHash, ...] = ()  # chained hashes of its full blocks, prompt then answer; () unknown
    priority: int = 0  # vLLM's request priority: lower is more important


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[Request, ...]
    clipped: int = 0  # requests whose lengths were cut to fit the context (or raised to 1 token)
    block_tokens: int = 16  # tokens per block of the requests' block_hashes

    @property
    def has_prefix_identity(self) -> bool:
        """Whether any request carries block hashes."""
        return any(r.block_hashes for r in self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    @property
    def rate_rps(self) -> float:
        """Mean arrival rate: (n - 1) arrivals over the span between the first and the last."""
        return (len(self.requests) - 1) / self.duration_s if self.duration_s > 0 else 0.0

    def scaled_to_rate(self, rps: float) -> Workload:
        """The same requests with arrival times stretched or compressed to a mean rate of ``rps``."""
        if rps <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {rps}")
        if self.rate_rps == 0:
            raise ValueError(f"workload {self.name!r} has no time span to scale (fewer than 2 distinct arrivals)")
        factor = self.rate_rps / rps
        return replace(self, requests=tuple(replace(r, arrival_s=r.arrival_s * factor) for r in self.requests))

    def clipped_to_context(self, context_tokens: int) -> Workload:
        """Every request fits ``context_tokens`` (prompt + output); lengths < 1 become 1. Counts what changed."""
        if context_tokens < 2:
            raise ValueError(f"context must hold at least 2 tokens, got {context_tokens}")
        out: list[Request] = []
        changed = 0
        for r in self.requests:
            prompt = min(max(1, r.prompt_tokens), context_tokens - 1)
            output = min(max(1, r.output_tokens), context_tokens - prompt)
            if (prompt, output) != (r.prompt_tokens, r.output_tokens):
                changed += 1
                # a cut prompt keeps its leading blocks; the answer's blocks followed the whole prompt
                kept = prompt + output if prompt == r.prompt_tokens else prompt
                blocks = r.block_hashes[: kept // self.block_tokens]
                r = replace(r, prompt_tokens=prompt, output_tokens=output, block_hashes=blocks)
            out.append(r)
        return replace(self, requests=tuple(out), clipped=self.clipped + changed)

    def with_priorities(self, shares: Mapping[int, float], seed: int = 0) -> Workload:
        """Every request given a priority class drawn at random in proportion to ``shares`` (class -> weight)."""
        if not shares or min(shares.values()) < 0 or sum(shares.values()) <= 0:
            raise ValueError(f"priority shares must be non-negative weights, not all 0, got {dict(shares)}")
        classes = list(shares)
        weights = np.array([shares[c] for c in classes], dtype=float)
        drawn = np.random.default_rng(seed).choice(len(classes), size=len(self.requests), p=weights / weights.sum())
        return replace(
            self,
            requests=tuple(replace(r, priority=classes[i]) for r, i in zip(self.requests, drawn.tolist(), strict=True)),
        )

    def head(self, num_requests: int) -> Workload:
        """The first ``num_requests`` requests."""
        return replace(self, requests=self.requests[:num_requests])
