"""The ingress's response shapes, without Serve: OpenAI bodies, server-sent events and the route report.

Logprobs are checked against vLLM's own server code for the same engine
output. The whole ingress under real Serve and HTTP clients is in
``test_app.py``; against vLLM's server, in ``test_vllm_app.py``.
"""

import asyncio
import dataclasses
import functools
import json
import subprocess
import sys
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ray import cloudpickle
from vllm.entrypoints.generate.base.serving import GenerateBaseServing, clamp_prompt_logprobs
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.protocol import CompletionResponseChoice
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.logprobs import Logprob

from kairos_ray.core import Route
from kairos_ray.messages import TokenEvent, TokenLogprob, TTFTBreakdown
from kairos_ray.serve import ingress
from kairos_ray.serve.admission import Admission
from kairos_ray.serve.auth import ApiKeys
from kairos_ray.serve.dispatch import RouteTaken
from kairos_ray.serve.protocol import LIST_CAPS, PreparedRequest, RequestError
from kairos_ray.serve.responses import Exposure, ResponseWriter, batch_body, prompt_tokens, route_headers
from kairos_ray.serve.tokens import Preprocessor

from .bodies import BODIES
from .conftest import MODEL

DEFLECTED = RouteTaken(
    request_id=42,
    route=Route.DEFLECT,
    prefill_node=None,
    decode_node="decode-a",
    chunk_schedule=(1024, 512, 100),
    kv_transport="",
    reason="decode faster",
    fallback=False,
    ttft_s=0.3,
    breakdown=TTFTBreakdown(prefill_queue_s=0.1, prefill_exec_s=0.2),
)
HANDED_OFF = RouteTaken(
    request_id=43,
    route=Route.PREFILL,
    prefill_node="prefill-b",
    decode_node="decode-a",
    chunk_schedule=(),
    kv_transport="gloo",
    reason="fallback: TimeoutError",
    fallback=True,
    ttft_s=0.5,
    breakdown=TTFTBreakdown(0.1, 0.2, 0.15, 0.05),
)


def tokens(count: int) -> list[TokenEvent]:
    return [
        TokenEvent(100 + i, i, i == count - 1, "decode-a", f" t{i}", "stop" if i == count - 1 else None)
        for i in range(count)
    ]


def prepared(body: dict, chat: bool = False, prompt_tokens: int | None = None) -> PreparedRequest:
    """A request as the ingress prepares it for emulated engines (no model)."""
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} if chat else {"model": "m", "prompt": "x"}
    (request,) = asyncio.run(Preprocessor("m", 32_768).prepare({**base, **body}, chat))
    return request if prompt_tokens is None else dataclasses.replace(request, prompt_tokens=prompt_tokens)


def events(lines: list[str]) -> list[dict]:
    assert all(line.startswith("data: ") and line.endswith("\n\n") for line in lines)
    return [json.loads(line[6:]) for line in lines if line != "data: [DONE]\n\n"]


@pytest.mark.parametrize("route", [DEFLECTED, HANDED_OFF])
def test_headers_report_the_route_and_a_breakdown_that_adds_up(route):
    headers = route_headers(route, Exposure.FULL)
    parts = dict(item.split("=") for item in headers["x-kairos-breakdown"].split(";"))
    assert set(parts) == {"prefill_queue", "prefill_exec", "kv_transfer", "decode_queue"}
    assert sum(map(float, parts.values())) == pytest.approx(float(headers["x-kairos-ttft-s"]))
    assert headers["x-kairos-route"] == route.route.value
    assert headers["x-kairos-prefill-node"] == (route.prefill_node or "")
    assert headers["x-kairos-chunk-schedule"] == ",".join(map(str, route.chunk_schedule))
    assert headers["x-kairos-kv-transport"] == route.kv_transport
    assert headers["x-kairos-fallback"] == ("1" if route.fallback else "0")


