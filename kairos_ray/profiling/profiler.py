"""Measure a real vLLM engine's step times over a grid of batch sizes, resident KV, chunk sizes and chunk prefixes.

For every (batch size B, context per request) cell, the profiler starts B
requests of that context and lets them reach the decode phase. It then walks
the grid of (chi, P) points ``repeats + 1`` times, the first pass untimed (the
first step of each shape pays for lazy setup, kernel selection included),
timing one engine step per point: a pure decode step for chi = 0, else a step
that also prefills a chunk of exactly chi tokens of a probe request whose own
prefix of P tokens was prefilled in the step before, untimed. Chunks are cut
with Kairos's own scheduler (``engines.vllm_scheduler.ChunkScheduleScheduler``,
schedule ``[P, chi]``), as a deflected prefill's are on a decode node. A probe
with P = 0 is given a one-token prefix, so that no timed step pays for a
request's admission (scheduler bookkeeping that is not per chunk) and its
recorded prefix is 1. The probe has one output token, so it leaves right away.

Each output row is one grid point: B, the resident KV tokens K (the decoders'
prompts and tokens so far, plus the probe's prefix), chi and P, with the
median of the point's ``repeats`` timed steps. The passes interleave the
points, so a disturbance from the rest of the machine (a shared CPU, other
processes) hits one repeat of many points, which the median drops, rather than
every repeat of one. ``kairos fit`` turns the table into a ``StepLatencyModel``
(Eq. 4, the chunk's own prefix included). The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with the garbage collector run only
between passes (and an untimed step after it), so that a step's wall time is
the step.
"""

from __future__ import annotations

import gc
import itertools
import os
import time
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

import numpy as np

from kairos_ray.engines.vllm_args import SCHEDULE_KEY
from kairos_ray.profiling.fit import ProfileTable

TINY_MODEL = str(resources.files("kairos_ray") / "models" / "tiny-llama")
SCHEDULER = "kairos_ray.engines.vllm_scheduler.ChunkScheduleScheduler"


TINY_ENGINE_ARGS: dict[str, Any] = {
    "load_format": "dummy",  # random weights: no download
    "seed": 0,
    "dtype": "float32",
    "enforce_eager": True,
    "kv_cache_memory_bytes": 512 << 20,
}


def make_engine(
    model: str, max_batch: int, max_chunk: int, max_context: int, max_prefix: int = 0, **engine_kwargs: Any
) -> Any:
    """An in-process vLLM engine (``vllm.LLM``) sized for the grid, cutting chunks with Kairos's scheduler.

    The shipped tiny model gets CPU-friendly settings (``TINY_ENGINE_ARGS``);
    any other model vLLM's defaults; ``engine_kwargs`` (vLLM's names) win.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": model,
        **(TINY_ENGINE_ARGS if model == TINY_MODEL else {}),
        "scheduler_cls": SCHEDULER,
        "enable_prefix_caching": False,  # every probe token is computed
        "max_model_len": max(max_context, max_prefix + max_chunk) + 2048,
        "max_num_seqs": max_batch + 1,
        "max_num_batched_tokens": max(max_prefix, max_chunk) + max_batch + 1 + max_context,
        **engine_kwargs,
    }
    return LLM(**kwargs)


def profile(
    llm: Any,
    batch_sizes: Sequence[int],
    contexts: Sequence[int],
    chunks: Sequence[int],
    repeats: int = 3,
    progress: Callable[[int], None] | None = None,
    prefixes: Sequence[int] = (0,),
) -> ProfileTable:
    """One row per (B, context, chi, P) point, its step's median over ``repeats``; each (B, context) cell reported."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    ids = itertools.count()
    vocab = 500  # token ids the tiny tokenizer knows; any model's vocabulary is larger
    rows: list[tuple[int, float, int, int, float]] = []
    grid = ([(0, 0)] if 0 in chunks else []) + [(chi, max(1, p)) for chi in chunks if chi for p in prefixes]
    steps_per_pass = 1 + len(grid) + sum(1 for chi, _ in grid if chi)  # a probe's prefix takes a step of its own

    def tokens(n: int) -> list[int]:
        start = next(ids) * 7919
        return [3 + (start + i * 31) % vocab for i in range(n)]

    gc.disable()  # a collection inside a timed step would be timed: collect between passes instead
    try:
        for batch_size, context in itertools.product(batch_sizes, contexts):
            decoders = [f"decode-{next(ids)}" for _ in range(batch_size)]
            long = SamplingParams(max_tokens=(repeats + 1) * steps_per_pass + 64, temperature=0.0, ignore_eos=True)
            for rid in decoders:
                engine.add_request(rid, {"prompt_token_ids": tokens(context)}, long)
            started: set[str] = set()
            while len(started) < batch_size:  # prefill them all, until each has its first token
                started |= {o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids}
            resident = batch_size * (context + 1)
            timed: dict[tuple[int, int], list[tuple[int, float]]] = {point: [] for point in grid}
            for repeat in range(repeats + 1):
                gc.collect()
                engine.step()  # untimed: the step after a collection runs with cold caches
                resident += batch_size
                for chi, prefix in grid:
                    if chi:
                        probe = SamplingParams(
                            max_tokens=1, temperature=0.0, ignore_eos=True, extra_args={SCHEDULE_KEY: [prefix, chi]}
                        )
                        engine.add_request(f"probe-{next(ids)}", {"prompt_token_ids": tokens(prefix + chi)}, probe)
                        engine.step()  # the probe's admission and prefix, untimed
                        resident += batch_size
                    start = time.perf_counter()
                    engine.step()
                    elapsed = time.perf_counter() - start
                    if repeat:
                        timed[chi, prefix].append((resident + prefix, elapsed))
                    resident += batch_size  # every decoder wrote one more token
            for (chi, prefix), samples in timed.items():
                kv_tokens, step_s = np.median(np.array(samples, dtype=float), axis=0)
                rows.append((batch_size, float(kv_tokens), chi, prefix, float(step_s)))
            engine.abort_request(decoders)
            while engine.has_unfinished_requests():
                engine.step()
            if progress is not None:
                progress(1)
    finally:
        gc.enable()
    data = np.array(rows, dtype=float)
    return ProfileTable(data[:, 0], data[:, 1], data[:, 2], data[:, 4], data[:, 3])
