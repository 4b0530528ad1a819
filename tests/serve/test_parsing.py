"""Tool calling in process: the ingress's ``Preprocessor`` and ``ResponseWriter`` on the shipped tiny model's
tokenizer with vLLM's ``pythonic`` tool-call parser, fed a known answer (the tiny model's own text is random). The
app against vLLM's own server with the same parser: ``test_vllm_app.py``."""

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from kairos_ray.messages import TokenEvent
from kairos_ray.serve.args import AppArgs
from kairos_ray.serve.protocol import LIST_CAPS, MAX_ITEM_CHARS, RequestError
from kairos_ray.serve.responses import Exposure, ResponseWriter, batch_body, reasoning_tokens
from kairos_ray.serve.responses_api import ResponsesWriter
from kairos_ray.serve.tokens import Preprocessor
from tests.serve.conftest import CPU_CONTEXT, CPU_MODEL, TOOL_CALLING, cpu_args
from tests.serve.test_ingress import DEFLECTED, events

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
ASK = {"messages": [{"role": "user", "content": "weather in paris?"}], "tools": TOOLS, "max_completion_tokens": 40}
CALL = '[get_weather(city="Paris")]'
TWO_CALLS = '[get_weather(city="Paris"), get_time()]'
PYTHONIC = TOOL_CALLING


def pool_with(engine_kwargs: dict) -> dict:
    """The CPU app's arguments, its decode pool's ``engine_kwargs`` without tool calling, then ``engine_kwargs``."""
    args = cpu_args()
    kept = {k: v for k, v in args["decode_config"]["engine_kwargs"].items() if k not in TOOL_CALLING}
    args["decode_config"]["engine_kwargs"] = {**kept, **engine_kwargs}
    return args


@pytest.fixture(scope="module")
def preprocessor() -> Preprocessor:
    """As the vLLM CPU app's ingress makes it with the pythonic parser in its decode pool's ``engine_kwargs``."""
    pool = AppArgs.model_validate(pool_with(PYTHONIC)).decode_config
    assert "tool_call_parser" not in pool.vllm_engine_kwargs()  # the ingress's, not the engines'
    return Preprocessor(
        CPU_MODEL, CPU_CONTEXT, pool.model_loading_config.source, pool.vllm_engine_kwargs(), pool.output_parsing()
    )


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(AppArgs.model_validate(cpu_args()).decode_config.model_loading_config.source)


