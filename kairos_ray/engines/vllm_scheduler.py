"""A vLLM V1 scheduler that prefills a deflected request in the chunks of its Kairos schedule.

The router's schedule X = [chi_1 .. chi_m] (Eq. 5) arrives in the request's
``SamplingParams.extra_args["chunk_schedule"]`` (``vllm_xargs`` over HTTP).
vLLM's scheduler has no per-request chunk size, but it caps every prefill at
``long_prefill_token_threshold``. For each step in which a request with a
schedule is still prefilling, this scheduler sets that cap to the request's
next chunk (and, when the request is alone in the engine, where vLLM lifts
the cap, the step's token budget too), turns off the adaptive floor that
could raise the cap, runs vLLM's own ``schedule()``, then restores the
settings. Deflected requests go one at a time, first come
first served, as the router plans them (``core.estimate.after_committed``);
a prefill without a schedule that shares the step gets the same cap.

With ``extra_args["chunk_guard"] = {"coefficients": [...], "tile_tokens": n,
"candidates": [...], "tbt_budget_s": t}`` the request's next chunk is also checked when it
runs, against the decode batch of that step and the request's own prefix (its
tokens computed so far, which the chunk attends over: Eq. 4's chi * P;
``core.sweep.largest_safe_chunk``, Eq. 5 at run time): a batch that grew since
the router planned shrinks the chunk; where nothing fits, one token goes, so
the request still moves.

With vLLM's prefix cache, the schedule covers the prompt beyond the hit the
router counted on this node; it runs from vLLM's own hit (the tokens it found
cached when it admitted the request). Where the two differ (blocks evicted
meanwhile, or a hit the router did not know of), the schedule's leading
chunks cover what is left, and any remainder runs as one more chunk
(``nodes.covering``, as in the simulator), the guard re-checking each.

With ``extra_args["join_guard"]`` (a hand-off, admission on) a request waits
before it joins the decode batch while the step with it joined (and with the
deflected chunk planned next) would overrun beta * tau
(``core.admission.joined_step_fits``, Eq. 4 against Eq. 5's budget): held
out of vLLM's waiting queue for that step, hand-offs in their order, until
the batch shrinks; a node with nothing decoding takes it, since nothing else
would make room. Decode-side protection, as the simulator's decode node does
it (``nodes.DecodeNode``). A hand-off that vLLM's own connectors load
asynchronously (NIXL) is held before its load starts, its KV left on its
prefill node; one whose load began while it fitted waits, once its KV is in,
in vLLM's queue of requests holding KV blocks, and is checked there again.

``chunk_log`` keeps, for the last ``CHUNK_LOG_REQUESTS`` requests with a
schedule, one ``(prefill tokens, other requests decoding)`` pair per step each
prefilled in: the record that shows the plan was followed and interleaved
with the running batch (bounded: an engine serves for weeks).
"""

from __future__ import annotations

import functools
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kairos_ray.core import StepLatencyModel
from kairos_ray.core.admission import joined_step_fits
from kairos_ray.core.sweep import largest_safe_chunk
from kairos_ray.engines.vllm_args import GUARD_KEY, JOIN_KEY, SCHEDULE_KEY
from kairos_ray.nodes import covering

CHUNK_LOG_REQUESTS = 64  # requests whose chunk steps ``chunk_log`` keeps, the latest


def next_chunk(schedule: Sequence[int], computed_tokens: int) -> int | None:
    """Tokens left in the chunk that ``computed_tokens`` falls in; None once the schedule is done."""
    end = 0
    for chunk in schedule:
        end += chunk
        if computed_tokens < end:
            return end - computed_tokens
    return None


def _extra(request: Any) -> dict[str, Any]:
    params = request.sampling_params
    return (params.extra_args if params is not None else None) or {}


@functools.lru_cache(maxsize=8)
def _guard_model(coefficients: tuple[float, ...], tile_tokens: int) -> StepLatencyModel:
    """The guard's model, built once per set of coefficients rather than on every step."""
    return StepLatencyModel.from_coefficients(coefficients, tile_tokens)


def schedule_of(request: Any) -> tuple[int, ...] | None:
    schedule = _extra(request).get(SCHEDULE_KEY)
    return tuple(int(c) for c in schedule) if schedule else None


class ChunkScheduleScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chunk_log: OrderedDict[str, list[tuple[int, int]]] = OrderedDict()
        self._hit: dict[str, int] = {}  # request id with a schedule -> tokens vLLM found cached when it admitted it

    def _deflected(self) -> tuple[str, int] | None:
        """(request id, next chunk) of the first request still prefilling per a schedule."""
        for request in itertools.chain(self.running, self.waiting):
            schedule = schedule_of(request)
            if schedule and request.num_computed_tokens < request.num_prompt_tokens:
                hit = self._hit.get(request.request_id, 0)  # 0 before admission: its first chunk is the plan's
                chunk = next_chunk(
                    covering(schedule, request.num_prompt_tokens - hit), request.num_computed_tokens - hit
                )
                if chunk is not None:
                    return request.request_id, self._guarded(request, chunk)
        return None

    def _guarded(self, request: Any, chunk: int) -> int:
        """The planned chunk, shrunk to what fits beta * tau beside this step's decode batch (at least 1 token)."""
        spec = _extra(request).get(GUARD_KEY)
        if not spec:
            return chunk
        decoding = self._decoding()
        model = _guard_model(tuple(spec["coefficients"]), int(spec["tile_tokens"]))
        prefix = request.num_computed_tokens
        kv_tokens = prefix + sum(r.num_computed_tokens for r in decoding)  # resident: the decodes' and its own
        safe = largest_safe_chunk(
            model, len(decoding), kv_tokens, chunk, spec["candidates"], spec["tbt_budget_s"], prefix
        )
        return max(1, safe)

    def _decoding(self) -> list[Any]:
        return [r for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens]

    def _held(self, deflected: tuple[str, int] | None) -> list[tuple[Any, Any]]:
        """(queue, request) of the waiting hand-offs that may not join this step (``join_guard``), in the order
        vLLM would take them (those holding KV blocks, as asynchronously loaded hand-offs do, then the rest): the
        first that does not fit beside the decode batch, the hand-offs let in before it and the deflected chunk,
        and every hand-off after it. A hand-off whose KV is still loading is not ready to join: left as it is."""
        guarded = [
            (queue, r, spec)
            for queue in (self.kv_holding_waiting, self.waiting)
            for r in queue
            if (spec := _extra(r).get(JOIN_KEY)) and self._loaded(r)
        ]
        if not guarded:  # admission off, or no hand-off ready: the decode batch need not be listed
            return []
        decoding = self._decoding()
        if not decoding:
            return []
        batch, kv_tokens = len(decoding), sum(r.num_computed_tokens for r in decoding)
        chunk, prefix = 0, 0
        if deflected is not None:
            chunk, prefix = deflected[1], self.requests[deflected[0]].num_computed_tokens
        held: list[tuple[Any, Any]] = []
        for queue, request, spec in guarded:
            model = _guard_model(tuple(spec["coefficients"]), int(spec["tile_tokens"]))
            prompt = request.num_prompt_tokens
            if held or not joined_step_fits(model, batch, kv_tokens, prompt, spec["tbt_budget_s"], chunk, prefix):
                held.append((queue, request))
            else:
                batch, kv_tokens = batch + 1, kv_tokens + prompt
        return held

    def _loaded(self, request: Any) -> bool:
        """Whether a waiting request's KV is here: not still loading from a remote node (vLLM's async loads)."""
        return (
            request.status != RequestStatus.WAITING_FOR_REMOTE_KVS
            or request.request_id in self.finished_recving_kv_req_ids
        )

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        deflected = self._deflected()
        held = self._held(deflected)
        if not held:
            return self._schedule(deflected, *args, **kwargs)
        out = [(queue, [r for q, r in held if q is queue]) for queue in (self.kv_holding_waiting, self.waiting)]
        for queue, requests in out:
            if requests:
                queue.remove_requests(requests)
        try:
            return self._schedule(deflected, *args, **kwargs)
        finally:
            for queue, requests in out:
                if requests:
                    queue.prepend_requests(reversed(requests))  # back at the front of its queue, in their order

    def _schedule(self, deflected: tuple[str, int] | None, *args: Any, **kwargs: Any) -> Any:
        if deflected is None:
            return super().schedule(*args, **kwargs)
        request_id, chunk = deflected
        config = self.scheduler_config
        saved = (
            config.long_prefill_token_threshold,
            self.max_num_scheduled_tokens,
            self.adaptive_long_prefill_threshold,
        )
        config.long_prefill_token_threshold = chunk
        if len(self.running) + len(self.waiting) == 1:  # vLLM lifts the cap for a lone request: cap the budget
            self.max_num_scheduled_tokens = min(saved[1], chunk)
        self.adaptive_long_prefill_threshold = False
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            config.long_prefill_token_threshold, self.max_num_scheduled_tokens, self.adaptive_long_prefill_threshold = (
                saved
            )
        for new in output.scheduled_new_reqs:  # admitted in this step: its prefix-cache hit is what it starts from
            if schedule_of(self.requests[new.req_id]):
                self._hit[new.req_id] = new.num_computed_tokens
        scheduled = output.num_scheduled_tokens.get(request_id)
        if scheduled:
            decoding = sum(1 for rid, n in output.num_scheduled_tokens.items() if rid != request_id and n == 1)
            self._log(request_id, scheduled, decoding)
        return output

    def _log(self, request_id: str, scheduled: int, decoding: int) -> None:
        steps = self.chunk_log.get(request_id)
        if steps is None:
            steps = self.chunk_log[request_id] = []
            if len(self.chunk_log) > CHUNK_LOG_REQUESTS:
                self.chunk_log.popitem(last=False)
        steps.append((scheduled, decoding))

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self._hit.pop(request.request_id, None)
        return super()._free_request(request, *args, **kwargs)
