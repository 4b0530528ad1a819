"""The load generator's accounting of tokens that come several to an event, and its reading of a stream."""

import asyncio
import itertools
import json

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from kairos_ray.bench.loadgen import (
    PROMPT_BASE,
    PROMPT_IDS,
    BenchResult,
    Conversations,
    _tokens_per_event,
    prompt_ids,
    replay,
    sse_lines,
    token_gaps,
)
from kairos_ray.workloads import Request, Workload
from kairos_ray.workloads.multiturn import multiturn


def test_tokens_of_one_event_share_its_arrival():
    # events at 0.0 (2 tokens), 0.1 (1 token), 0.4 (3 tokens)
    gaps = token_gaps([0.0, 0.1, 0.4], [2, 1, 3])
    assert gaps == pytest.approx([0.0, 0.1, 0.3, 0.0, 0.0])
    assert len(gaps) == 2 + 1 + 3 - 1 and gaps.max() == pytest.approx(0.3)  # the largest gap is the stall


def test_usage_counts_tokens_per_event_and_without_it_the_rest_is_spread():
    assert _tokens_per_event([2, 1, 3], 6) == [2, 1, 3]  # continuous usage: exact
    assert _tokens_per_event([1, 1, 1], None) == [1, 1, 1]  # no usage at all: one per event
    assert _tokens_per_event([1, 1, 1, 1], 11) == [3, 3, 3, 2]  # only the closing usage: 11 over 4 events


def test_a_replay_that_falls_behind_says_so():
    result = BenchResult([], [], 10.0, achieved_rps=3.95, scheduled_rps=4.0)
    assert not result.behind
    assert BenchResult([], [], 10.0, achieved_rps=3.8, scheduled_rps=4.0).behind
    assert np.isnan(BenchResult([], [], 1.0).achieved_rps)


def test_no_two_requests_prompts_begin_alike():
    """A server's prefix cache must not hit across the requests of a run: their first two ids differ."""
    heads = {tuple(prompt_ids(rid, 2)) for rid in range(3 * PROMPT_IDS)}
    assert len(heads) == 3 * PROMPT_IDS
    prompt = prompt_ids(7, 1200)
    assert len(prompt) == 1200 and all(PROMPT_BASE <= t < PROMPT_BASE + PROMPT_IDS for t in prompt)
    assert prompt_ids(7, 1) == [PROMPT_BASE + 7]


def test_a_conversation_s_next_turn_holds_the_last_turn_s_prompt_and_the_answer_the_server_gave():
    workload = multiturn(rps=1.0, num_requests=300, seed=3)
    talks = Conversations(workload.block_tokens)
    requests = workload.requests
    # two turns of one conversation: the later one's blocks begin with all of the earlier one's
    first, second = next(
        (a, b)
        for i, a in enumerate(requests)
        for b in requests[i + 1 :]
        if len(a.block_hashes) > 64 and b.block_hashes[: len(a.block_hashes)] == a.block_hashes
    )
    other = next(r for r in requests if r.block_hashes[64:65] != first.block_hashes[64:65])
    prompt = talks.prompt(0, first)
    assert len(prompt) == first.prompt_tokens and all(PROMPT_BASE <= t < PROMPT_BASE + PROMPT_IDS for t in prompt)
    assert talks.prompt(1, other)[:1024] == prompt[:1024]  # the shared system prompt, token for token
    assert talks.prompt(1, other)[1024:1040] != prompt[1024:1040]  # then each conversation its own
    answer = [7] * first.output_tokens  # what the server generated
    before = talks.prompt(1, second)
    talks.answered(first, prompt + answer)
    history = prompt + answer
    full = len(history) // workload.block_tokens * workload.block_tokens
    after = talks.prompt(1, second)
    assert after[:full] == history[:full] != before[:full]  # the answer's blocks as the server sent them
    assert len(after) == second.prompt_tokens


def test_streamed_lines_come_whole_however_the_body_is_cut():
    """``sse_lines`` against a real HTTP server that writes its body in odd pieces: every line whole, ``\\r\\n``
    endings stripped, a line of 800 kB (past aiohttp's own line limit) and a last line without an ending."""
    long = "data: " + "7," * 400_000
    lines = ['data: {"a": 1}', "", ": a comment", long, "data: é€", "data: [DONE]"]
    body = "\r\n".join(lines).encode()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        # cut inside a line, between a \r and its \n, inside the long line and inside a character
        cuts = [0, 6, body.index(b"\r\n") + 1, 100_000, body.index("é".encode()) + 1, len(body)]
        for at, end in itertools.pairwise(cuts):
            await response.write(body[at:end])  # each piece a write of its own
        return response

    async def read() -> list[str]:
        app = web.Application()
        app.router.add_get("/", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as client, client.get(f"http://127.0.0.1:{port}/") as response:
                return [line async for line in sse_lines(response.content)]
        finally:
            await runner.cleanup()

    assert asyncio.run(read()) == lines


def shedding_server(sheds: int):
    """An OpenAI-like completions endpoint that sheds each request's first ``sheds`` tries (429, Retry-After 0,
    x-kairos-shed) and streams 2 tokens after, answers a 429 of its own (no x-kairos-shed) to priority -1, and
    counts the tries per prompt."""
    tries: dict[int, int] = {}

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = body["prompt"][0]
        tries[rid] = tries.get(rid, 0) + 1
        if body.get("priority") == -1:
            return web.json_response({"error": {"message": "server busy"}}, status=429, headers={"Retry-After": "0"})
        if tries[rid] <= sheds:
            headers = {"Retry-After": "0", "x-kairos-shed": "no-route-in-time"}
            return web.json_response({"error": {"message": "shed"}}, status=429, headers=headers)
        response = web.StreamResponse(headers={"x-kairos-route": "deflect"})
        await response.prepare(request)
        for n in (1, 2):
            event = {"choices": [{"text": "x"}], "usage": {"completion_tokens": n}}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app, tries


@pytest.mark.parametrize("retries", [0, 1, 3])
def test_a_shed_request_is_recorded_as_shed_or_sent_again_after_its_retry_after(retries):
    sheds = 2
    workload = Workload("test", tuple(Request(0.01 * i, 4, 2, priority=-1 if i == 3 else 0) for i in range(4)))

    async def bench() -> tuple[BenchResult, dict[int, int]]:
        app, tries = shedding_server(sheds)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            return await replay(f"http://127.0.0.1:{runner.addresses[0][1]}", "m", workload, 30, None, retries), tries
        finally:
            await runner.cleanup()

    result, tries = asyncio.run(bench())
    served = [r for r in result.records if not r.shed]
    shed = [r for r in result.records if r.shed]
    assert len(result.failures) == 1 and "HTTP 429" in result.failures[0]  # a refusal that is not admission's
    if retries < sheds:
        assert not served and [r.shed_reason for r in shed] == ["no-route-in-time"] * 3
        assert all(0 < r.shed_answer_s < 10 for r in shed)  # how long its 429 took
    else:
        assert not shed and [r.output_tokens for r in served] == [2, 2, 2]
    assert sorted(tries.values()) == [1] + [min(retries, sheds) + 1] * 3  # each sent once, then once per retry
