"""Measure a real vLLM engine's step times over a grid of batch sizes, resident KV and chunk sizes.

For every (batch size B, context per request) cell, the profiler starts B
requests of that context and lets them reach the decode phase, runs two
untimed warm-up steps, then, for each chunk size chi, times one engine step: a pure decode step for chi = 0,
else a step that also prefills a probe request of exactly chi tokens (one
output token, so it leaves right away). It records B, the resident KV tokens
K (prompts plus tokens generated so far) and chi with the measured wall time
of the step: the table ``kairos fit`` turns into a ``StepLatencyModel``
(Eq. 4). The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
so that a step's wall time is the step.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

import numpy as np

from kairos_ray.profiling.fit import ProfileTable

TINY_MODEL = str(resources.files("kairos_ray") / "models" / "tiny-llama")


TINY_ENGINE_ARGS: dict[str, Any] = {
    "load_format": "dummy",  # random weights: no download
    "seed": 0,
    "dtype": "float32",
    "enforce_eager": True,
    "kv_cache_memory_bytes": 512 << 20,
}


def make_engine(model: str, max_batch: int, max_chunk: int, max_context: int, **engine_kwargs: Any) -> Any:
    """An in-process vLLM engine (``vllm.LLM``) sized for the grid.

    The shipped tiny model gets CPU-friendly settings (``TINY_ENGINE_ARGS``);
    any other model vLLM's defaults; ``engine_kwargs`` (vLLM's names) win.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": model,
        **(TINY_ENGINE_ARGS if model == TINY_MODEL else {}),
        "enable_prefix_caching": False,  # every probe token is computed
        "max_model_len": max_context + 2048,
        "max_num_seqs": max_batch + 1,
        "max_num_batched_tokens": max(max_chunk + max_batch + 1, max_context),
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
) -> ProfileTable:
    """Time steps for every (B, context, chi); ``len(batch_sizes) * len(contexts)`` cells, each reported."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    ids = itertools.count()
    vocab = 500  # token ids the tiny tokenizer knows; any model's vocabulary is larger
    rows: list[tuple[int, int, int, float]] = []

    def tokens(n: int) -> list[int]:
        start = next(ids) * 7919
        return [3 + (start + i * 31) % vocab for i in range(n)]

    for batch_size, context in itertools.product(batch_sizes, contexts):
        decoders = [f"decode-{next(ids)}" for _ in range(batch_size)]
        long = SamplingParams(max_tokens=2 * repeats * len(chunks) + 64, temperature=0.0, ignore_eos=True)
        for rid in decoders:
            engine.add_request(rid, {"prompt_token_ids": tokens(context)}, long)
        started: set[str] = set()
        while len(started) < batch_size:  # prefill them all, until each has its first token
            started |= {o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids}
        resident = batch_size * (context + 1)
        for chi in (0, max(chunks)):  # warm-up steps, untimed (the first ones pay for lazy setup)
            if chi:
                warm = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
                engine.add_request(f"warm-{next(ids)}", {"prompt_token_ids": tokens(chi)}, warm)
            engine.step()
            resident += batch_size
        for _ in range(repeats):
            for chi in chunks:
                if chi:
                    probe = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
                    engine.add_request(f"probe-{next(ids)}", {"prompt_token_ids": tokens(chi)}, probe)
                start = time.perf_counter()
                engine.step()
                rows.append((batch_size, resident, chi, time.perf_counter() - start))
                resident += batch_size  # every decoder wrote one more token
        engine.abort_request(decoders)
        while engine.has_unfinished_requests():
            engine.step()
        if progress is not None:
            progress(1)
    data = np.array(rows, dtype=float)
    return ProfileTable(data[:, 0], data[:, 1], data[:, 2], data[:, 3])
