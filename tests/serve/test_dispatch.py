"""One request's run over fake pools (``tests/serve/fakes.py``): every way it can end, and what it leaves behind."""

import asyncio
import dataclasses

import pytest

from kairos_ray.core import Admission, Decision, Route, ShedReason
from kairos_ray.messages import DecisionRequest, RoutingReply
from kairos_ray.serve.dispatch import (
    PROMPTS_HASHED_KEPT,
    SHARD_DOWN_S,
    DecisionBatcher,
    RequestFailed,
    RouterShards,
    ServingLimits,
    Shed,
    StreamBroken,
    migration_blocker,
)
from tests.serve.fakes import LIMITS, FakeCluster, FakeRouter, Remote, deflect_to, hand_off, request, until


def run(scenario):
    return asyncio.run(asyncio.wait_for(scenario(), 30))


async def streamed(run_):
    """Every token after the first ones, as the client reads them."""
    return [event.index for ready in [r async for r in run_.rest()] for event in ready]


def test_a_completed_request_leaves_nothing_in_the_mux_and_cancels_nothing():
    async def scenario():
        cluster = FakeCluster(deflect_to("decode-a"))
        req = request(max_tokens=3)
        run_ = cluster.dispatcher.run(req)
        starting = asyncio.ensure_future(run_.start())
        await until(lambda: cluster.decode.started)
        cluster.decode.emit("decode-a", req, 0, 1)
        first = await starting
        cluster.decode.emit("decode-a", req, 1, 2, last=True)
        rest = await streamed(run_)
        run_.close()
        return cluster, first, rest

    cluster, first, rest = run(scenario)
    assert [e.index for e in first] == [0] and rest == [1, 2]
    assert cluster.dispatcher.mux.residue() == {"mux_queues": 0, "mux_nodes": 0, "mux_early": 0}
    assert cluster.decode.cancelled() == []  # it finished on its node: nothing to abort there


def test_a_handed_off_request_releases_its_kv_once_its_first_token_is_here():
    async def scenario():
        cluster = FakeCluster(hand_off("prefill-a", "decode-b"))
        req = request(max_tokens=2)
        run_ = cluster.dispatcher.run(req)
        starting = asyncio.ensure_future(run_.start())
        await until(lambda: cluster.decode.started)
        assert cluster.prefill.release.calls == []  # the decode node has not taken the KV yet
        cluster.decode.emit("decode-b", req, 0, 1)
        await starting
        cluster.decode.emit("decode-b", req, 1, 1, last=True)
        await streamed(run_)
        run_.close()
        return cluster, run_

    cluster, run_ = run(scenario)
    (node, started, handoff) = cluster.decode.started[0]
    assert node == "decode-b" and handoff.node_id == "prefill-a" and started.kv_receiver == "decode-b"
    assert cluster.prefill.release.calls == [((1,), {"node": "prefill-a"})]
    assert run_.route.prefill_node == "prefill-a" and run_.route.decode_node == "decode-b"
    assert sum(cluster.dispatcher.mux.residue().values()) == 0


def test_a_node_of_a_second_decode_group_is_called_through_its_groups_deployment_from_start_to_abort():
    async def scenario():
        cluster = FakeCluster(hand_off("prefill-a", "decode-1-x"), second_decode_group=("decode-1-x",))
        req = request(max_tokens=8)
        run_ = cluster.dispatcher.run(req)
        starting = asyncio.ensure_future(run_.start())
        await until(lambda: cluster.second.started)
        cluster.second.emit("decode-1-x", req, 0, 2)  # its tokens come over its group's subscription
        first = await starting
        run_.close()  # the client went away
        return cluster, first

    cluster, first = run(scenario)
    assert [e.index for e in first] == [0, 1]
    assert [node for node, _, _ in cluster.second.started] == ["decode-1-x"] and cluster.decode.started == []
    assert cluster.second.cancelled() == [(1, 0, "decode-1-x")] and cluster.decode.cancelled() == []
    assert sum(cluster.dispatcher.mux.residue().values()) == 0


