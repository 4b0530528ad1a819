"""``VllmEngine`` nodes on real vLLM CPU engines and a real local Ray: KV hand-offs, failures, state.

KV travels through the Ray object store, or over the gloo KV channel when the
prefill node is told the decode node (``kv_receiver``).

One prefill and one decode engine (``AsyncLLM`` each, in child processes of
this one) share an event loop here, as they would inside Serve replicas.
"""

import asyncio
import dataclasses
import time

import pytest
import ray

from kairos_ray.config import KairosConfig
from kairos_ray.core import StepLatencyModel
from kairos_ray.engines.reporting import StateReporter
from kairos_ray.engines.vllm_args import join_spec
from kairos_ray.engines.vllm_engine import VllmEngine
from kairos_ray.engines.vllm_worker import IDLE_SPIN_S
from kairos_ray.kv.channel import ChannelTicket, KVChannel
from kairos_ray.messages import EngineRequest, KVHandoff, Role
from tests import shared_ray
from tests.engines.tiny import GREEDY, PROMPTS, TINY_KWARGS, node_pair

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.own_ray]

OUTPUT = 16
KV_TIMEOUT_S = 5.0
MODEL = KairosConfig.model_validate({"predictor": {"profile": "cpu-tiny-llama"}}).predictor.load()


def request(
    rid: int, prompt: list[int], schedule: tuple[int, ...] = (), receiver: str = "", **sampling
) -> EngineRequest:
    from vllm import SamplingParams

    params = SamplingParams(**{**GREEDY, **sampling})
    return EngineRequest(rid, len(prompt), OUTPUT, time.time(), schedule, tuple(prompt), params, kv_receiver=receiver)


@ray.remote(num_cpus=0)
class Holder:
    """Owns an object in the store; the object is lost when the holder dies."""

    def put(self, value):
        return [ray.put(value)]


@ray.remote(num_cpus=0)
class GoneSender:
    """A prefill node's channel end that issues a ticket and dies without sending."""

    def ticket(self, receiver: str, request_id: int) -> ChannelTicket:
        self.channel = KVChannel("prefill-gone", "127.0.0.1")
        return self.channel.ticket(receiver, request_id, 1 << 20)


@ray.remote(num_cpus=0)
def never(seconds: float) -> bytes:
    time.sleep(seconds)
    return b""


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """(run, prefill engine, decode engine, states pushed by each)."""
    shared_ray.stop()
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # its own, whatever else runs here
    states = {"prefill": [], "decode": []}

    def per_role(role):
        staging = str(tmp_path_factory.mktemp(role))
        return {}, {
            "kv_timeout_s": KV_TIMEOUT_S,
            # the watchdog is tested in tests/serve; here two engine cores share two busy cores, and a first step
            # of a new shape has taken over 10 s (the default) there
            "stall_timeout_s": 120.0,
            "reporter": StateReporter("", MODEL, states[role].append, interval_s=0.0, refresh_s=0.0),  # every step
            "staging_dir": staging,
            "kv_channel": "gloo",
            "hold_blocks": role == "prefill",  # the prefill node keeps its blocks until the KV is taken
        }

    try:
        with node_pair(TINY_KWARGS, per_role) as (run, prefill, decode):
            yield run, prefill, decode, states
    finally:
        ray.shutdown()


async def plain_tokens(decode: VllmEngine, i: int, prompt: list[int]) -> list[int]:
    """Greedy tokens of a plain request to the decode node's engine (no hand-off, no schedule)."""
    from vllm import SamplingParams

    final: list[int] = []
    params = SamplingParams(max_tokens=OUTPUT, **GREEDY)
    async for out in decode.llm.generate({"prompt_token_ids": prompt}, params, request_id=f"ref{i}"):
        final = list(out.outputs[0].token_ids)
    return final


@pytest.fixture(scope="module")
def reference(nodes):
    run, _, decode, _ = nodes
    return [run(plain_tokens(decode, i, p)) for i, p in enumerate(PROMPTS)]


async def tokens(decode, req, handoff):
    return [event.token_id async for ready in decode.generate(req, handoff) for event in ready]