def test_a_full_completion_body_counts_its_tokens_and_carries_the_route():
    body = ResponseWriter("m", DEFLECTED, prepared({}, prompt_tokens=1636), Exposure.FULL).full(tokens(3))
    assert body["id"] == "cmpl-42" and body["object"] == "text_completion" and body["model"] == "m"
    (choice,) = body["choices"]
    assert choice["text"] == " t0 t1 t2" and choice["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 1636, "completion_tokens": 3, "total_tokens": 1639}
    assert body["kairos"]["route"] == "deflect" and body["kairos"]["chunk_schedule"] == [1024, 512, 100]


def test_a_chat_stream_opens_with_the_role_and_the_route_and_closes_with_usage():
    writer = ResponseWriter("m", HANDED_OFF, prepared({"stream": True}, chat=True, prompt_tokens=7), Exposure.FULL)
    done = writer.done()
    assert done == "data: [DONE]\n\n"
    chunks = split(writer.tokens(tokens(3)) + writer.usage(3))
    assert all(c["id"] == "chatcmpl-43" and c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"content": " t0", "role": "assistant"}
    assert chunks[0]["kairos"]["prefill_node"] == "prefill-b" and "kairos" not in chunks[1]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "stop"]
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["completion_tokens"] == 3


def test_api_keys_come_from_the_config_the_environment_and_a_file(tmp_path, monkeypatch):
    keys_file = tmp_path / "keys"
    keys_file.write_text("sk-file\n\n")
    monkeypatch.setenv("KAIROS_TEST_KEYS", "sk-env-1, sk-env-2")
    keys = ApiKeys.gather(["sk-config"], "KAIROS_TEST_KEYS", str(keys_file))
    assert keys.required
    for key in ("sk-config", "sk-env-1", "sk-env-2", "sk-file"):
        assert keys.allows(f"Bearer {key}") and keys.allows(f"bearer {key}")
    for header in (None, "", "Bearer", "Bearer sk-other", "Basic sk-config", "sk-config"):
        assert not keys.allows(header)
    open_door = ApiKeys.gather([], "KAIROS_NO_SUCH_VARIABLE", None)
    assert not open_door.required and open_door.allows(None)
    with pytest.raises(ValueError, match="api_key_file 'nowhere' cannot be read"):
        ApiKeys.gather([], None, "nowhere")


def split(stream: str) -> list[dict]:
    """The data events of a chunk of server-sent events."""
    return events([event + "\n\n" for event in stream.split("\n\n")[:-1]])


def test_continuous_usage_counts_the_tokens_so_far_in_every_event():
    usage = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    writer = ResponseWriter("m", DEFLECTED, prepared(usage, prompt_tokens=10), Exposure.FULL)
    chunks = split(writer.tokens(tokens(3)))
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3]
    assert all(c["usage"]["prompt_tokens"] == 10 for c in chunks)
    plain = split(ResponseWriter("m", DEFLECTED, prepared({"stream": True}), Exposure.FULL).tokens(tokens(1)))
    assert "usage" not in plain[0]


# One generated position per token: (sampled id, {id: (decoded, logprob)}) with the sampled token's entry first.
POSITIONS = [
    (7, {7: ("Ġthe", -0.25), 9: ("Ġa", -1.5), 3: ("x", -2.0), 8: ("y", -float("inf"))}),
    (9, {9: ("é", -0.5), 7: ("Ġthe", -0.75), 4: ("z", -3.0), 5: ("w", -4.0)}),
    (4, {4: ("z", -3.25), 9: ("é", -0.5), 7: ("Ġthe", -0.75), 5: ("w", -4.0)}),
]


def logprob_tokens() -> list[TokenEvent]:
    return [
        TokenEvent(
            tid,
            i,
            i == len(POSITIONS) - 1,
            "decode-a",
            text=entries[tid][0],
            finish_reason="length" if i == len(POSITIONS) - 1 else None,
            logprobs=tuple(TokenLogprob(t, d, lp) for t, (d, lp) in entries.items()),
        )
        for i, (tid, entries) in enumerate(POSITIONS)
    ]