@pytest.mark.parametrize("when", ["before_first_token", "after_first_token"])
def test_a_client_that_goes_away_aborts_its_run_and_frees_its_kv(when):
    async def scenario():
        cluster = FakeCluster(hand_off("prefill-a", "decode-a"))
        req = request(max_tokens=8)
        run_ = cluster.dispatcher.run(req)
        starting = asyncio.ensure_future(run_.start())
        await until(lambda: cluster.decode.started)
        if when == "before_first_token":
            starting.cancel()  # the client's connection closed: Serve cancels the handler
            with pytest.raises(asyncio.CancelledError):
                await starting
        else:
            cluster.decode.emit("decode-a", req, 0, 1)
            await starting
            cluster.decode.emit("decode-a", req, 1, 1)
            reading = run_.rest()
            await anext(reading)
            await reading.aclose()
        run_.close()
        return cluster

    cluster = run(scenario)
    assert cluster.decode.cancelled() == [(1, 0, "decode-a")]
    assert len(cluster.prefill.release.calls) == 1  # held KV freed exactly once
    assert sum(cluster.dispatcher.mux.residue().values()) == 0


def test_a_node_that_fails_before_the_first_token_is_avoided_and_the_request_runs_elsewhere():
    async def scenario():
        cluster = FakeCluster(lambda r: deflect_to("decode-b" if "decode-a" in r.avoid else "decode-a")(r))
        cluster.decode.refuse["decode-a"] = RuntimeError("replica died")
        req = request(max_tokens=1)
        run_ = cluster.dispatcher.run(req)
        starting = asyncio.ensure_future(run_.start())
        await until(lambda: cluster.decode.started)
        cluster.decode.emit("decode-b", req, 0, 1, last=True)
        first = await starting
        run_.close()
        return cluster, run_, first

    cluster, run_, first = run(scenario)
    assert first[0].node_id == "decode-b" and run_.attempts == 2
    assert [r.avoid for r in cluster.router.asked] == [(), ("decode-a",)]
    assert sum(cluster.dispatcher.mux.residue().values()) == 0


def test_a_decode_node_that_fails_mid_stream_is_left_and_the_stream_goes_on_from_the_tokens_sent():
    async def scenario():
        cluster = FakeCluster(lambda r: deflect_to("decode-b" if "decode-a" in r.avoid else "decode-a")(r))
        req = request(prompt_tokens=10, max_tokens=5)
        run_ = cluster.dispatcher.run(req)
        starting = asyncio.ensure_future(run_.start())
        await until(lambda: cluster.decode.started)
        cluster.decode.emit("decode-a", req, 0, 2)
        await starting
        reading = asyncio.ensure_future(streamed(run_))
        cluster.decode.fail("decode-a", req, "EngineUnhealthy: stalled")
        await until(lambda: len(cluster.decode.started) == 2)
        moved = cluster.decode.started[1][1]
        cluster.decode.emit("decode-b", moved, 2, 3, last=True)
        rest = await reading
        run_.close()
        return cluster, run_, moved, rest

    cluster, run_, moved, rest = run(scenario)
    assert rest == [2, 3, 4] and run_.migrations == 1
    assert moved.prompt_tokens == 12 and moved.max_tokens == 3 and moved.output_offset == 2
    assert moved.prompt_token_ids[-2:] == (1000, 1001)  # the prompt plus the tokens the client has
    assert cluster.decode.cancelled() == [(1, 0, "decode-a")]
    assert sum(cluster.dispatcher.mux.residue().values()) == 0


def test_a_broken_subscription_moves_its_requests_and_migrations_run_out():
    async def scenario():
        limits = ServingLimits(5.0, 5.0, 5.0, max_attempts=3, max_migrations=1)
        cluster = FakeCluster(deflect_to(""), limits=limits)
        req = request(max_tokens=5)
        run_ = cluster.dispatcher.run(req)
        starting = asyncio.ensure_future(run_.start())
        await until(lambda: cluster.decode.started)
        cluster.decode.emit("decode-a", req, 0, 1)
        await starting
        reading = asyncio.ensure_future(streamed(run_))
        cluster.decode.break_subscription("decode-a", ConnectionError("replica died"))
        await until(lambda: len(cluster.decode.started) == 2)
        cluster.decode.fail("decode-b", cluster.decode.started[1][1], "EngineUnhealthy: died")
        with pytest.raises(StreamBroken, match="1 migrations"):
            await reading
        run_.close()
        return cluster

    cluster = run(scenario)
    assert [node for node, _, _ in cluster.decode.started] == ["decode-a", "decode-b"]
    assert sum(cluster.dispatcher.mux.residue().values()) == 0


