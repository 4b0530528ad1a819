"""Keep a long-running process's start-up heap out of Python's full garbage collections.

CPython's full (generation 2) collection walks every object the process
holds; it comes whenever the objects that outlived the younger collections
have grown by a quarter of those the last one left. The router's actor holds
a large start-up heap (Ray, Serve, numpy, scikit-learn, the policy), so a
full collection there stalls every decision and every report while it walks
it, and its one-minute windows of steps and decisions (``serve.live``) keep
adding survivors until one falls due under load
(``docs/live-path-performance.md``). ``gc.freeze`` moves what exists at the
end of start-up to the permanent generation, which no collection walks: a
full collection then costs what was allocated since.

Serve does the same for its replicas (``RAY_SERVE_FREEZE_GC_ON_STARTUP``, on
by default in Ray 2.60), but the router's actor is a plain Ray actor.

The price: a start-up object that later becomes cyclic garbage is never
freed. What a process builds at start-up lives as long as the process does,
so that is nothing in practice.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class FrozenHeap:
    """What ``freeze_startup_heap`` did: objects frozen, and a full collection's time before and after."""

    objects: int
    full_collection_before_s: float
    full_collection_after_s: float


def _full_collection_s() -> float:
    start = time.perf_counter()
    gc.collect()
    return time.perf_counter() - start


def freeze_startup_heap(process: str, log: logging.Logger) -> FrozenHeap:
    """Collect what start-up left as garbage, then freeze every object left (call once start-up is done).

    Says on ``log`` what it froze and what a full collection took before and after, naming ``process``.
    """
    before = _full_collection_s()  # garbage goes first: frozen, it would stay for good
    gc.freeze()
    frozen = FrozenHeap(gc.get_freeze_count(), before, _full_collection_s())
    log.info(
        "%s: froze %d start-up objects; a full garbage collection took %.1f ms, now %.2f ms",
        process, frozen.objects, 1e3 * frozen.full_collection_before_s, 1e3 * frozen.full_collection_after_s,
    )  # fmt: skip
    return frozen
