"""Real vLLM CPU engines with the shipped tiny model (random weights, the same for a fixed seed)."""

import asyncio
import contextlib
from collections.abc import Callable
from importlib import resources
from typing import Any

import pytest

MODEL = str(resources.files("kairos_ray") / "models" / "tiny-llama")
ENGINE_ARGS = {
    "model": MODEL,
    "load_format": "dummy",
    "seed": 0,
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 4096,
    "max_num_batched_tokens": 512,  # a prefill node's per-step budget: longer prompts are chunked
    "kv_cache_memory_bytes": 256 << 20,
    "enable_prefix_caching": False,  # every prompt token is prefilled, as the router's schedule assumes
}
# Not multiples of the 128-token block; 695 and 1500 exceed the 512-token step budget.
PROMPTS = [[3 + (i * 7) % 500 for i in range(n)] for n in (37, 300, 695, 1500)]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


TINY_KWARGS = {k: v for k, v in ENGINE_ARGS.items() if k != "model"}


def engine(**kwargs):
    """An in-process ``vllm.LLM`` (set VLLM_ENABLE_V1_MULTIPROCESSING=0 first to reach its scheduler)."""
    from vllm import LLM

    return LLM(**{**ENGINE_ARGS, **kwargs})


def kv_config(role: str, staging_dir: str) -> dict:
    return {
        "kv_connector": "KairosKVConnector",
        "kv_connector_module_path": "kairos_ray.kv.connector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"staging_dir": staging_dir},
    }


@contextlib.contextmanager
def node_pair(engine_kwargs: dict, per_role: Callable[[str], tuple[dict[str, str], dict[str, Any]]]):
    """(run, prefill, decode): two ``VllmEngine`` nodes on one event loop, each pinned to its own core.

    ``per_role(role)`` gives (environment variables for that engine's start,
    which its child processes inherit; more ``VllmEngine`` arguments).
    """
    from kairos_ray.engines.vllm_engine import VllmEngine
    from kairos_ray.messages import Role

    loop = asyncio.new_event_loop()
    engines = {}
    try:
        with pytest.MonkeyPatch.context() as mp:
            for core, role in enumerate(("prefill", "decode")):
                env, options = per_role(role)
                for name, value in {"VLLM_CPU_OMP_THREADS_BIND": str(core), **env}.items():
                    mp.setenv(name, value)
                engines[role] = VllmEngine(f"{role}-0", Role(role), MODEL, engine_kwargs, **options)
                loop.run_until_complete(engines[role].start())
        yield loop.run_until_complete, engines["prefill"], engines["decode"]
    finally:
        for engine in engines.values():
            loop.run_until_complete(engine.shutdown())
        pending = asyncio.all_tasks(loop)  # the engines' output handlers and heartbeats
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()