def test_disaggregated_requests_over_the_object_store_match_a_plain_run(nodes, reference):
    run, prefill, decode, _ = nodes
    for i, prompt in enumerate(PROMPTS):
        req = request(100 + i, prompt)  # no decode node named: the object store
        handoff = run(prefill.prefill(req))
        assert isinstance(handoff.kv, ray.ObjectRef) and handoff.kv_bytes > 0
        assert prefill.state().pinned_kv == 1  # held for the decode node
        assert run(tokens(decode, req, handoff)) == reference[i]
        prefill.release(req.request_id)
        assert prefill.state().pinned_kv == 0
    assert decode.kv_recomputes == 0


def test_disaggregated_requests_over_the_gloo_channel_match_a_plain_run(nodes, reference):
    run, prefill, decode, _ = nodes
    for i, prompt in enumerate(PROMPTS):
        req = request(150 + i, prompt, receiver=decode.node_id)
        handoff = run(prefill.prefill(req))
        assert isinstance(handoff.kv, ChannelTicket) and handoff.kv.receiver == decode.node_id
        assert prefill.state().pinned_kv == 1  # the send waits for the decode node
        assert run(tokens(decode, req, handoff)) == reference[i]
        run(_until(lambda: prefill.state().pinned_kv == 0))  # taken: nothing held any more
    assert decode.kv_recomputes == 0 and len(decode.kv.channel) == 1  # one pair, reused


async def _until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_the_prefill_node_holds_the_blocks_until_the_decode_node_has_the_kv(nodes, reference):
    run, prefill, decode, states = nodes
    req = request(500, PROMPTS[2])  # through the object store: taken when released
    handoff = run(prefill.prefill(req))
    steps = len(states["prefill"])
    run(_until(lambda: len(states["prefill"]) > steps + 5))  # the engine steps on while it holds the blocks
    assert prefill.state().kv_usage > 0
    assert run(tokens(decode, req, handoff)) == reference[2]
    prefill.release(req.request_id)
    run(_until(lambda: prefill.state().kv_usage == 0))
    req = request(501, PROMPTS[2], receiver=decode.node_id)  # over the channel: taken when received
    handoff = run(prefill.prefill(req))
    assert prefill.state().kv_usage > 0
    assert run(tokens(decode, req, handoff)) == reference[2]
    run(_until(lambda: prefill.state().kv_usage == 0))


def test_kv_from_a_channel_sender_that_died_is_recomputed(nodes, reference):
    run, _, decode, _ = nodes
    before = decode.kv_recomputes
    req = request(450, PROMPTS[1], receiver=decode.node_id)
    sender = GoneSender.remote()
    ticket = ray.get(sender.ticket.remote(decode.node_id, req.request_id))
    ray.kill(sender)
    handoff = KVHandoff(ticket, 1, "prefill-gone", 0.0, 0.0, time.time(), "gloo")
    assert run(tokens(decode, req, handoff)) == reference[1]
    assert decode.kv_recomputes == before + 1


def test_deflected_requests_match_a_plain_run(nodes, reference):
    run, _, decode, _ = nodes
    for i, prompt in enumerate(PROMPTS):
        schedule = (256, 128, len(prompt) - 384) if len(prompt) > 400 else (len(prompt),)
        assert run(tokens(decode, request(200 + i, prompt, schedule), None)) == reference[i]


def test_the_decode_node_samples_with_the_requests_parameters_on_both_routes(nodes):
    """A seeded, penalised sample with logprobs: a hand-off (the prefill node's own greedy token dropped) and a
    deflection each give the tokens and logprobs of one plain engine run with the same parameters."""
    from vllm import SamplingParams

    run, prefill, decode, _ = nodes
    sampling = {"temperature": 0.9, "seed": 11, "top_k": 50, "presence_penalty": 0.5, "logprobs": 3}
    prompt = PROMPTS[2]

    async def plain() -> list:
        params = SamplingParams(max_tokens=OUTPUT, **{**GREEDY, **sampling})
        final = None
        async for out in decode.llm.generate({"prompt_token_ids": prompt}, params, request_id="seeded-ref"):
            final = out.outputs[0]
        return [(t, lp[t].logprob) for t, lp in zip(final.token_ids, final.logprobs, strict=True)]

    async def events(req, handoff) -> list:
        return [event async for ready in decode.generate(req, handoff) for event in ready]

    reference = run(plain())
    handed_off = request(800, prompt, **sampling)
    deflected = request(801, prompt, (512, 183), **sampling)
    for got in (run(events(handed_off, run(prefill.prefill(handed_off)))), run(events(deflected, None))):
        assert [e.token_id for e in got] == [t for t, _ in reference]
        assert [e.logprobs[0].token_id for e in got] == [t for t, _ in reference]  # the sampled token's first
        assert [e.logprobs[0].logprob for e in got] == pytest.approx([lp for _, lp in reference], abs=1e-4)
        assert all(len(e.logprobs) >= 3 for e in got)
    prefill.release(handed_off.request_id)


