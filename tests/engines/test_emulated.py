"""The emulated engine on its own (no Serve): the node models in wall-clock time, KV through the real object store.

Engines are built through the registry, as engine servers build them, and run
at 1/20 of the emulated A100's time so that tests stay short.
"""

import asyncio
import dataclasses
import math
import time

import pytest
import ray

from kairos_ray.config import KairosConfig, resolve_profile
from kairos_ray.core import BlockCache, DecodeNodeView, PrefillNodeView, block_ids
from kairos_ray.emulation import ClusterHardware
from kairos_ray.engines import EngineOptions, NodeSpec, build_engine
from kairos_ray.engines.emulated import BLOCK_TOKENS, EmulatedEngine, token_id
from kairos_ray.messages import EngineRequest, KVHandoff, NodeState, Role
from tests import shared_ray

pytestmark = [pytest.mark.ray, pytest.mark.own_ray]

PROFILE = str(resolve_profile("a100-deepseek-v2-lite"))
HARDWARE = ClusterHardware.from_profile(PROFILE)
KV_SCALE = 1000
PROMPT = tuple(range(3000))  # a prompt given as token ids: its blocks have an identity


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    shared_ray.stop()
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # its own, whatever else runs here
    yield
    ray.shutdown()


def engine(role: Role, states: list[NodeState], **options) -> EmulatedEngine:
    spec = NodeSpec(
        node_id=f"{role.value}-0",
        role=role,
        policy=KairosConfig().build_policy(),
        profile=PROFILE,
        prefill_chunk_tokens=2048,
        options=EngineOptions(
            time_scale=0.05, kv_scale=KV_SCALE, report_interval_s=0.0, report_refresh_s=0.0, **options
        ),
        on_state=states.append,
    )
    built = build_engine("emulated", spec)
    assert isinstance(built, EmulatedEngine)
    return built


def request(rid: int, prompt_tokens: int, max_tokens: int = 5, schedule: tuple[int, ...] = ()) -> EngineRequest:
    return EngineRequest(rid, prompt_tokens, max_tokens, time.time(), chunk_schedule=schedule)


async def collect(decode: EmulatedEngine, req: EngineRequest, handoff: KVHandoff | None):
    return [event async for ready in decode.generate(req, handoff) for event in ready]


def test_a_disaggregated_request_hands_its_kv_through_the_object_store():
    async def scenario():
        prefill_states, decode_states = [], []
        prefill, decode = engine(Role.PREFILL, prefill_states), engine(Role.DECODE, decode_states)
        await prefill.start()
        await decode.start()
        try:
            req = request(7, 5000)
            handoff = await prefill.prefill(req)
            assert isinstance(handoff.kv, ray.ObjectRef) and handoff.transport == "object_store"
            assert handoff.kv_bytes == math.ceil(5000 * HARDWARE.kv_bytes_per_token / KV_SCALE)
            assert prefill.state().pinned_kv == 1  # held until the decode node has it
            events = await collect(decode, req, handoff)
            prefill.release(req.request_id)
            assert prefill.state().pinned_kv == 0
            return events, prefill_states, decode_states
        finally:
            await prefill.shutdown()
            await decode.shutdown()

    events, prefill_states, decode_states = asyncio.run(scenario())
    assert [e.token_id for e in events] == [token_id(7, i) for i in range(5)]
    assert [e.finished for e in events] == [False] * 4 + [True] and events[-1].finish_reason == "length"
    first = events[0].breakdown
    assert first is not None and first.prefill_exec_s > 0 and first.kv_transfer_s >= 0 and first.decode_queue_s > 0
    assert all(e.breakdown is None for e in events[1:])
    # the prefill node reported its 5000-token prompt in chunks of 2048, then an empty queue
    chunks = [step.chunk_tokens for s in prefill_states for step in s.steps]
    assert chunks == [2048, 2048, 904]
    assert any(s.view.queued_prompt_tokens for s in prefill_states)
    assert 7 in {rid for s in decode_states for rid in s.accepted_request_ids}