def shed_unless_retried(r):
    """A router whose admission sheds every sheddable request (with a 2.4 s retry-after) and deflects the rest."""
    if not r.sheddable:
        return deflect_to("decode-b")(r)
    verdict = Admission(False, ShedReason.NO_ROUTE_IN_TIME, 9.0, 3.6, 2.4)
    return Decision(Route.PREFILL, "prefill-a", "decode-a", (), 9.0, 9.5, "in time nowhere", admission=verdict)


def test_a_shed_request_fails_at_once_with_429_having_called_no_node():
    async def scenario():
        cluster = FakeCluster(shed_unless_retried)
        run_ = cluster.dispatcher.run(request(priority=3))
        with pytest.raises(Shed) as shed:
            await run_.start()
        run_.close()
        return cluster, shed.value

    cluster, shed = run(scenario)
    assert (shed.status, shed.retry_after_s, shed.reason) == (429, 3, "no-route-in-time")  # whole seconds, up
    assert "9.000 s" in shed.detail and "9.000" not in shed.message  # the estimate goes to the log only
    assert [(r.priority, r.sheddable) for r in cluster.router.asked] == [(3, True)]
    assert cluster.prefill.prefill.calls == [] and cluster.decode.started == []
    assert sum(cluster.dispatcher.mux.residue().values()) == 0


def test_a_retry_of_an_admitted_request_is_never_shed():
    async def scenario():
        tries = iter([deflect_to("decode-a"), shed_unless_retried])  # admitted, its node fails, then asked again
        cluster = FakeCluster(lambda r: next(tries)(r))
        cluster.decode.refuse["decode-a"] = RuntimeError("replica died")
        req = request(max_tokens=1)
        run_ = cluster.dispatcher.run(req)
        starting = asyncio.ensure_future(run_.start())
        await until(lambda: cluster.decode.started)
        cluster.decode.emit("decode-b", req, 0, 1, last=True)
        first = await starting
        run_.close()
        return cluster, first

    cluster, first = run(scenario)
    assert first[0].node_id == "decode-b"
    assert [r.sheddable for r in cluster.router.asked] == [True, False]


def test_no_first_token_within_the_deadline_is_a_504_and_aborts_the_run():
    async def scenario():
        limits = ServingLimits(5.0, first_token_timeout_s=0.2, token_stall_timeout_s=5.0, max_attempts=3,
                               max_migrations=1)  # fmt: skip
        cluster = FakeCluster(hand_off("prefill-a", "decode-a"), limits=limits)
        run_ = cluster.dispatcher.run(request())
        with pytest.raises(RequestFailed) as failed:
            await run_.start()
        return cluster, failed.value

    cluster, failed = run(scenario)
    assert failed.status == 504
    assert cluster.decode.cancelled() == [(1, 0, "decode-a")] and len(cluster.prefill.release.calls) == 1
    assert sum(cluster.dispatcher.mux.residue().values()) == 0


def test_a_request_that_fails_on_every_try_is_a_503_whose_detail_names_the_last_failure_for_the_log():
    async def scenario():
        cluster = FakeCluster(hand_off("prefill-a", "decode-a"))
        cluster.prefill.handoff_for = lambda request, node: (_ for _ in ()).throw(RuntimeError("engine died"))
        run_ = cluster.dispatcher.run(request())
        with pytest.raises(RequestFailed) as failed:
            await run_.start()
        return cluster, run_, failed.value

    cluster, run_, failed = run(scenario)
    assert failed.status == 503 and run_.attempts == LIMITS.max_attempts
    assert "engine died" in failed.detail and "engine died" not in failed.message  # the client sees no remote error
    assert cluster.decode.started == []
    assert sum(cluster.dispatcher.mux.residue().values()) == 0


class Link:
    """A router link that records each call's batch and answers when the test says."""

    def __init__(self) -> None:
        self.calls: list[tuple[list, object]] = []

    def decide_then(self, requests, answered, timeout_s):
        self.calls.append((requests, answered))

    def answer(self, i: int, failure: BaseException | None = None) -> None:
        requests, answered = self.calls[i]
        replies = None if failure else [RoutingReply(deflect_to("decode-a")(r), 0.0, 0.0) for r in requests]
        answered(replies, failure)