def vllm_logprobs(chat: bool, top: int, as_ids: bool = False) -> dict:
    """What vLLM's own server writes for ``POSITIONS``."""
    ids = [tid for tid, _ in POSITIONS]
    dicts = [{t: Logprob(lp, None, d) for t, (d, lp) in entries.items()} for _, entries in POSITIONS]
    server = types.SimpleNamespace(
        _get_decoded_token=GenerateBaseServing._get_decoded_token, return_tokens_as_token_ids=as_ids
    )
    if chat:
        server._get_top_logprobs = functools.partial(OpenAIServingChat._get_top_logprobs, server)
        made = OpenAIServingChat._create_chat_logprobs(server, ids, dicts, None, top)
    else:
        made = OpenAIServingCompletion._create_completion_logprobs(server, ids, dicts, top, None)
    return made.model_dump()


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("top, as_ids", [(0, False), (2, False), (-1, False), (1, True)])
def test_logprobs_are_written_as_vllms_server_writes_them_streamed_or_not(chat, top, as_ids):
    asked = {"logprobs": True, "top_logprobs": top} if chat else {"logprobs": top}
    asked["return_tokens_as_token_ids"] = as_ids
    expected = vllm_logprobs(chat, top, as_ids)
    full = ResponseWriter("m", DEFLECTED, prepared(asked, chat), Exposure.FULL).full(logprob_tokens())
    assert full["choices"][0]["logprobs"] == expected
    streamed = split(
        ResponseWriter("m", DEFLECTED, prepared({**asked, "stream": True}, chat), Exposure.FULL).tokens(
            logprob_tokens()
        )
    )
    parts = [c["choices"][0]["logprobs"] for c in streamed]
    if chat:
        assert [entry for part in parts for entry in part["content"]] == expected["content"]
    else:
        assert {key: [v for part in parts for v in part[key]] for key in expected} == expected


# A prompt's positions after its first, as vLLM computes them: (prompt token id, {id: (decoded, logprob, rank)}),
# the prompt token's entry first (then the likeliest ones).
PROMPT_IDS = [11, 7, 9]
PROMPT_POSITIONS = [
    {7: ("Ġthe", -1.25, 3), 9: ("Ġa", -0.5, 1), 4: ("z", -0.75, 2)},
    {9: ("Ġa", -0.125, 1), 8: ("y", -float("inf"), 900), 3: ("x", -4.0, 2)},
]
FIRST_TOKEN = "<s>"  # how the tokenizer decodes the prompt's first token


def prompt_entries() -> tuple[tuple[TokenLogprob, ...], ...]:
    return ((), *(tuple(TokenLogprob(t, d, lp, r) for t, (d, lp, r) in p.items()) for p in PROMPT_POSITIONS))


def vllm_prompt_dicts() -> list:
    return [None, *({t: Logprob(lp, r, d) for t, (d, lp, r) in p.items()} for p in PROMPT_POSITIONS)]


def with_prompt_logprobs(events: list[TokenEvent]) -> list[TokenEvent]:
    return [dataclasses.replace(events[0], prompt_logprobs=prompt_entries()), *events[1:]]


def echoing(body: dict, chat: bool = False) -> PreparedRequest:
    return dataclasses.replace(prepared({"prompt": PROMPT_IDS, **body}, chat), first_token=FIRST_TOKEN)


