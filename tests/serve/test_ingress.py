"""The ingress's response shapes, without Serve: OpenAI bodies, server-sent events and the route report.

Logprobs are checked against vLLM's own server code for the same engine
output. The whole ingress under real Serve and HTTP clients is in
``test_app.py``; against vLLM's server, in ``test_vllm_app.py``.
"""

import asyncio
import dataclasses
import functools
import json
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.entrypoints.generate.base.serving import GenerateBaseServing
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.logprobs import Logprob

from kairos_ray.core import Route
from kairos_ray.messages import TokenEvent, TokenLogprob, TTFTBreakdown
from kairos_ray.serve import ingress
from kairos_ray.serve.auth import ApiKeys
from kairos_ray.serve.dispatch import RouteTaken
from kairos_ray.serve.protocol import LIST_CAPS, PreparedRequest, RequestError
from kairos_ray.serve.responses import Exposure, ResponseWriter, route_headers
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
    request = asyncio.run(Preprocessor("m", 32_768).prepare({**base, **body}, chat))
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


def test_echo_token_ids_and_the_clients_request_id_shape_the_body():
    body = ResponseWriter("m", DEFLECTED, prepared({"prompt": "one two", "echo": True}), Exposure.FULL).full(tokens(2))
    assert body["choices"][0]["text"] == "one two t0 t1"
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
        request = asyncio.run(EMULATED.prepare(ingress._parse(content), chat))
    except RequestError as refused:
        assert 400 <= refused.status < 500 and refused.message, refused
    else:
        assert request.prompt_tokens >= 1 and request.max_tokens >= 1