def test_a_ticks_first_decision_goes_at_once_and_the_rest_of_the_tick_together_at_its_end():
    async def scenario():
        link = Link()
        batcher = DecisionBatcher(link, timeout_s=5.0)
        asks = [asyncio.ensure_future(batcher.decide(DecisionRequest(i, 100, 4))) for i in range(4)]
        await asyncio.sleep(0)  # the four run in one tick
        sizes_in_tick = [len(r) for r, _ in link.calls]
        await asyncio.sleep(0)  # the tick is over
        sizes = [len(r) for r, _ in link.calls]
        link.answer(0)
        link.answer(1)
        replies = await asyncio.gather(*asks)
        return sizes_in_tick, sizes, replies

    in_tick, sizes, replies = run(scenario)
    assert in_tick == [1] and sizes == [1, 3]  # at most two calls per tick, none waiting to batch
    assert [r.decision.decode_node for r in replies] == ["decode-a"] * 4


def test_a_failed_call_fails_each_of_its_callers_and_skips_those_who_gave_up():
    async def scenario():
        link = Link()
        batcher = DecisionBatcher(link, timeout_s=5.0)
        first = asyncio.ensure_future(batcher.decide(DecisionRequest(1, 100, 4)))
        gone = asyncio.ensure_future(batcher.decide(DecisionRequest(2, 100, 4)))
        waiting = asyncio.ensure_future(batcher.decide(DecisionRequest(3, 100, 4)))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        gone.cancel()  # its deadline passed
        await asyncio.sleep(0)
        link.answer(1, TimeoutError("the router did not answer"))
        link.answer(0)
        results = await asyncio.gather(first, waiting, return_exceptions=True)
        return results, batcher.waiting

    (first, waiting), left = run(scenario)
    assert first.decision.decode_node == "decode-a" and isinstance(waiting, TimeoutError) and left == []


@pytest.mark.parametrize(
    "fields, blocker",
    [
        ({}, ""),
        ({"temperature": 0.8, "top_p": 0.9, "logit_bias": {3: 1.0}, "repetition_penalty": 1.2}, ""),
        ({"seed": 3, "temperature": 0.0}, ""),  # greedy: the seed draws nothing
        ({"seed": 3, "temperature": 1.0}, "a seed"),
        ({"presence_penalty": 0.5}, "presence/frequency penalties"),
        ({"stop": ["end"]}, "stop strings"),
        ({"bad_words": ["no"]}, "bad words"),
    ],
)
def test_a_request_migrates_only_when_its_sampling_carries_over_exactly(fields, blocker):
    from vllm import SamplingParams

    found = migration_blocker(SamplingParams(**fields))
    assert found.startswith(blocker) and bool(found) is bool(blocker)
    assert migration_blocker(None) == ""  # emulated engines: nothing to carry


def test_a_prompt_s_samples_and_retries_hash_its_blocks_once_and_only_the_latest_prompts_are_kept():
    async def scenario():
        cluster = FakeCluster(deflect_to("decode-a"))
        dispatcher = cluster.dispatcher
        dispatcher.block_tokens = (16,)
        first = request(1, prompt_tokens=640)
        sample = dataclasses.replace(first, request_id=2)  # a second sample: the same token-id tuple
        hashes = dispatcher.block_ids(first)
        assert len(hashes[16]) == 40
        assert dispatcher.block_ids(sample) is hashes  # not hashed again
        same_text = request(3, prompt_tokens=640)  # equal tokens, another prompt: hashed on its own, equal
        assert dispatcher.block_ids(same_text) == hashes and dispatcher.block_ids(same_text) is not hashes
        dispatcher.block_tokens = (16, 32)  # the nodes' block sizes changed: hashed again for both
        assert set(dispatcher.block_ids(sample)) == {16, 32}
        others = [request(10 + i, prompt_tokens=64) for i in range(PROMPTS_HASHED_KEPT)]
        for other in others:
            dispatcher.block_ids(other)
        assert dispatcher.block_ids(first) is not hashes  # pushed out by later prompts: kept state is bounded
        return dispatcher.block_ids(dataclasses.replace(first, cache_salt="tenant-b"))

    assert run(scenario) == {}  # a salted prompt has no prefix identity the router could match


def test_a_request_with_prompt_logprobs_is_priced_cache_blind_and_its_migration_computes_none():
    """vLLM reads no prefix cache for a request with prompt logprobs: the router is sent no hashes, so a deflection's
    schedule covers the whole prompt; a migration's new prompt (the tokens sent appended) asks for none."""
    from vllm import SamplingParams

    async def scenario():
        dispatcher = FakeCluster(deflect_to("decode-a")).dispatcher
        dispatcher.block_tokens = (16,)
        sampling = SamplingParams(prompt_logprobs=2, max_tokens=8)
        scoring = dataclasses.replace(request(1, prompt_tokens=640), sampling=sampling)
        assert sampling.skip_reading_prefix_cache and dispatcher.block_ids(scoring) == {}
        moved = dispatcher.run(scoring)
        moved.sent = [5, 6]
        continued = moved._continuation()
        assert continued.sampling.prompt_logprobs is None and not continued.sampling.skip_reading_prefix_cache
        assert len(dispatcher.block_ids(continued)[16]) == 40
        assert sampling.prompt_logprobs == 2  # the first run's own parameters are left as they are

    run(scenario)