@pytest.mark.parametrize("top, alone", [(2, False), (0, False), (1, True)])
def test_echo_with_logprobs_shows_the_prompts_logprobs_first_as_vllms_server_streamed_or_not(top, alone):
    """The prompt's positions (its first without a logprob, decoded by the tokenizer), then the answer's; with
    max_tokens 0 the prompt's alone (the token generated is not shown)."""
    ids = [*PROMPT_IDS, *([] if alone else [tid for tid, _ in POSITIONS])]
    dicts = vllm_prompt_dicts()
    if not alone:
        dicts += [{t: Logprob(lp, None, d) for t, (d, lp) in entries.items()} for _, entries in POSITIONS]
    server = types.SimpleNamespace(
        _get_decoded_token=GenerateBaseServing._get_decoded_token, return_tokens_as_token_ids=False
    )
    tokenizer = types.SimpleNamespace(decode=lambda token_id: FIRST_TOKEN)
    expected = OpenAIServingCompletion._create_completion_logprobs(server, ids, dicts, top, tokenizer).model_dump()
    answer = logprob_tokens()[:1] if alone else logprob_tokens()
    asked = {"echo": True, "logprobs": top, "max_tokens": 0 if alone else 3}
    full = ResponseWriter("m", DEFLECTED, echoing(asked), Exposure.NONE).full(with_prompt_logprobs(answer))
    (choice,) = full["choices"]
    assert choice["logprobs"] == expected
    assert choice["text"] == "" if alone else choice["text"] == "".join(e.text for e in answer)
    vllms = CompletionResponseChoice(index=0, text="", prompt_logprobs=clamp_prompt_logprobs(vllm_prompt_dicts()))
    assert json.loads(json.dumps(choice["prompt_logprobs"])) == vllms.model_dump(mode="json")["prompt_logprobs"]
    writer = ResponseWriter("m", DEFLECTED, echoing({**asked, "stream": True}), Exposure.NONE)
    parts = [c["choices"][0]["logprobs"] for c in split(writer.tokens(with_prompt_logprobs(answer)))]
    assert {key: [v for part in parts for v in part[key]] for key in expected} == expected


def test_prompt_logprobs_go_where_vllms_server_puts_them_and_chat_echo_opens_with_the_last_message():
    """Completions: in the choice; chat: beside the choices; neither in a stream. Chat ``echo`` prepends the last
    message's content when the answer continues its role."""
    answer = with_prompt_logprobs(tokens(2))
    completion = ResponseWriter("m", DEFLECTED, echoing({"prompt_logprobs": 2}), Exposure.NONE).full(answer)
    assert len(completion["choices"][0]["prompt_logprobs"]) == 3 and "prompt_logprobs" not in completion
    chat = ResponseWriter("m", DEFLECTED, prepared({"prompt_logprobs": 2}, chat=True), Exposure.NONE).full(answer)
    assert chat["prompt_logprobs"][0] is None and chat["prompt_logprobs"][2][9]["rank"] == 1
    assert chat["prompt_logprobs"][2][8]["logprob"] == -9999.0  # -inf, as vLLM's server clamps it
    assert "prompt_logprobs" not in chat["choices"][0]
    plain = ResponseWriter("m", DEFLECTED, prepared({}, chat=True), Exposure.NONE).full(tokens(2))
    assert "prompt_logprobs" not in plain
    continued = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "A"}]},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "echo": True,
    }
    body = ResponseWriter("m", DEFLECTED, prepared(continued, chat=True), Exposure.NONE).full(answer)
    assert body["choices"][0]["message"]["content"] == "A t0 t1"
    writer = ResponseWriter("m", DEFLECTED, prepared({**continued, "stream": True}, chat=True), Exposure.NONE)
    streamed = split(writer.tokens(answer))
    assert "".join(c["choices"][0]["delta"]["content"] for c in streamed) == "A t0 t1"
    assert not any("prompt_logprobs" in c for c in streamed)
    other_role = {**continued, "add_generation_prompt": True, "continue_final_message": False}
    other_role["messages"] = [{"role": "user", "content": "hi"}]
    body = ResponseWriter("m", DEFLECTED, prepared(other_role, chat=True), Exposure.NONE).full(answer)
    assert body["choices"][0]["message"]["content"] == " t0 t1"