def test_a_deflected_request_is_prefilled_in_place_per_its_schedule():
    async def scenario():
        states = []
        decode = engine(Role.DECODE, states)
        await decode.start()
        try:
            events = await collect(decode, request(8, 3000, schedule=(2048, 512, 440)), None)
            return events, states, decode.state()
        finally:
            await decode.shutdown()

    events, states, after = asyncio.run(scenario())
    assert len(events) == 5 and events[0].breakdown.kv_transfer_s == 0.0 and events[0].breakdown.prefill_exec_s > 0
    assert [step.chunk_tokens for s in states for step in s.steps if step.chunk_tokens] == [2048, 512, 440]
    assert any(s.view.committed for s in states)  # the schedule showed while it ran
    assert isinstance(after.view, DecodeNodeView) and after.role is Role.DECODE
    assert after.view.batch_size == 0 and after.view.kv_tokens == 0 and after.view.committed == ()


@pytest.mark.parametrize("slower", [1, 3])
def test_a_deflection_is_guarded_with_the_model_the_router_priced_its_node_with(slower):
    """The request carries the router's model for the node (the profile's, or one 3x slower): beside a decoding
    request, the node's run-time guard runs the planned 512-token chunk whole on the profile's model and shrinks it
    to what fits the TBT budget on the slower one."""
    from kairos_ray.core import StepLatencyModel

    pool = StepLatencyModel.load(PROFILE)
    priced = StepLatencyModel.from_coefficients(pool.coefficients * slower, pool.tile_tokens)
    guard = KairosConfig().build_policy().chunk_guard(priced)
    assert guard is not None
    fits = guard(1, 200, 512, 0)
    assert (fits == 512) == (slower == 1)

    async def scenario():
        states = []
        decode = engine(Role.DECODE, states)
        await decode.start()
        try:
            decoder = request(10, 100, max_tokens=400, schedule=(100,))
            stream = decode.generate(decoder, None)
            await anext(stream)  # decoding from now on, for 399 more steps
            deflected = dataclasses.replace(request(11, 1000, schedule=(512, 488)), decode_model=priced)
            events = await collect(decode, deflected, None)
            async for _ in stream:
                pass
            return events, states
        finally:
            await decode.shutdown()

    events, states = asyncio.run(scenario())
    chunks = [step.chunk_tokens for s in states for step in s.steps if step.chunk_tokens]
    assert chunks[0] == 100 and chunks[1] == fits and sum(chunks[1:]) == 1000 and len(events) == 5


def test_kv_that_never_comes_is_recomputed_in_place():
    async def scenario():
        decode = engine(Role.DECODE, [], kv_timeout_s=0.5)
        await decode.start()
        late = sleeper.remote(60)  # the KV's reference: a task that does not end in time
        try:
            slow = KVHandoff(late, 10, "prefill-gone", 0.0, 0.0, time.time(), "object_store")
            start = time.monotonic()
            events = await collect(decode, request(9, 1000), slow)
            return events, decode.kv_recomputes, time.monotonic() - start
        finally:
            ray.cancel(late, force=True)
            await decode.shutdown()

    events, recomputes, waited = asyncio.run(scenario())
    assert len(events) == 5 and events[-1].finished
    assert recomputes == 1 and waited >= 0.5
    assert events[0].breakdown.prefill_exec_s > 0  # the decode node prefilled it


@ray.remote(num_cpus=0)
def sleeper(seconds: float) -> bytes:
    time.sleep(seconds)
    return b""


def test_state_is_a_typed_report_and_shutdown_stops_the_loop():
    async def scenario():
        prefill = engine(Role.PREFILL, [])
        await prefill.start()
        state = prefill.state()
        task = prefill._task
        await prefill.shutdown()
        return state, task

    state, task = asyncio.run(scenario())
    assert isinstance(state, NodeState) and isinstance(state.view, PrefillNodeView)
    assert state.node_id == "prefill-0" and state.role is Role.PREFILL and state.wall_s > 0
    assert task is not None and task.done()
    with pytest.raises(ValueError, match="unknown engine 'tgi'"):
        build_engine("tgi", None)  # type: ignore[arg-type]