def lost_handoff(run, prefill, req) -> KVHandoff:
    """A real hand-off whose KV object is then lost: its owner dies."""
    good = run(prefill.prefill(req))
    prefill.release(req.request_id)
    holder = Holder.remote()
    (ref,) = ray.get(holder.put.remote(ray.get(good.kv)))
    ray.kill(holder)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # ray.kill returns at once; wait until the object is gone with its owner
        try:
            ray.get(ref, timeout=10)
        except ray.exceptions.ObjectLostError:
            return dataclasses.replace(good, kv=ref)
        time.sleep(0.1)
    pytest.fail("the KV object outlived its owner by 60 s")


def test_a_lost_transfer_is_recomputed_on_the_decode_node(nodes, reference):
    run, prefill, decode, _ = nodes
    before = decode.kv_recomputes
    req = request(300, PROMPTS[2])
    handoff = lost_handoff(run, prefill, req)
    assert run(tokens(decode, req, handoff)) == reference[2]
    assert decode.kv_recomputes == before + 1


def test_a_late_transfer_is_recomputed_after_the_timeout(nodes, reference):
    run, prefill, decode, _ = nodes
    before = decode.kv_recomputes
    req = request(400, PROMPTS[3])
    good = run(prefill.prefill(req))
    prefill.release(req.request_id)
    starved = never.remote(600)  # the KV never arrives
    try:
        start = time.monotonic()
        assert run(tokens(decode, req, dataclasses.replace(good, kv=starved))) == reference[3]
        assert time.monotonic() - start >= KV_TIMEOUT_S
    finally:
        ray.cancel(starved, force=True)
    assert decode.kv_recomputes == before + 1


def test_engines_push_live_state_after_their_steps(nodes):
    run, prefill, decode, states = nodes
    for role in states:
        states[role].clear()
    req = request(600, PROMPTS[3])  # 1500 tokens: three prefill steps of at most 512
    handoff = run(prefill.prefill(req))
    prefill.release(req.request_id)
    run(tokens(decode, req, handoff))
    run(tokens(decode, request(601, PROMPTS[2], (256, 439)), None))
    prefill_steps = [step for s in states["prefill"] for step in s.steps]
    assert sum(step.chunk_tokens for step in prefill_steps) >= 1500 and all(s.measured_s > 0 for s in prefill_steps)
    assert all(step.predicted_s > 0 for step in prefill_steps)  # the node's model priced each step
    decode_steps = [step for s in states["decode"] for step in s.steps]
    assert any(step.batch_size > 0 for step in decode_steps)  # steps that decoded
    assert any(s.view.queued_prompt_tokens == (1500,) for s in states["prefill"])  # queued while it ran
    assert any(s.view.committed == ((256, 439),) for s in states["decode"])  # before its first token
    assert {600, 601} <= {rid for s in states["decode"] for rid in s.accepted_request_ids}
    assert {s.role for s in states["prefill"]} == {Role.PREFILL} and {s.role for s in states["decode"]} == {Role.DECODE}
    assert prefill.state().view.queued_prompt_tokens == () and decode.state().view.batch_size == 0  # all done now


def test_a_deflected_request_runs_its_chunk_schedule_step_by_step(nodes):
    """The engine hands the router's schedule to vLLM's scheduler: its steps' prefill tokens are the schedule."""
    run, _, decode, states = nodes
    states["decode"].clear()
    schedule = (300, 200, 150, 45)
    assert sum(schedule) == len(PROMPTS[2])
    run(tokens(decode, request(700, PROMPTS[2], schedule), None))
    prefill_steps = [step.chunk_tokens for s in states["decode"] for step in s.steps if step.chunk_tokens]
    assert tuple(prefill_steps) == schedule


TIGHT = StepLatencyModel(0.01, 0.001, 0, 0, 0, 0)  # a step of two decoding requests overruns 11.5 ms
LOOSE = StepLatencyModel(0.001, 0.0001, 0, 0, 0, 0)  # one of 100 does not