def test_echo_token_ids_and_the_clients_request_id_shape_the_body():
    body = ResponseWriter("m", DEFLECTED, prepared({"prompt": "one two", "echo": True}), Exposure.FULL).full(tokens(2))
    assert body["choices"][0]["text"] == "one two t0 t1"
    echoed = ResponseWriter("m", DEFLECTED, prepared({"prompt": [5, 6], "echo": True}), Exposure.FULL)
    first, *_ = split(echoed.tokens(tokens(2)))  # streamed, the prompt's ids come first, as vLLM's server sends them
    assert first["choices"][0]["prompt_token_ids"] == [5, 6]
    ids = ResponseWriter("m", DEFLECTED, prepared({"return_token_ids": True, "request_id": "abc"}), Exposure.FULL).full(
        tokens(2)
    )
    assert ids["id"] == "cmpl-abc" and ids["choices"][0]["token_ids"] == [100, 101]
    assert ids["choices"][0]["stop_reason"] is None and ids["choices"][0]["text"] == " t0 t1"
    chat = ResponseWriter("m", HANDED_OFF, prepared({"request_id": "mine"}, chat=True), Exposure.FULL).full(tokens(1))
    assert chat["id"] == "chatcmpl-mine" and chat["choices"][0]["message"]["role"] == "assistant"
    assert (
        ResponseWriter("m", HANDED_OFF, prepared({}, chat=True), Exposure.FULL).full(tokens(1))["id"] == "chatcmpl-43"
    )


def test_stream_interval_sends_the_tokens_that_come_together_in_one_event():
    grouped = split(
        ResponseWriter("m", DEFLECTED, prepared({"stream": True, "stream_interval": 4}), Exposure.FULL).tokens(
            tokens(3)
        )
    )
    assert len(grouped) == 1 and grouped[0]["choices"][0]["text"] == " t0 t1 t2"
    assert grouped[0]["choices"][0]["finish_reason"] == "stop"


def test_admin_keys_are_accepted_keys_and_an_open_app_makes_every_caller_its_admin(monkeypatch):
    monkeypatch.setenv("KAIROS_TEST_ADMIN", "sk-admin-env")
    keys = ApiKeys.gather(["sk-tenant"], None, None, ["sk-admin"], "KAIROS_TEST_ADMIN")
    assert all(keys.allows(f"Bearer {k}") for k in ("sk-tenant", "sk-admin", "sk-admin-env"))
    assert keys.admin("Bearer sk-admin") and keys.admin("Bearer sk-admin-env")
    assert not keys.admin("Bearer sk-tenant") and not keys.admin(None)
    assert ApiKeys.gather([], None, None).admin(None)


@pytest.mark.parametrize("route", [DEFLECTED, HANDED_OFF])
def test_what_a_response_shows_of_its_route_follows_its_exposure(route):
    cached = dataclasses.replace(route, cached_tokens=512)
    full, shown, hidden = (route_headers(cached, e) for e in (Exposure.FULL, Exposure.ROUTE, Exposure.NONE))
    assert full["x-kairos-cached-tokens"] == "512" and "x-kairos-cached-tokens" not in shown
    assert shown["x-kairos-decode-node"] == "decode-a" and set(shown) == set(full) - {"x-kairos-cached-tokens"}
    assert hidden == {}
    for exposure, field in ((Exposure.FULL, True), (Exposure.ROUTE, True), (Exposure.NONE, False)):
        writer = ResponseWriter("m", cached, prepared({"stream": True}), exposure)
        body, first = writer.full(tokens(2)), split(writer.tokens(tokens(1)))[0]
        assert ("kairos" in body) is field and ("kairos" in first) is field
        if field:
            assert ("cached_tokens" in body["kairos"]) is (exposure is Exposure.FULL)
            assert body["kairos"]["decode_node"] == "decode-a"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"stop": "x" * 1025}, "stop"),
        ({"bad_words": ["w"] * 257}, "bad_words"),
        ({"logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias"),
        ({"allowed_token_ids": list(range(16_385))}, "allowed_token_ids"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
    ],
)
def test_list_valued_fields_are_capped(body, param):
    with pytest.raises(RequestError) as refused:
        prepared(body)
    assert refused.value.status == 400 and refused.value.param == param
    within = {k: v[:8] if isinstance(v, list | str) else dict(list(v.items())[:8]) for k, v in body.items()}
    assert prepared(within).prompt_tokens == 1  # the same fields within their caps are served