def test_router_shards_take_requests_in_turn_and_leave_a_dead_or_hung_shard_to_the_others():
    def dead(requests):
        raise RuntimeError("the shard's actor died")

    async def scenario():
        shards = [FakeRouter(deflect_to("decode-a")), FakeRouter(deflect_to("decode-b"))]
        now, failed = [0.0], []
        decisions = RouterShards(shards, timeout_s=5.0, clock=lambda: now[0], left_out=failed.append)  # type: ignore[list-item]

        async def nodes(first_id, count, timeout_s=5.0):
            asks = [decisions.decide(DecisionRequest(first_id + i, 100, 4), timeout_s) for i in range(count)]
            return [(await ask).decision.decode_node for ask in asks]

        both = await nodes(0, 4)
        shards[1].decide_many = died = Remote(dead)
        without_1 = await nodes(10, 4)  # shard 1's turn comes: it fails, shard 0 answers, then alone
        left_out = decisions.live()
        now[0] += SHARD_DOWN_S  # after that, shard 1 is asked again: hung now
        shards[1].decide_many = stuck = Remote(lambda requests: asyncio.get_running_loop().create_future())
        start = asyncio.get_running_loop().time()
        hung = await nodes(20, 2, timeout_s=0.4)
        waited = asyncio.get_running_loop().time() - start
        asked_1 = [[r.request_id for r in args[0]] for calls in (died.calls, stuck.calls) for args, _ in calls]
        counted = list(failed)
        return shards, both, without_1, left_out, hung, waited, asked_1, counted

    shards, both, without_1, left_out, hung, waited, asked_1, counted = run(scenario)
    assert counted == [1, 1]  # each time a shard was left out (the ingress's kairos_router_shard_failovers)
    assert both == ["decode-a", "decode-b", "decode-a", "decode-b"]  # in turn
    assert without_1 == ["decode-a"] * 4 and left_out == (0,)
    assert [r.shards for r in shards[0].asked[:2]] == [(0, 1), (0, 1)]  # each names the shards it deems live
    assert [(r.request_id, r.shards) for r in shards[0].asked[2:6]] == [
        (10, (0, 1)),
        (11, (0,)),
        (12, (0,)),
        (13, (0,)),
    ]
    assert hung == ["decode-a", "decode-a"] and 0.15 < waited < 0.4  # half the deadline on the hung shard, once
    assert [r.request_id for r in shards[1].asked] == [1, 3] and asked_1 == [[11], [21]]  # then left out each time


def test_a_router_shard_that_cannot_decide_yet_is_left_to_the_others_and_a_lone_router_falls_back():
    async def scenario():
        ready, starting = FakeRouter(deflect_to("decode-a")), FakeRouter(deflect_to("decode-b"))
        starting.decide_many = Remote(
            lambda requests: [RoutingReply.fallback_for("1 prefill and 0 decode")] * len(requests)
        )
        shards = RouterShards([ready, starting], timeout_s=5.0)  # type: ignore[list-item]
        both = [(await shards.decide(DecisionRequest(i, 100, 4), 5.0)).decision.decode_node for i in range(4)]
        counted: list[int] = []
        alone = RouterShards([starting], timeout_s=5.0, left_out=counted.append)  # type: ignore[list-item]
        fell_back = (await alone.decide(DecisionRequest(9, 100, 4), 5.0)).fallback
        starting.decide_many = Remote(lambda requests: 1 / 0)  # the lone router fails: its caller falls back
        with pytest.raises(ZeroDivisionError):
            await alone.decide(DecisionRequest(10, 100, 4), 5.0)
        return both, fell_back, shards.live(), counted

    both, fell_back, live, counted = run(scenario)
    assert both == ["decode-a"] * 4 and live == (0,)  # the new shard is asked again after SHARD_DOWN_S
    assert fell_back  # one router that cannot decide: plain disaggregation, as before
    assert counted == []  # and one router is never counted as a shard left out