def joined_under_a_tight_guard(
    run, prefill, decode, rid: int, priced_by_router: bool = False
) -> tuple[list[int], list[int], list[str]]:
    """(the hand-off's tokens, the decoder's, whose each token was in order): a hand-off that arrives while
    another request decodes, on a decode node whose join guard a step of two decoding requests overruns
    (10 ms + 1 ms per request against 11.5 ms). ``priced_by_router``: the node's own guard is loose, and the
    tight model comes with the hand-off as the one the router priced the node with (``decode_model``)."""
    order: list[str] = []

    async def stream(req, handoff, name):
        out = []
        async for ready in decode.generate(req, handoff):
            order.extend(name for _ in ready)
            out += [event.token_id for event in ready]
        return out

    async def scenario():
        decoder = dataclasses.replace(request(rid, PROMPTS[0], (len(PROMPTS[0]),)), max_tokens=256)
        decoding = asyncio.ensure_future(stream(decoder, None, "decoder"))
        while not order:  # decoding: the hand-off comes while it has 255 tokens to go
            await asyncio.sleep(0.01)
        joiner = request(rid + 1, PROMPTS[1])
        if priced_by_router:
            joiner = dataclasses.replace(joiner, decode_model=TIGHT)
        handoff = await prefill.prefill(joiner)
        try:
            return await stream(joiner, handoff, "joiner"), await decoding
        finally:
            prefill.release(joiner.request_id)

    decode.join_guard = join_spec(LOOSE if priced_by_router else TIGHT, 0.0115)
    try:
        joined, decoded = run(scenario())
    finally:
        decode.join_guard = None
    return joined, decoded, order


def test_a_handoff_joins_the_decode_batch_only_once_its_step_fits_the_budget(nodes, reference):
    """Admission's decode-side protection on a vLLM decode node: the hand-off starts only once the decoding
    request has finished; its tokens are a plain run's."""
    run, prefill, decode, _ = nodes
    joined, decoded, order = joined_under_a_tight_guard(run, prefill, decode, 800)
    assert len(decoded) == 256 and joined == reference[1]
    assert order.index("joiner") == len(decoded)  # every token of the decoder came first


def test_a_handoff_is_held_with_the_model_the_router_priced_its_node_with(nodes, reference):
    """The node's configured profile would let the hand-off join at once; the router's calibrated model for the
    node, carried by the request, does not: the guard checks with the router's."""
    run, prefill, decode, _ = nodes
    joined, decoded, order = joined_under_a_tight_guard(run, prefill, decode, 810, priced_by_router=True)
    assert len(decoded) == 256 and joined == reference[1]
    assert order.index("joiner") == len(decoded)


def test_every_nodes_cpu_workers_stop_spinning_soon_after_their_steps(nodes):
    run, prefill, decode, _ = nodes
    for engine in (prefill, decode):
        assert run(engine.llm.collective_rpc("spin_bound_s")) == [IDLE_SPIN_S]


def test_every_nodes_engine_core_knows_the_process_it_ends_with(nodes):
    """vLLM's plugin in the engine core (``engines.vllm_parent_watch``, tested on real processes beside) watches
    the process named in its environment: the one that started it, here this test's."""
    import os

    from kairos_ray.engines.vllm_parent_watch import PARENT_ENV

    _, prefill, decode, _ = nodes
    for engine in (prefill, decode):
        (core,) = engine.engine_pids()
        # read raw: vLLM's process title overwrites the block's start, which psutil's environ() then reads as empty
        with open(f"/proc/{core}/environ", "rb") as environ:
            assert f"{PARENT_ENV}={os.getpid()}".encode() in environ.read().split(b"\0")
        with open(f"/proc/{core}/stat") as stat:
            assert int(stat.read().rsplit(")", 1)[1].split()[1]) == os.getpid()  # its parent


def test_cpu_engines_of_a_host_spread_over_its_cores(monkeypatch):
    import os

    from kairos_ray.engines.vllm_engine import bind_cpu_core

    cores = sorted(os.sched_getaffinity(0))
    seen = {}
    for role, rank in ((Role.PREFILL, 0), (Role.PREFILL, 1), (Role.DECODE, 0), (Role.DECODE, 1)):
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
        bind_cpu_core(role, rank)
        seen[role.value, rank] = os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    assert seen["prefill", 0] == seen["decode", 1] == str(cores[0])
    assert seen["prefill", 1] == seen["decode", 0] == str(cores[1 % len(cores)])
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    bind_cpu_core(Role.DECODE, 0)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"  # the user's setting wins