def test_a_chat_with_too_many_messages_is_refused():
    messages = [{"role": "user", "content": "hi"}] * (LIST_CAPS["messages"] + 1)
    with pytest.raises(RequestError, match="messages: at most"):
        prepared({"messages": messages}, chat=True)


EMULATED = Preprocessor(MODEL, 128)  # as the fuzz app's ingress: emulated engines, a 128-token context


@settings(max_examples=1000, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODIES, chat=st.booleans(), raw=st.none() | st.binary(max_size=64))
def test_generated_bodies_are_prepared_or_refused_with_a_4xx_never_an_exception(body, chat, raw):
    """The ingress's own parsing of a thousand bodies, in process (over HTTP and the engines:
    ``test_faults.py``)."""
    content = raw if raw is not None else json.dumps(body).encode()
    try:
        prompts = asyncio.run(EMULATED.prepare(ingress._parse(content), chat))
    except RequestError as refused:
        assert 400 <= refused.status < 500 and refused.message, refused
    else:
        assert prompts and all(p.prompt_tokens >= 1 and p.max_tokens >= 1 for p in prompts)


def test_a_request_of_several_prompts_holds_a_place_for_each_and_gives_them_all_back():
    admission = Admission(4)
    slot, other = admission.try_acquire(), admission.try_acquire()
    assert slot is not None and other is not None
    assert not slot.widen(3) and admission.in_flight == 2  # no room: it holds what it held
    assert slot.widen(2) and admission.in_flight == 4 and admission.try_acquire() is None
    slot.release()
    slot.release()
    assert admission.in_flight == 1


def test_a_batch_body_lists_each_prompts_choice_with_its_route_and_sums_usage():
    prompts = [prepared({"prompt": "a b c", "max_tokens": 2}), prepared({"prompt": "d", "max_tokens": 1})]
    writers = [
        ResponseWriter(MODEL, route, p, Exposure.FULL, index, named_after=42)
        for index, (route, p) in enumerate(zip((DEFLECTED, HANDED_OFF), prompts, strict=True))
    ]
    bodies = [writers[0].full(tokens(2)), writers[1].full(tokens(1))]
    body = batch_body(bodies, prompt_tokens(writers))
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["id"] == bodies[0]["id"] == bodies[1]["id"]
    assert [c["kairos"]["route"] for c in body["choices"]] == ["deflect", "prefill"] and "kairos" not in body
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    streamed = writers[1].tokens(tokens(1))
    assert json.loads(streamed.removeprefix("data: "))["choices"][0]["index"] == 1


def test_a_prompts_samples_count_its_tokens_once():
    samples = asyncio.run(Preprocessor("m", 32_768).prepare({"model": "m", "prompt": "a b c", "n": 3}, False))
    writers = [ResponseWriter(MODEL, DEFLECTED, p, Exposure.FULL, i, named_after=7) for i, p in enumerate(samples)]
    assert len(writers) == 3 and prompt_tokens(writers) == samples[0].prompt_tokens > 0


async def _stream(items: list[str], closed: list[str], fail: bool = False, pause_s: float = 0.0):
    try:
        for item in items:
            await asyncio.sleep(pause_s)
            yield item
        if fail:
            raise RuntimeError("broken")
    finally:
        closed.append(items[0])