def test_a_consumer_that_falls_behind_gets_the_ready_tokens_together():
    async def scenario():
        decode = engine(Role.DECODE, [])
        await decode.start()
        try:
            stream = decode.generate(request(10, 200, max_tokens=40, schedule=(200,)), None)
            items = [await stream.__anext__()]
            await asyncio.sleep(0.3)  # about 10 steps at this time scale: the tokens queue up meanwhile
            items += [ready async for ready in stream]
            return items
        finally:
            await decode.shutdown()

    items = asyncio.run(scenario())
    assert [e.index for ready in items for e in ready] == list(range(40))  # each token once, in order
    assert len(items[0]) == 1 and len(items[1]) > 1  # one message for what was ready, not one per token


def test_a_decode_node_reports_its_cache_and_the_next_turn_computes_only_its_new_suffix():
    async def scenario():
        states = []
        decode = engine(Role.DECODE, states)
        await decode.start()
        try:
            first = EngineRequest(11, 3000, 65, time.time(), chunk_schedule=(2048, 952), prompt_token_ids=PROMPT)
            answer = tuple(e.token_id for e in await collect(decode, first, None))
            history = PROMPT + answer[:-1]  # every token whose KV the node computed
            turn = (*history, *range(500, 600))
            second = EngineRequest(12, len(turn), 5, time.time(), chunk_schedule=(512,), prompt_token_ids=turn)
            events = await collect(decode, second, None)
            return history, events, states
        finally:
            await decode.shutdown()

    history, events, states = asyncio.run(scenario())
    mirror = BlockCache(BLOCK_TOKENS)
    seqs = []
    for state in states:
        if state.prefix is not None:
            assert state.prefix.block_tokens == BLOCK_TOKENS
            seqs.append(state.prefix.seq)
            mirror.apply(state.prefix.delta)
    assert seqs == list(range(len(seqs))) and len(seqs) > 1
    cached = len(history) // BLOCK_TOKENS * BLOCK_TOKENS  # the first turn's prompt and answer, in whole blocks
    assert mirror.cached_tokens(block_ids(history, BLOCK_TOKENS), len(history) + 1) == cached
    assert events[0].cached_tokens == cached
    chunks = [step.chunk_tokens for s in states for step in s.steps if step.chunk_tokens]
    assert chunks == [2048, 952, len(history) + 100 - cached]  # the second turn: only what the cache lacked


def test_a_hand_off_to_a_node_holding_the_history_carries_only_the_rest():
    async def scenario():
        prefill, decode = engine(Role.PREFILL, []), engine(Role.DECODE, [])
        await prefill.start()
        await decode.start()
        try:
            first = EngineRequest(13, 3000, 65, time.time(), chunk_schedule=(2048, 952), prompt_token_ids=PROMPT)
            answer = tuple(e.token_id for e in await collect(decode, first, None))
            turn = (*PROMPT, *answer[:-1], *range(500, 600))
            cached = (3000 + 64) // BLOCK_TOKENS * BLOCK_TOKENS  # what the decode node holds of the turn
            second = EngineRequest(
                14, len(turn), 5, time.time(), prompt_token_ids=turn, kv_receiver_cached_tokens=cached
            )
            handoff = await prefill.prefill(second)
            events = await collect(decode, second, handoff)
            prefill.release(second.request_id)
            # told it holds the whole turn, a node that does not recomputes it rather than decode without its KV
            third = EngineRequest(15, 400, 3, time.time(), prompt_token_ids=tuple(range(7000, 7400)))
            overstated = await prefill.prefill(dataclasses.replace(third, kv_receiver_cached_tokens=400))
            recomputed = await collect(decode, third, overstated)
            prefill.release(third.request_id)
            return turn, cached, handoff, events, recomputed, decode.kv_recomputes
        finally:
            await prefill.shutdown()
            await decode.shutdown()

    turn, cached, handoff, events, recomputed, recomputes = asyncio.run(scenario())
    assert handoff.skipped_tokens == cached
    assert handoff.kv_bytes == math.ceil((len(turn) - cached) * HARDWARE.kv_bytes_per_token / KV_SCALE)
    assert [e.token_id for e in events] == [token_id(14, i) for i in range(5)]
    assert events[0].breakdown.kv_transfer_s >= 0 and recomputes == 1
    assert [e.token_id for e in recomputed] == [token_id(15, i) for i in range(3)]
