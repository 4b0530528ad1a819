"""Emulated hardware: the ground-truth step time, the step noise and the cluster limits.

Shared by the simulator (virtual time) and the live emulated engines (wall
clock), beside the node models of ``kairos_ray.nodes``; the live path imports
it, never ``kairos_ray.sim``.

The ``cluster`` section of a profile file holds the KV link, KV capacity and
batch limits, and how the ground-truth step time departs from the linear
predictor (see ``kairos_ray/profiles/README.md`` for the derivation of the
shipped A100 values).

``GroundTruth`` is what simulated engines actually take per step. It is NOT
the predictor the policies use. Its physics of a chunk is fixed, whatever form
the profile's predictor has: a chunk attends over its own request's prefix P
(the earlier chunks of the same request), never over the other requests' KV,
which costs the decode part of the step (``c_kv * K``). It prices that
attention at ``c_chunk_prefix + c_chunk_kv`` per chunk token per prefix token:
for a profile in the paper's form (``c_chunk_kv * chi * K``, no prefix term)
the predictor then prices chunks on a loaded node by KV they never read, and
the simulated steps show it. It also adds what the paper's linear Eq. 4 misses,

- tile quantisation: prefill tokens go through the linear layers in tiles of
  ``tile_tokens``, so a partial tile costs a whole one (``c_chunk`` per padded token);
- batch crowding: per-request decode cost grows by ``B / batch_crowding`` as
  the batch fills (``c_batch * B * (1 + B / batch_crowding)``);

taking both from the cluster section, never from the predictor: a predictor's
own ``c_batch_sq`` and ``tile_tokens`` are its estimate of them (a profile
that knows this hardware has ``c_batch_sq = c_batch / batch_crowding`` and
the same tiles, as the shipped A100 profile does; the fitter finds them in
emulated steps, ``tests/profiling/test_fit.py``), and the ground truth stays
the same whatever the predictor knows;

and the simulator multiplies every step by log-normal noise with coefficient
of variation ``noise_cv``. The ``oracle`` policy decides with the noise-free
ground truth (the paper's Oracle row); every other policy sees only the
predictor, so prediction error shows up as it would in production.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from kairos_ray.core import StepLatencyModel, StepwiseLatency, tiles


@dataclass(frozen=True)
class ClusterHardware:
    """Per-node limits and the KV link of one simulated node type."""

    kv_bytes_per_token: int = 31_104  # DeepSeek-V2-Lite MLA: 27 layers x (512 + 64) x 2 bytes
    kv_link_gbytes_per_s: float = 2.0  # effective bandwidth into one decode node, GB/s
    kv_link_setup_s: float = 0.1  # per-transfer setup (handshake, block gathering)
    kv_capacity_tokens: int = 1_200_000  # KV cache of one decode node, tokens
    max_batch_size: int = 256  # running requests per decode node
    context_tokens: int = 32_768
    noise_cv: float = 0.03  # coefficient of variation of the per-step noise
    tile_tokens: int = 128  # prefill tile size of the ground truth
    batch_crowding: float = 512.0  # ground-truth growth of per-request decode cost with B

    def transfer_s(self, prompt_tokens: int) -> float:
        """Time one KV transfer occupies its link."""
        return self.kv_link_setup_s + prompt_tokens * self.kv_bytes_per_token / (self.kv_link_gbytes_per_s * 1e9)

    @property
    def link_tokens_per_s(self) -> float:
        """KV tokens one link carries per second (``PolicyParams.handoff_tokens_per_s``)."""
        return self.kv_link_gbytes_per_s * 1e9 / self.kv_bytes_per_token

    @property
    def setup_tokens(self) -> int:
        """A transfer's setup, in the KV tokens its link carries meanwhile (``PolicyParams.handoff_setup_tokens``)."""
        return round(self.kv_link_setup_s * self.kv_link_gbytes_per_s * 1e9 / self.kv_bytes_per_token)

    @classmethod
    def from_profile(cls, path: str | Path) -> ClusterHardware:
        """The ``cluster`` section of a profile file; defaults where it has none."""
        data = json.loads(Path(path).read_text()).get("cluster", {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"{path}: unknown cluster field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        hardware = cls(**data)
        for f in fields(cls):
            if not getattr(hardware, f.name) > 0:
                raise ValueError(f"{path}: cluster.{f.name} must be > 0, got {getattr(hardware, f.name)!r}")
        return hardware


class GroundTruth(StepwiseLatency):
    """The step time simulated engines take (before noise): a chunk over its own prefix, tiles, crowding."""

    def __init__(self, model: StepLatencyModel, hardware: ClusterHardware) -> None:
        self.model = model
        self.tile = hardware.tile_tokens
        self.crowding = hardware.batch_crowding
        self.c_attention = model.c_chunk_prefix + model.c_chunk_kv  # per chunk token per own-prefix token

    def step_s(self, batch_size: int, kv_tokens: float, chunk_tokens: float, prefix_tokens: float = 0) -> float:
        m = self.model
        seconds = m.c0 + m.c_batch * batch_size * (1 + batch_size / self.crowding) + m.c_kv * kv_tokens
        if chunk_tokens:
            seconds += (
                m.c_chunk * tiles(chunk_tokens, self.tile)
                + chunk_tokens * (m.c_chunk_sq * chunk_tokens + self.c_attention * prefix_tokens)
                + m.c_prefix * prefix_tokens
            )
        return seconds


class StepNoise:
    """Multiplicative log-normal step noise with mean 1 and coefficient of variation ``cv``, drawn in blocks."""

    BLOCK = 1 << 14

    def __init__(self, seed: int, cv: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.sigma = math.sqrt(math.log1p(cv * cv))
        self.values: list[float] = []

    def next(self) -> float:
        if not self.values:
            draws = self.rng.standard_normal(self.BLOCK) * self.sigma - self.sigma * self.sigma / 2
            self.values = np.exp(draws).tolist()
        return self.values.pop()