def answer(tokenizer, text: str, finish_reason: str = "stop") -> list[TokenEvent]:
    """``text`` as a decode node streams it: a token at a time, each with the text it adds."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    added = [piece[len(before) :] for before, piece in zip(["", *pieces], pieces, strict=False)]
    last = len(ids) - 1
    return [
        TokenEvent(t, i, i == last, "decode-a", added[i], finish_reason if i == last else None)
        for i, t in enumerate(ids)
    ]


def prepare(preprocessor, body: dict):
    (prepared,) = asyncio.run(preprocessor.prepare(body, chat=True))
    return prepared


def full(preprocessor, tokenizer, body: dict, text: str) -> dict:
    request = prepare(preprocessor, body)
    return ResponseWriter(CPU_MODEL, DEFLECTED, request, Exposure.NONE).full(answer(tokenizer, text))["choices"][0]


def streamed(preprocessor, tokenizer, body: dict, text: str) -> list[dict]:
    writer = ResponseWriter(CPU_MODEL, DEFLECTED, prepare(preprocessor, {**body, "stream": True}), Exposure.NONE)
    out = [writer.tokens([event]) for event in answer(tokenizer, text)]
    return [chunk["choices"][0] for chunk in events([line for line in out if line])]


def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]


def test_a_tool_call_in_the_answer_is_a_tool_call_with_finish_reason_tool_calls(preprocessor, tokenizer):
    choice = full(preprocessor, tokenizer, {**ASK, "tool_choice": "auto"}, CALL)
    assert calls_of(choice["message"]) == [("get_weather", {"city": "Paris"})]
    assert choice["message"]["tool_calls"][0]["id"] and choice["message"]["tool_calls"][0]["type"] == "function"
    assert not choice["message"]["content"] and choice["finish_reason"] == "tool_calls"


def test_plain_text_stays_content_and_tool_choice_none_never_parses(preprocessor, tokenizer):
    choice = full(preprocessor, tokenizer, {**ASK, "tool_choice": "auto"}, "it is sunny")
    assert choice["message"]["content"] == "it is sunny" and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    untouched = full(preprocessor, tokenizer, {**ASK, "tool_choice": "none"}, CALL)
    assert untouched["message"]["content"] == CALL and untouched["finish_reason"] == "stop"


def test_parallel_tool_calls_false_keeps_the_first_call(preprocessor, tokenizer):
    both = full(preprocessor, tokenizer, {**ASK, "tool_choice": "auto"}, TWO_CALLS)
    assert [name for name, _ in calls_of(both["message"])] == ["get_weather", "get_time"]
    first = full(preprocessor, tokenizer, {**ASK, "tool_choice": "auto", "parallel_tool_calls": False}, TWO_CALLS)
    assert calls_of(first["message"]) == [("get_weather", {"city": "Paris"})]


def test_a_named_tool_is_forced_by_its_schema_and_its_answer_is_that_call(preprocessor, tokenizer):
    named = {**ASK, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    request = prepare(preprocessor, named)
    assert request.sampling.structured_outputs is not None  # the engines generate the function's arguments' JSON
    choice = full(preprocessor, tokenizer, named, '{"city": "Paris"}')
    assert calls_of(choice["message"]) == [("get_weather", {"city": "Paris"})]
    assert choice["finish_reason"] == "stop"  # OpenAI's for a named tool


def test_a_streamed_tool_call_comes_as_tool_call_deltas_and_ends_with_tool_calls(preprocessor, tokenizer):
    chunks = streamed(preprocessor, tokenizer, {**ASK, "tool_choice": "auto"}, CALL)
    assert chunks[0]["delta"]["role"] == "assistant"
    deltas = [call for chunk in chunks for call in chunk["delta"].get("tool_calls", [])]
    assert deltas and {d["index"] for d in deltas} == {0}
    name = "".join(d["function"].get("name") or "" for d in deltas)
    arguments = "".join(d["function"].get("arguments") or "" for d in deltas)
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris"}
    assert not any(chunk["delta"].get("content") for chunk in chunks)  # the call's text is not also content
    assert chunks[-1]["finish_reason"] == "tool_calls"
    plain = streamed(preprocessor, tokenizer, {**ASK, "tool_choice": "auto"}, "it is sunny")
    assert "".join(c["delta"].get("content") or "" for c in plain) == "it is sunny"
    assert plain[-1]["finish_reason"] == "stop"


def test_auto_tool_choice_without_a_parser_is_refused_as_vllm_refuses_it(tokenizer):
    pool = AppArgs.model_validate(pool_with({})).decode_config
    bare = Preprocessor(CPU_MODEL, CPU_CONTEXT, pool.model_loading_config.source, pool.vllm_engine_kwargs())
    with pytest.raises(RequestError) as refused:
        prepare(bare, {**ASK, "tool_choice": "auto"})
    assert refused.value.status == 400 and "--tool-call-parser" in refused.value.message
    assert prepare(bare, {**ASK, "tool_choice": "none"}).options.parsing is None  # no parser: text, as before


def test_reasoning_is_split_out_and_counted(tokenizer):
    """A reasoning parser (an engine argument) splits ``<think>`` text out of the content, counts its tokens in
    usage, and with ``include_reasoning: false`` hides it."""
    pool = AppArgs.model_validate(pool_with({"reasoning_parser": "qwen3"})).decode_config
    assert pool.vllm_engine_kwargs()["reasoning_parser"] == "qwen3"  # the engines' too
    thinker = Preprocessor(CPU_MODEL, CPU_CONTEXT, pool.model_loading_config.source, pool.vllm_engine_kwargs())
    text = "<think>cold front</think>sunny"
    body = ASK | {"tools": None}
    request = prepare(thinker, body)
    whole = ResponseWriter(CPU_MODEL, DEFLECTED, request, Exposure.NONE).full(answer(tokenizer, text))
    assert whole["choices"][0]["message"]["reasoning"] == "cold front"
    assert whole["choices"][0]["message"]["content"] == "sunny"
    assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    hidden = prepare(thinker, {**body, "include_reasoning": False, "logprobs": True})
    quiet = ResponseWriter(CPU_MODEL, DEFLECTED, hidden, Exposure.NONE).full(answer(tokenizer, text))["choices"][0]
    assert quiet["message"]["reasoning"] is None and quiet["logprobs"] is None
    writer = ResponseWriter(CPU_MODEL, DEFLECTED, prepare(thinker, {**body, "stream": True}), Exposure.NONE)
    sent = [writer.tokens([token]) for token in answer(tokenizer, text)]
    chunks = [c["choices"][0] for c in events([event for event in sent if event])]
    assert "".join(c["delta"].get("reasoning") or "" for c in chunks) == "cold front"
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "sunny"
    thought = whole["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert reasoning_tokens([writer]) == thought
    twice = batch_body([whole, whole], prompt_tokens=whole["usage"]["prompt_tokens"])  # n = 2: both choices count
    assert twice["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2 * thought


@pytest.mark.parametrize(
    "engine_kwargs, where, message",
    [
        ({"tool_call_parser": "no-such"}, "decode_config", r"tool_call_parser 'no-such': vLLM knows .*pythonic"),
        ({"reasoning_parser": "no-such"}, "decode_config", r"reasoning_parser 'no-such'"),
        ({"reasoning_parser": "deepseek_r1"}, "decode_config", r"deepseek_r1 cannot be used with the tokenizer"),
        ({"enable_auto_tool_choice": True}, "decode_config", r"enable_auto_tool_choice needs .*tool_call_parser"),
        (PYTHONIC, "prefill_config", r"tool calling is the decode pool's"),
    ],
)
def test_tool_calling_arguments_are_checked_when_the_app_is_built(engine_kwargs, where, message):
    args = pool_with({})
    args[where]["engine_kwargs"] = {**args[where]["engine_kwargs"], **engine_kwargs}
    with pytest.raises(ValueError, match=message):
        AppArgs.model_validate(args)


def test_the_same_tool_calling_on_both_pools_is_accepted():
    args = pool_with(PYTHONIC)
    args["prefill_config"]["engine_kwargs"] = {**args["prefill_config"]["engine_kwargs"], **PYTHONIC}
    prefill = AppArgs.model_validate(args).prefill_config
    assert prefill.output_parsing() == PYTHONIC and "tool_call_parser" not in prefill.vllm_engine_kwargs()


RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}


def responded(preprocessor, tokenizer, body: dict, text: str, finish: str = "stop") -> tuple[dict, list[dict]]:
    """(``/v1/responses``'s whole response to ``body`` answered with ``text``, its stream's events, a token at a
    time)."""
    (whole,) = asyncio.run(preprocessor.prepare_responses({"model": CPU_MODEL, **body}))
    (streaming,) = asyncio.run(preprocessor.prepare_responses({"model": CPU_MODEL, **body, "stream": True}))
    writer = ResponsesWriter(CPU_MODEL, DEFLECTED, streaming, Exposure.NONE)
    stream = "".join(writer.tokens([token]) for token in answer(tokenizer, text, finish)) + writer.done()
    parts = stream.split("\n\n")
    assert parts[-1] == "" and all(p.startswith("event: ") for p in parts[:-1])  # no [DONE]: the last is completed
    kinds = [p.split("\n")[0][7:] for p in parts[:-1]]
    sent = [json.loads(p.split("\n")[1][6:]) for p in parts[:-1]]
    assert [e["type"] for e in sent] == kinds and [e["sequence_number"] for e in sent] == list(range(len(sent)))
    return ResponsesWriter(CPU_MODEL, DEFLECTED, whole, Exposure.NONE).full(answer(tokenizer, text, finish)), sent


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def test_a_responses_answer_is_a_message_whole_or_streamed_with_vllms_events(preprocessor, tokenizer):
    body = {"instructions": "be brief", "input": "weather in paris?", "max_output_tokens": 5}
    response, sent = responded(preprocessor, tokenizer, body, "it is sunny")
    assert response["object"] == "response" and response["instructions"] == "be brief"
    assert response["status"] == "completed" and response["max_output_tokens"] == 5
    (message,) = response["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "it is sunny"
    usage = response["usage"]
    assert usage["output_tokens"] == 3 and usage["total_tokens"] == usage["input_tokens"] + 3
    kinds = [e["type"] for e in sent]
    opening = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    closing = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds == [*opening, *["response.output_text.delta"] * 3, *closing, "response.completed"]
    assert "".join(e["delta"] for e in sent if e["type"] == "response.output_text.delta") == "it is sunny"
    completed = sent[-1]["response"]
    assert without_ids(completed["output"]) == without_ids(response["output"])
    assert completed["usage"] == usage and sent[0]["response"]["status"] == "in_progress"
    cut, sent = responded(preprocessor, tokenizer, body, "it is sunny", finish="length")  # out of tokens
    for answered in (cut, sent[-1]["response"]):
        assert answered["status"] == "incomplete" and answered["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_function_call_in_a_responses_answer_is_a_function_call_item(preprocessor, tokenizer):
    body = {"input": "weather in paris?", "tools": [RESPONSES_TOOL], "tool_choice": "auto"}
    response, sent = responded(preprocessor, tokenizer, body, CALL)
    (call,) = response["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert without_ids(sent[-1]["response"]["output"]) == without_ids(response["output"])
    assert "response.function_call_arguments.done" in [e["type"] for e in sent]


@pytest.mark.parametrize(
    "field, value",
    [
        ("background", True),
        ("previous_response_id", "resp_1"),
        ("tools", [{"type": "web_search_preview"}]),
        ("include", ["message.output_text.logprobs"]),
    ],
)
def test_what_responses_cannot_serve_is_a_400_naming_it(preprocessor, field, value):
    with pytest.raises(RequestError) as refused:
        asyncio.run(preprocessor.prepare_responses({"model": CPU_MODEL, "input": "hi", field: value}))
    assert refused.value.status == 400 and refused.value.param == field
    with pytest.raises(RequestError) as emulated:
        asyncio.run(Preprocessor(CPU_MODEL, CPU_CONTEXT).prepare_responses({"model": CPU_MODEL, "input": "hi"}))
    assert emulated.value.status == 501


@pytest.mark.parametrize(
    "field, value",
    [
        ("input", [{"role": "user", "content": "hi"}] * (LIST_CAPS["input"] + 1)),
        ("stop", ["x" * (MAX_ITEM_CHARS + 1)]),
        ("stop_token_ids", [5] * (LIST_CAPS["stop_token_ids"] + 1)),  # in the vocabulary: only the cap refuses it
    ],
)
def test_responses_lists_are_capped_as_on_the_other_endpoints(preprocessor, field, value):
    with pytest.raises(RequestError) as capped:
        asyncio.run(preprocessor.prepare_responses({"model": CPU_MODEL, "input": "hi", field: value}))
    assert capped.value.status == 400 and capped.value.param == field