def test_interleaved_streams_give_every_item_in_each_streams_order():
    async def main():
        closed: list[str] = []
        streams = [_stream(["a1", "a2", "a3"], closed), _stream(["b1", "b2"], closed, pause_s=0.001)]
        items = [item async for item in ingress._interleaved(streams)]
        return items, closed

    items, closed = asyncio.run(main())
    assert sorted(items) == ["a1", "a2", "a3", "b1", "b2"]
    assert [i for i in items if i[0] == "a"] == ["a1", "a2", "a3"] and [i for i in items if i[0] == "b"] == ["b1", "b2"]
    assert sorted(closed) == ["a1", "b1"]


def test_one_failing_stream_ends_the_others_and_is_raised():
    async def main():
        closed: list[str] = []
        slow = _stream(["s1", "s2", "s3"], closed, pause_s=30)  # would take a minute and a half
        events = ingress._interleaved([_stream(["f1"], closed, fail=True), slow])
        with pytest.raises(RuntimeError, match="broken"):
            async with asyncio.timeout(10):
                async for _ in events:
                    pass
        await events.aclose()
        return closed

    assert sorted(asyncio.run(main())) == ["f1", "s1"]  # the slow stream was closed, not waited for


def test_all_calls_give_their_results_in_order_and_the_first_failure_cancels_the_rest():
    async def main():
        cancelled = []

        async def slow():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append("slow")
                raise

        async def fails():
            await asyncio.sleep(0)
            raise ValueError("no")

        async def value(v):
            return v

        assert await ingress._all([value(1), value(2), value(3)]) == [1, 2, 3]
        with pytest.raises(ValueError):
            async with asyncio.timeout(10):
                await ingress._all([slow(), fails()])
        return cancelled

    assert asyncio.run(main()) == ["slow"]


def _names(code: types.CodeType) -> set[str]:
    """The global names a function's code (its comprehensions and inner functions included) may read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _methods(cls: type) -> dict[str, types.FunctionType]:
    """The functions of ``cls`` and of its bases from the ingress's module, by name."""
    return {
        f"{klass.__qualname__}.{name}": f
        for klass in cls.__mro__
        if klass.__module__ == ingress.__name__
        for name, f in vars(klass).items()
        if isinstance(f, types.FunctionType)
    }


tracker = cloudpickle.cloudpickle._DYNAMIC_CLASS_TRACKER_BY_ID  # the classes it made, by their pickles' ids


def _loaded_afresh(data: bytes) -> type:
    """Unpickle a class pickled by value as a replica does: cloudpickle hands back the class it pickled when it is
    loaded in the process that pickled it, so its record of the classes it made is set aside meanwhile."""
    made = tracker.copy()
    tracker.clear()
    try:
        return cloudpickle.loads(data)
    finally:
        tracker.clear()
        tracker.update(made)


def test_every_module_helper_the_ingress_calls_travels_with_its_pickled_class():
    """Serve ships the ingress class to its replicas pickled by value with the globals its methods read, as
    cloudpickle finds them: a helper it misses is a NameError at the first request that calls it."""
    cls = ingress.Ingress.func_or_class
    module = vars(ingress)
    wanted = {name: {g for g in _names(f.__code__) if g in module} for name, f in _methods(cls).items()}
    shipped = _loaded_afresh(cloudpickle.dumps(cls))
    assert shipped is not cls
    found = {name: set(f.__globals__) for name, f in _methods(shipped).items()}
    assert wanted.keys() == found.keys() and "Ingress._serve" in found
    missing = {name: sorted(names - found[name]) for name, names in wanted.items() if names - found[name]}
    assert not missing, f"not shipped with the ingress class: {missing}"


def test_n_samples_are_a_choice_each_seeded_as_vllms_engine_seeds_them():
    prompts = asyncio.run(EMULATED.prepare({"model": MODEL, "prompt": [[1, 2], [3]], "n": 3, "seed": 10}, False))
    assert [(p.prompt_token_ids, p.sample) for p in prompts] == [((1, 2), s) for s in range(3)] + [
        ((3,), s) for s in range(3)
    ]
    assert [p.sampling.seed for p in prompts] == [10, 11, 12] * 2 and {p.sampling.n for p in prompts} == {1}
    scored = asyncio.run(EMULATED.prepare({"model": MODEL, "prompt": [1, 2], "n": 3, "prompt_logprobs": 1}, False))
    # the first sample computes the prompt's logprobs (reading no cache); the others read its KV from the cache
    assert [(p.sampling.prompt_logprobs, p.sampling.skip_reading_prefix_cache) for p in scored] == [
        (1, True),
        (None, False),
        (None, False),
    ]
    unseeded = asyncio.run(EMULATED.prepare({"model": MODEL, "prompt": "a", "n": 2, "max_tokens": 1}, False))
    assert [p.sampling.seed for p in unseeded] == [None, None]
    with pytest.raises(RequestError) as refused:
        asyncio.run(EMULATED.prepare({"model": MODEL, "prompt": ["a"] * 22, "n": 3, "max_tokens": 1}, False))
    assert refused.value.param == "n" and "64 choices" in refused.value.message


class _Run:
    """A run whose first token comes when the test says so."""

    def __init__(self, started: list[int], index: int) -> None:
        self.started, self.index, self.go = started, index, asyncio.Event()
        self.route = dataclasses.replace(DEFLECTED, decode_node=f"decode-{index}")
        self.held_on: str | None = None

    async def start(self, held_on: str = ""):
        self.started.append(self.index)
        self.held_on = held_on
        await self.go.wait()
        computed = prompt_entries() if self.index == 0 else ()  # the first prompt's first sample's prompt logprobs
        return [TokenEvent(self.index, 0, False, self.route.decode_node, prompt_logprobs=computed)]


def test_a_prompts_other_samples_start_once_its_first_has_its_first_token():
    """So that a prefix-aware router finds the prompt's KV cached where the first sample built it: the router is
    told which decode node holds it. The other samples show the first's prompt logprobs."""
    prompts = asyncio.run(EMULATED.prepare({"model": MODEL, "prompt": [[1, 2], [3]], "n": 2, "max_tokens": 1}, False))

    async def main():
        started: list[int] = []
        runs = [_Run(started, i) for i in range(4)]
        task = asyncio.ensure_future(ingress._started(runs, prompts))
        for _ in range(5):
            await asyncio.sleep(0)
        assert sorted(started) == [0, 2]  # each prompt's first sample, at once
        runs[2].go.set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert sorted(started) == [0, 2, 3]
        for run in runs:
            run.go.set()
        return await task, started, runs

    firsts, started, runs = asyncio.run(main())
    assert [first.token_id for (first,) in firsts] == [0, 1, 2, 3] and sorted(started) == [0, 1, 2, 3]
    assert [first.prompt_logprobs for (first,) in firsts] == [prompt_entries()] * 2 + [()] * 2
    assert [run.held_on for run in runs] == ["", "decode-0", "", "decode-2"]


def test_an_ingress_replica_imports_no_scikit_learn():
    """An ingress replica imports ``serve.ingress``, vLLM's protocol with it (and through vLLM's config transformers'
    assisted generation, which imports scikit-learn when it is installed, as here for the fitter), and the router's
    actor class (Ray loads it for the handle's methods). None of it may load scikit-learn, which stays importable."""
    probe = (
        "import sys; import kairos_ray.serve.ingress, kairos_ray.serve.router; "
        "print('transformers.generation.candidate_generator' in sys.modules, "
        "sorted(m for m in sys.modules if m.split('.')[0] == 'sklearn')); "
        "import sklearn.metrics; print(sklearn.metrics.roc_curve.__name__)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == ["True []", "roc_curve"]
