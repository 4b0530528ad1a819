"""End to end on real vLLM CPU engines: ``serve_configs/2p2d-cpu.yaml`` under ``serve.run``, the openai client.

The shipped config decides with the Kairos policy; here the ``sl:<tokens>``
baseline routes instead, cache-blind (short prompts deflected in 128-token
chunks, long ones disaggregated), so that both routes are taken on purpose,
whatever this machine's speed and whatever the nodes' prefix caches hold. The
context is 1,024 tokens (engines and app), so that a request without
``max_tokens``, which runs to the end of the context, ends soon. One prefill
node serves (the tests send one request at a time, and each engine takes tens
of seconds to start); the two decode nodes stay, for a stream to move from one
to the other.

Beside the app runs vLLM's own OpenAI server on the same model and engine
arguments: the same requests to both must give the same answers, on both
routes (a list of prompts, each on its own route, too), every field of vLLM's
request models is honoured as there or refused with a 400, and ``/tokenize``,
``/detokenize`` and ``/version`` answer as there.
"""

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from ray import serve
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

from kairos_ray.bench import faults
from kairos_ray.bench.local import free_port
from kairos_ray.messages import Role
from kairos_ray.serve.args import AppArgs
from tests.serve.conftest import CONFIGS, CPU_CONTEXT, CPU_MODEL, cpu_args, use_policy, wait_for_no_residue

pytestmark = [pytest.mark.ray, pytest.mark.vllm]

MODEL = CPU_MODEL
SHORT, LONG = 120, 300  # prompt words: deflected (241 tokens, <= 400) and disaggregated (601 tokens)
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
# the app's tool-call parser is pythonic (``conftest.TOOL_CALLING``): an answer held to such a call is one
CALLING = {
    "tools": TOOLS,
    "tool_choice": "auto",
    "structured_outputs": {"choice": ['[lookup(key="owl")]']},
    "max_tokens": 48,  # the whole call, whatever other fields ask
}
CALLING_TWICE = {**CALLING, "structured_outputs": {"choice": ['[lookup(key="owl"), lookup(key="fox")]']}}
CONTEXT = CPU_CONTEXT
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wise",
    "owls",
    "count",
    "stars",
]


def prompt(words: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(words))


@pytest.fixture(scope="module")
def vllm_server_process(tmp_path_factory):
    """vLLM's OpenAI server (``tests/serve/vllm_server.py``) on the app's model and engine arguments, started
    before the app (``routes_fixed``) so that the two start side by side: (process, base URL, log file); stopped
    with the module.

    It prefills every prompt in one step: vLLM's CPU engine dies on a seeded
    request prefilled in several (the app's engines have that fixed,
    ``engines.vllm_worker``).
    """
    pool = AppArgs.model_validate(cpu_args()).decode_config
    flags = []
    for name, value in {**pool.engine_kwargs, "max_num_batched_tokens": CONTEXT}.items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    port = free_port()
    # at the niceness of Ray's workers, so that neither starves the other's engines on two cores
    command = ["nice", "-n", "15", sys.executable, "-m", "tests.serve.vllm_server", "--model",
               pool.model_loading_config.source, "--served-model-name", MODEL, "--host", "127.0.0.1",
               "--port", str(port), *flags]  # fmt: skip
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"}
    with log.open("w") as out:
        server = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=CONFIGS.parent
        )
    try:
        yield server, f"http://127.0.0.1:{port}", log
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(30)


@pytest.fixture(scope="module")
def vllm_server(vllm_server_process) -> str:
    """vLLM's OpenAI server (base URL), once it answers its health check."""
    server, url, log = vllm_server_process
    deadline = time.monotonic() + 600
    while True:
        assert server.poll() is None, f"vLLM's server exited: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"vLLM's server not up in 600 s: {log.read_text()[-3000:]}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return url
        time.sleep(1)


@pytest.fixture(scope="module", autouse=True)
def routes_fixed(vllm_server_process, cpu_app):
    """This module's tests need each prompt's route fixed by its length (``sl:400+blind``)."""
    use_policy("sl:400+blind")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(AppArgs.model_validate(cpu_args()).decode_config.model_loading_config.source)


def streamed(max_tokens: int) -> dict:
    """openai-client arguments of a greedy streamed request of exactly ``max_tokens`` tokens, usage included."""
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True},
    }


def stream_completion(url: str, text: str, max_tokens: int):
    """(headers, streamed texts, usage) of one streamed completion through the openai client."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300)
    with client.completions.with_streaming_response.create(prompt=text, **streamed(max_tokens)) as response:
        chunks = list(response.parse())
        headers = response.headers
    texts = [c.choices[0].text for c in chunks if c.choices]
    (usage,) = [c.usage for c in chunks if c.usage is not None]
    return headers, texts, usage


def test_streamed_completions_take_both_routes_with_correct_usage(cpu_app, tokenizer):
    url, _ = cpu_app
    for words, route in ((SHORT, "deflect"), (LONG, "prefill")):
        text = prompt(words)
        headers, texts, usage = stream_completion(url, text, max_tokens=12)
        assert headers["x-kairos-route"] == route
        assert len(texts) == 12  # one chunk per token
        assert usage.completion_tokens == 12
        assert usage.prompt_tokens == len(tokenizer.encode(text))
        if route == "deflect":
            schedule = [int(c) for c in headers["x-kairos-chunk-schedule"].split(",")]
            assert sum(schedule) == usage.prompt_tokens
        else:
            assert headers["x-kairos-prefill-node"].startswith("prefill-")
            assert headers["x-kairos-decode-node"].startswith("decode-")
            assert headers["x-kairos-kv-transport"] == "gloo"  # straight to the chosen decode node


def test_chat_streams_through_the_chat_template(cpu_app, tokenizer):
    url, _ = cpu_app
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300)
    messages = [{"role": "user", "content": prompt(30)}]
    chunks = list(client.chat.completions.create(messages=messages, **streamed(6)))
    # an event per token, but those the app's tool-call parser holds back (text that may open a call), as vLLM's
    # server streams them
    assert 1 <= sum(1 for c in chunks if c.choices) <= 6 and chunks[-2].choices[0].finish_reason == "length"
    (usage,) = [c.usage for c in chunks if c.usage is not None]
    assert usage.completion_tokens == 6
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert usage.prompt_tokens == len(expected if isinstance(expected, list) else expected["input_ids"])


def test_token_ids_outside_the_vocabulary_are_a_400(cpu_app):
    url, _ = cpu_app
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [5, 99_999], "max_tokens": 2}, timeout=60)
    assert r.status_code == 400
    assert "out of vocabulary" in r.json()["error"]["message"]  # vLLM's input processor's check


def test_decode_nodes_export_their_kv_recomputes(cpu_app):
    url, metrics_url = cpu_app
    stream_completion(url, prompt(LONG), max_tokens=2)  # a hand-off, received: nothing recomputed
    deadline, lines = time.monotonic() + 90, []
    while time.monotonic() < deadline and len(lines) < 2:
        text = httpx.get(metrics_url, timeout=10).text
        lines = [line for line in text.splitlines() if line.startswith("ray_kairos_kv_recomputes{")]
        time.sleep(2)
    assert len(lines) == 2 and all('node="decode-' in line for line in lines)  # one per decode node
    assert all(float(line.rsplit(" ", 1)[1]) == 0 for line in lines)


def greedy_text(url: str, text: str, max_tokens: int) -> str:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def decode_nodes() -> dict:
    states = serve.get_deployment_handle("Router", app_name="kairos").snapshot.remote().result()
    return {node: s for node, s in states.items() if s.role is Role.DECODE}


def disturbed_stream(url: str, text: str, max_tokens: int, fault) -> tuple[str, str, int]:
    """(streamed text, decode node faulted, tokens) of a greedy stream whose decode node gets ``fault`` at token 8."""
    body = {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    texts, node, done = [], None, False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert "error" not in event, event
                node = node or event["kairos"]["decode_node"]
                texts.append(event["choices"][0]["text"])
                if len(texts) == 8:
                    fault(node)
    assert done
    return "".join(texts), node, len(texts)


def wait_for_decode_nodes(count: int, timeout_s: float = 420.0) -> None:
    """Serve replaces a failed replica; its new engine takes a minute or two to start on 2 cores (the tests
    after a fault run meanwhile, on the other decode node)."""
    deadline = time.monotonic() + timeout_s
    while len(decode_nodes()) < count:
        assert time.monotonic() < deadline, f"{count} decode nodes not back within {timeout_s} s"
        time.sleep(2)


@pytest.fixture(scope="module")
def undisturbed(cpu_app) -> str:
    """A deflected prompt's greedy text on the app before any fault."""
    return greedy_text(cpu_app[0], prompt(SHORT), 48)


def fault_mid_stream(url: str, reference: str, signum: int) -> None:
    """A greedy stream whose decode node's engine core gets ``signum`` at token 8 moves to the other decode node
    with its text unchanged, and the failed node leaves the router's view. Serve replaces its replica while the
    next tests run (``test_both_faulted_decode_replicas_are_replaced_and_serve_as_before``)."""
    wait_for_decode_nodes(2)  # a node for the stream to move to
    stopped = []

    def inject(node: str) -> None:
        pid = faults.engine_pid("kairos", node)
        os.kill(pid, signum)
        stopped.append(pid)

    try:
        streamed, node, count = disturbed_stream(url, prompt(SHORT), 48, inject)  # deflected: on a decode node
        assert stopped and count == 48
        assert streamed == reference
        deadline = time.monotonic() + 15
        while node in decode_nodes():  # unhealthy: out of the view within a heartbeat or two
            assert time.monotonic() < deadline, f"{node} still in the router's view"
            time.sleep(0.2)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def test_a_decode_engine_core_that_dies_mid_stream_is_left_and_the_text_is_unchanged(cpu_app, undisturbed):
    """Greedy tokens: a stream migrated after its decode node's engine core was killed equals an undisturbed
    run's."""
    fault_mid_stream(cpu_app[0], undisturbed, signal.SIGKILL)


def answer(response: dict, chat: bool) -> dict:
    """What the comparisons read of a non-streamed response body."""
    (choice,) = response["choices"]
    return {
        "id": response["id"],
        "text": choice["message"]["content"] if chat else choice["text"],
        "tool_calls": calls_of(choice["message"]) if chat else [],
        "finish_reason": choice["finish_reason"],
        "stop_reason": choice.get("stop_reason"),
        "usage": {k: response["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
        "logprobs": choice["logprobs"],
        "token_ids": choice.get("token_ids"),
        "prompt_token_ids": response.get("prompt_token_ids") if chat else choice.get("prompt_token_ids"),
        "prompt_text": response.get("prompt_text"),
        "prompt_logprobs": response.get("prompt_logprobs") if chat else choice.get("prompt_logprobs"),
    }


def streamed_answer(events: list[dict], chat: bool) -> dict:
    """``answer`` for the data events of a stream: their texts, logprobs and token ids joined."""
    choices = [e["choices"][0] for e in events if e.get("choices")]
    logprobs: Any = None
    for choice in choices:
        part = choice.get("logprobs")
        if part is None:
            continue
        if chat:
            logprobs = {"content": (logprobs or {"content": []})["content"] + part["content"]}
        else:
            logprobs = {key: (logprobs or {}).get(key, []) + values for key, values in part.items()}
    token_ids = [t for c in choices for t in c.get("token_ids") or []] or None
    prompt_ids = next((p for p in (e.get("prompt_token_ids") for e in events) if p), None)
    if not chat:
        prompt_ids = next((c["prompt_token_ids"] for c in choices if c.get("prompt_token_ids")), None)
    (usage,) = [e["usage"] for e in events if e.get("usage") and not e.get("choices")] or [None]
    return {
        "id": events[0]["id"],
        "text": "".join((c["delta"].get("content") or "") if chat else c["text"] for c in choices),
        "tool_calls": streamed_calls(choices) if chat else [],
        "finish_reason": choices[-1]["finish_reason"],
        "stop_reason": choices[-1].get("stop_reason"),
        "usage": usage and {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
        "logprobs": logprobs,
        "token_ids": token_ids,
        "prompt_token_ids": prompt_ids,
        "prompt_text": next((e["prompt_text"] for e in events if e.get("prompt_text")), None),
        "events": len(choices),
        "usage_events": sum(1 for e in events if e.get("usage")),
        "prompt_logprobs": next((e["prompt_logprobs"] for e in events if e.get("prompt_logprobs")), None),
    }


def calls_of(message: dict) -> list[tuple[str, str]]:
    """A message's tool calls, (name, arguments) each (their ids are random)."""
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]


def streamed_calls(choices: list[dict]) -> list[tuple[str, str]]:
    """A stream's tool calls, (name, arguments) each, from its deltas' pieces in index order."""
    calls: dict[int, list[str]] = {}
    for choice in choices:
        for delta in choice["delta"].get("tool_calls") or []:
            name, arguments = calls.setdefault(delta["index"], ["", ""])
            function = delta.get("function") or {}
            calls[delta["index"]] = [name + (function.get("name") or ""), arguments + (function.get("arguments") or "")]
    return [(name, arguments) for _, (name, arguments) in sorted(calls.items())]


@dataclasses.dataclass
class Reply:
    status: int
    headers: httpx.Headers
    body: dict  # ``answer`` / ``streamed_answer``, or the error object


def ask(url: str, chat: bool, body: dict, stream: bool = False) -> Reply:
    """One request; streamed ones ask for usage (unless the body sets stream options itself)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL, **body}
    if not stream:
        r = httpx.post(f"{url}{path}", json=body, timeout=600)
        return Reply(r.status_code, r.headers, answer(r.json(), chat) if r.status_code == 200 else r.json())
    body = {"stream": True, "stream_options": {"include_usage": True}, **body}
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=600) as r:
        if r.status_code != 200:
            return Reply(r.status_code, r.headers, json.loads(r.read()))
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    assert not any("error" in e for e in events), events
    return Reply(200, r.headers, streamed_answer(events, chat))


LOGPROB_TOLERANCE = 1e-3  # float32 results of differently chunked prefills (deflected: the router's chunks)


def assert_prompt_logprobs_close(ours: list | None, theirs: list | None) -> None:
    """Per prompt position, the same token ids with the same ranks and decoded tokens, logprobs within the
    tolerance."""
    if ours is None or theirs is None:
        assert ours is theirs
        return
    assert len(ours) == len(theirs) and ours[0] is None and theirs[0] is None
    for mine, vllm in zip(ours[1:], theirs[1:], strict=True):
        assert {t: (e["rank"], e["decoded_token"]) for t, e in mine.items()} == {
            t: (e["rank"], e["decoded_token"]) for t, e in vllm.items()
        }
        assert {t: e["logprob"] for t, e in mine.items()} == pytest.approx(
            {t: e["logprob"] for t, e in vllm.items()}, abs=LOGPROB_TOLERANCE
        )


def assert_logprobs_close(ours: Any, theirs: Any) -> None:
    if ours is None or theirs is None:
        assert ours is theirs
        return
    if "content" in theirs:  # chat
        assert len(ours["content"]) == len(theirs["content"])
        for mine, vllm in zip(ours["content"], theirs["content"], strict=True):
            assert (mine["token"], mine["bytes"]) == (vllm["token"], vllm["bytes"])
            assert mine["logprob"] == pytest.approx(vllm["logprob"], abs=LOGPROB_TOLERANCE)
            assert [(t["token"], t["bytes"]) for t in mine["top_logprobs"]] == [
                (t["token"], t["bytes"]) for t in vllm["top_logprobs"]
            ]
            assert [t["logprob"] for t in mine["top_logprobs"]] == pytest.approx(
                [t["logprob"] for t in vllm["top_logprobs"]], abs=LOGPROB_TOLERANCE
            )
        return
    assert (ours["tokens"], ours["text_offset"]) == (theirs["tokens"], theirs["text_offset"])
    assert ours["token_logprobs"] == pytest.approx(theirs["token_logprobs"], abs=LOGPROB_TOLERANCE)
    for mine, vllm in zip(ours["top_logprobs"], theirs["top_logprobs"], strict=True):
        if vllm is None:  # an echoed prompt's first token
            assert mine is None
            continue
        assert mine.keys() == vllm.keys()
        assert mine == pytest.approx(vllm, abs=LOGPROB_TOLERANCE)


COMPARED = (
    "text",
    "tool_calls",
    "finish_reason",
    "stop_reason",
    "usage",
    "token_ids",
    "prompt_token_ids",
    "prompt_text",
)


def assert_same_answer(ours: Reply, theirs: Reply, keys: tuple[str, ...] = COMPARED) -> None:
    assert ours.status == theirs.status == 200, (ours.body, theirs.body)
    assert {k: ours.body[k] for k in keys} == {k: theirs.body[k] for k in keys}
    assert_logprobs_close(ours.body["logprobs"], theirs.body["logprobs"])
    assert_prompt_logprobs_close(ours.body["prompt_logprobs"], theirs.body["prompt_logprobs"])


def request_of(chat: bool, words: int, *fields: dict, **more: Any) -> dict:
    """A body for either endpoint with a prompt of ``words`` words (chat: one user message), fields merged in order."""
    body = {"messages": [{"role": "user", "content": prompt(words)}]} if chat else {"prompt": prompt(words)}
    for each in (*fields, more):
        body.update(each)
    return body


def words_only() -> list[int]:
    """The ids of the tokenizer's lower-case word tokens.

    The model's vocabulary (1,024) is larger than its tokenizer's (610): most
    tokens its random weights favour decode to nothing, so requests whose text
    must show an effect (stop strings) are kept to these tokens.
    """
    path = AppArgs.model_validate(cpu_args()).decode_config.model_loading_config.source
    vocab = json.loads((Path(path) / "tokenizer.json").read_text())["model"]["vocab"]
    return sorted(i for token, i in vocab.items() if re.fullmatch(r"Ġ?[a-z]{2,}", token))


WORDS_ONLY = {"allowed_token_ids": words_only()}

# a chat whose answer continues its last (assistant) message
CONTINUED = {
    "messages": [{"role": "user", "content": prompt(30)}, {"role": "assistant", "content": "the quick"}],
    "add_generation_prompt": False,
    "continue_final_message": True,
}


def ascii_stop(text: str) -> str:
    """Three letters from the middle of a greedy answer, a stop string that must end it early."""
    for start in range(len(text) // 3, len(text) - 3):
        if text[start : start + 3].isascii() and text[start : start + 3].isalpha():
            return text[start : start + 3]
    pytest.fail(f"no ascii stop string in {text!r}")


Case = Callable[[Callable[[dict], Reply]], dict]  # a case's extra fields, given a way to ask vLLM's server first

DIFFERENTIAL: dict[str, Case] = {
    "greedy": lambda ref: {"max_tokens": 24, "temperature": 0.0},
    "logprobs": lambda ref: {"max_tokens": 12, "temperature": 0.0, "logprobs": 3},
    "seeded": lambda ref: {"max_tokens": 24, "temperature": 0.8, "top_p": 0.95, "seed": 1234},
    "stop": lambda ref: {
        "max_tokens": 32,
        "temperature": 0.0,
        **WORDS_ONLY,
        "stop": [ascii_stop(ref({"max_tokens": 32, "temperature": 0.0, **WORDS_ONLY}).body["text"])],
    },
    "stop_token_ids": lambda ref: {
        "max_tokens": 24,
        "temperature": 0.0,
        "stop_token_ids": [ref({"max_tokens": 24, "temperature": 0.0, "return_token_ids": True}).body["token_ids"][6]],
    },
    "max_tokens omitted": lambda ref: {"temperature": 0.0},
    "json_object": lambda ref: {"max_tokens": 24, "temperature": 0.0, "response_format": {"type": "json_object"}},
}


TOOL_CASES: dict[str, dict] = {
    "auto": CALLING,
    "auto, two calls": CALLING_TWICE,
    "required": {"tools": TOOLS, "tool_choice": "required"},
    "named": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "lookup"}}},
}


@pytest.mark.parametrize("route, words", [("deflect", SHORT), ("prefill", LONG)])
@pytest.mark.parametrize("case", list(TOOL_CASES))
def test_tool_calls_equal_vllms_own_server_on_both_routes(cpu_app, vllm_server, case, route, words):
    """The app's tool-call parser (pythonic) splits the same calls out of the same answer as vLLM's server, with
    the same finish reason, streamed or not; a forced tool's arguments come from the schema it forces."""
    url, _ = cpu_app
    body = request_of(True, words, {"max_completion_tokens": 40, "temperature": 0.0}, TOOL_CASES[case])
    for stream in (False, True):
        ours, theirs = ask(url, True, body, stream), ask(vllm_server, True, body, stream)
        assert ours.headers["x-kairos-route"] == route
        assert_same_answer(ours, theirs)
        if case.startswith("auto"):
            assert [name for name, _ in ours.body["tool_calls"]] == ["lookup"] * (2 if "two" in case else 1)
            assert ours.body["finish_reason"] == "tool_calls" and not ours.body["text"]


@pytest.mark.parametrize("route, words", [("deflect", SHORT), ("prefill", LONG)])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("case", list(DIFFERENTIAL))
def test_answers_equal_vllms_own_server_on_both_routes(cpu_app, vllm_server, case, chat, route, words):
    """Same text, finish and stop reasons, usage and logprobs as vLLM's server, streamed or not."""
    url, _ = cpu_app

    def reference(fields: dict) -> Reply:
        return ask(vllm_server, chat, request_of(chat, words, **fields))

    fields = DIFFERENTIAL[case](reference)
    if chat and "logprobs" in fields:
        fields = {**fields, "logprobs": True, "top_logprobs": fields["logprobs"]}
    body = request_of(chat, words, **fields)
    for stream in (False, True):
        ours, theirs = ask(url, chat, body, stream), ask(vllm_server, chat, body, stream)
        assert ours.headers["x-kairos-route"] == route
        assert_same_answer(ours, theirs)
        if case == "stop":
            assert ours.body["finish_reason"] == "stop" and ours.body["stop_reason"] == fields["stop"][0]
        if case == "max_tokens omitted" and chat:  # to the end of the context (or an end of sequence)
            assert ours.body["finish_reason"] == "stop" or ours.body["usage"]["total_tokens"] == CONTEXT
        elif case == "max_tokens omitted":  # completions: 16, as vLLM's server
            assert ours.body["usage"]["completion_tokens"] == 16
        if case == "logprobs":
            assert ours.body["logprobs"] is not None


SCORING: dict[str, tuple[bool, dict]] = {  # (chat, the fields)
    "prompt_logprobs": (False, {"max_tokens": 6, "temperature": 0.0, "prompt_logprobs": 3}),
    "echo with logprobs": (False, {"max_tokens": 6, "temperature": 0.0, "echo": True, "logprobs": 2}),
    "echo, the prompt alone": (False, {"max_tokens": 0, "echo": True, "logprobs": 1}),
    "chat prompt_logprobs": (True, {"max_completion_tokens": 6, "temperature": 0.0, "prompt_logprobs": 2}),
    "chat echo": (True, {**CONTINUED, "max_completion_tokens": 6, "temperature": 0.0, "echo": True}),
}


@pytest.mark.parametrize("route, words", [("deflect", SHORT), ("prefill", LONG)])
@pytest.mark.parametrize("case", list(SCORING))
def test_prompt_logprobs_and_echo_answer_as_vllms_own_server_on_both_routes(cpu_app, vllm_server, case, route, words):
    """The prompt's logprobs, computed where the prompt is prefilled (the deflecting decode node, or the prefill
    node that hands the KV over): the same positions, ranks and decoded tokens as vLLM's server, logprobs within
    1e-3, in the same places (echoed before the answer's; a chat's echo opening with its last message), streamed
    or not; ``prompt_logprobs`` in a stream is the 400 vLLM's server answers."""
    url, _ = cpu_app
    chat, fields = SCORING[case]
    body = request_of(chat, words, fields)
    if "messages" in fields:  # the continued chat, its user message as long as the route needs
        body["messages"] = [{"role": "user", "content": prompt(words)}, fields["messages"][1]]
    for stream in (False, True):
        ours, theirs = ask(url, chat, body, stream), ask(vllm_server, chat, body, stream)
        if stream and "prompt_logprobs" in fields:
            assert ours.status == theirs.status == 400 and ours.body["error"]["param"] == "prompt_logprobs"
            continue
        assert ours.headers["x-kairos-route"] == route
        assert_same_answer(ours, theirs)
        if not stream:
            assert ours.body["prompt_logprobs"] is not None
        if "logprobs" in fields:  # echoed: every prompt position, then the answer's (none with max_tokens 0)
            answer = 0 if fields["max_tokens"] == 0 else ours.body["usage"]["completion_tokens"]
            assert len(ours.body["logprobs"]["tokens"]) == ours.body["usage"]["prompt_tokens"] + answer
        if chat:
            assert ours.body["text"].startswith("the quick") == ("echo" in fields)


def responded(url: str, body: dict, stream: bool) -> tuple[httpx.Response, dict]:
    """A ``/v1/responses`` answer, and what the comparison reads of it: the response object's keys, status,
    usage and output (items' types, roles, statuses and texts; their ids are random); streamed, also the events'
    types in order (each run of text deltas as one), the texts the deltas add up to, the sequence numbers."""
    body = {"model": MODEL, **body, "stream": stream}
    if not stream:
        r = httpx.post(f"{url}/v1/responses", json=body, timeout=600)
        return r, (_read_response(r.json()) if r.status_code == 200 else r.json())
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=600) as r:
        if r.status_code != 200:
            return r, json.loads(r.read())
        lines = list(r.iter_lines())
    kinds = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [e["type"] for e in events] == kinds and "[DONE]" not in lines
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    runs = [kind for i, kind in enumerate(kinds) if i == 0 or kind != kinds[i - 1] or not kind.endswith(".delta")]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = _read_response(events[-1]["response"])
    return r, {**final, "events": runs, "deltas": deltas}


def _read_response(response: dict) -> dict:
    items = [
        (item["type"], item.get("role"), item.get("status"), [part.get("text") for part in item.get("content") or []])
        for item in response["output"]
    ]
    usage = response["usage"] and {k: response["usage"][k] for k in ("input_tokens", "output_tokens", "total_tokens")}
    fields = ("status", "incomplete_details", "max_output_tokens", "temperature", "instructions", "tool_choice")
    return {"keys": sorted(response), "output": items, "usage": usage, **{k: response[k] for k in fields}}


RESPONSES: dict[str, Callable[[int], dict]] = {  # a body, given the prompt's words
    "text": lambda words: {"input": prompt(words), "max_output_tokens": 12, "temperature": 0.0},
    "instructions and messages": lambda words: {
        "instructions": "answer in one word",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": prompt(words)}]}],
        "max_output_tokens": 12,
        "temperature": 0.0,
    },
    "to an end of sequence": lambda words: {"input": prompt(words), "temperature": 0.0, "logit_bias": {"2": 100}},
}


@pytest.mark.parametrize("route, words", [("deflect", SHORT), ("prefill", LONG)])
@pytest.mark.parametrize("case", list(RESPONSES))
def test_responses_answer_as_vllms_own_server_on_both_routes(cpu_app, vllm_server, case, route, words):
    """``/v1/responses``: the same response object (its fields, status, usage and output) as vLLM's server,
    streamed or not, and the same events in the same order; what the app does not serve is a 400 naming it."""
    url, _ = cpu_app
    body = RESPONSES[case](words)
    for stream in (False, True):
        (mine, ours), (_, theirs) = responded(url, body, stream), responded(vllm_server, body, stream)
        assert mine.status_code == 200 and mine.headers["x-kairos-route"] == route, ours
        assert {k: v for k, v in ours.items() if k != "keys"} == {k: v for k, v in theirs.items() if k != "keys"}
        assert set(ours["keys"]) - {"kairos"} == set(theirs["keys"])
        if stream:
            assert ours["deltas"] == "".join(text for *_, texts in ours["output"] for text in texts)
    if case == "text":
        for refused in (
            {"background": True},
            {"previous_response_id": "resp_1"},
            {"tools": [{"type": "web_search_preview"}]},
        ):
            r = httpx.post(f"{url}/v1/responses", json={"model": MODEL, **body, **refused}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(refused)), r.text


def choices_of(url: str, body: dict, stream: bool, chat: bool = False) -> tuple[dict[int, dict], dict, list[str]]:
    """(each choice of a response of several choices by its index: text, finish and stop reasons, token ids,
    logprobs, prompt ids; the usage; the routes the choices name, where they name them), streamed or not."""
    body, path = {"model": MODEL, **body}, "/v1/chat/completions" if chat else "/v1/completions"
    if not stream:
        r = httpx.post(f"{url}{path}", json=body, timeout=600)
        assert r.status_code == 200, r.text
        response = r.json()
        choices = {c["index"]: c for c in response["choices"]}
        routes = [c["kairos"]["route"] for c in response["choices"] if "kairos" in c]
        assert len(choices) == len(response["choices"])
        return (
            {i: {**answer({**response, "choices": [c]}, chat), "id": None} for i, c in choices.items()},
            response["usage"],
            routes,
        )
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=600) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    assert len({e["id"] for e in events}) == 1 and not any("error" in e for e in events)
    (usage,) = [e["usage"] for e in events if not e["choices"]]
    indices = sorted({e["choices"][0]["index"] for e in events if e["choices"]})
    by_index = {i: [e for e in events if e["choices"] and e["choices"][0]["index"] == i] for i in indices}
    routes = [evs[0]["kairos"]["route"] for evs in by_index.values() if "kairos" in evs[0]]
    answers = {}
    for i, evs in by_index.items():
        joined = streamed_answer(evs, chat)
        answers[i] = {k: joined[k] for k in ("text", "finish_reason", "stop_reason", "logprobs", "token_ids")}
        answers[i] |= {"prompt_token_ids": joined["prompt_token_ids"]}
    return answers, usage, routes


def assert_same_choices(
    url: str, vllm_server: str, body: dict, stream: bool, count: int, chat: bool = False
) -> tuple[dict[int, dict], list[str]]:
    """The app's ``count`` choices equal vLLM's server's (logprobs within the tolerance), usage included; (ours,
    the routes they name)."""
    ours, our_usage, routes = choices_of(url, body, stream, chat)
    theirs, their_usage, _ = choices_of(vllm_server, body, stream, chat)
    assert sorted(ours) == sorted(theirs) == list(range(count))
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert {k: our_usage[k] for k in keys} == {k: their_usage[k] for k in keys}
    for index in ours:
        mine, vllms = dict(ours[index]), dict(theirs[index])
        assert_logprobs_close(mine.pop("logprobs"), vllms.pop("logprobs"))
        assert_prompt_logprobs_close(mine.pop("prompt_logprobs", None), vllms.pop("prompt_logprobs", None))
        assert mine == vllms, index
    return ours, routes


BATCHES = {
    "greedy": {"max_tokens": 12, "temperature": 0.0, "logprobs": 2, "return_token_ids": True},
    "seeded": {"max_tokens": 12, "temperature": 0.8, "seed": 77},
    "echo": {"max_tokens": 6, "temperature": 0.0, "echo": True, "logprobs": 1},
    "token ids": {"max_tokens": 8, "temperature": 0.0},
}


@pytest.mark.parametrize("case", list(BATCHES))
def test_a_list_of_prompts_answers_as_vllms_own_server_each_prompt_on_its_route(cpu_app, vllm_server, case):
    """Four prompts, two deflected and two handed off: the same choices (tokens, logprobs within 1e-3), indices
    and summed usage as vLLM's server, streamed and not."""
    url, _ = cpu_app
    words = [SHORT, LONG, SHORT + 3, LONG - 5]
    prompts: list = [prompt(w) for w in words]
    if case == "token ids":
        prompts = [[5 + k % 590 for k in range(2 * w)] for w in words]  # as many tokens as a prompt of w words
    body = {"prompt": prompts, **BATCHES[case]}
    for stream in (False, True):
        _, routes = assert_same_choices(url, vllm_server, body, stream, count=4)
        assert routes == ["deflect", "prefill", "deflect", "prefill"]


# vLLM's CPU engine dies on a seeded request whose prompt logprobs it prefills in several steps (three samples of
# the long prompt), and refuses n > 1 at temperature 0: the echoed samples draw from the likeliest token alone
SAMPLES = {"seeded": {"temperature": 1.0, "seed": 11}, "echoed": {"temperature": 1.0, "top_k": 1, "echo": True}}


@pytest.mark.parametrize("kind", list(SAMPLES))
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("route, words", [("deflect", SHORT), ("prefill", LONG)])
def test_n_samples_answer_as_vllms_own_server(cpu_app, vllm_server, chat, route, words, kind):
    """n = 3 samples: the same three choices as vLLM's server (each seeded sample seeded as its engine seeds
    it; echoed ones with the prompt's logprobs, computed by the first sample alone), the prompt counted once in
    the usage, streamed and not."""
    url, _ = cpu_app
    body = request_of(chat, words, {"n": 3, "max_tokens": 10, "logprobs": 2}, SAMPLES[kind])
    if chat:
        body = {**body, "logprobs": True, "top_logprobs": 2}
    whole, routes = assert_same_choices(url, vllm_server, body, False, count=3, chat=chat)
    assert routes[0] == route
    if kind == "seeded":
        assert len({whole[i]["text"] for i in whole}) > 1  # three samples, not one thrice
        streamed, routes = assert_same_choices(url, vllm_server, body, True, count=3, chat=chat)
        assert routes[0] == route
        return
    assert all(whole[i]["prompt_logprobs"] for i in whole)
    # vLLM's server fails this stream (its samples after the first have no prompt logprobs to echo): ours streams
    # what it answers whole
    streamed, _, _ = choices_of(url, body, True, chat)
    for index, choice in streamed.items():
        same = {key: whole[index][key] for key in ("text", "finish_reason", "token_ids")}
        assert {key: choice[key] for key in same} == same
        assert_logprobs_close(choice["logprobs"], whole[index]["logprobs"])


HONOURED = "honoured"  # the answer equals vLLM's server's and differs from the answer without the field
REFUSED = "refused"  # a 400 naming the field here (the app does not serve it)
VLLM_REFUSES = "refused as vLLM's server refuses it"  # the same 4xx from both servers
ELSEWHERE = "compared with vLLM's server by a test of its own"  # several choices: not one answer to compare
INERT = "inert, as in vLLM's server"  # both give the answer they give without it (nothing here for it to act on)

FORCED = {"logit_bias": {"2": 100}}  # the end-of-sequence token at every step
SEEDED = {"temperature": 1.0, "seed": 3, "return_token_ids": True}  # most sampled tokens decode to no text
# The dummy weights' logits are all near 0 (a flat distribution): this bias gives token 332 about half of it, so
# that temperature and min_p show (at temperature 0.3 or with min_p 0.9 it is all that is sampled)
BIASED = {**SEEDED, "logit_bias": {"332": 7}}
# "prefill" is one token (332), " prefill" another (313): a bad word that bans the token forced here
PREFILL_FORCED = {"logit_bias": {"332": 100}, "return_token_ids": True}


@dataclasses.dataclass(frozen=True)
class Served:
    """How a request field is served, and the request that shows it."""

    kind: str
    fields: dict | Callable[[dict], dict] = dataclasses.field(default_factory=dict)  # or from the reference answer
    baseline: dict | Callable[[dict], dict] = dataclasses.field(default_factory=dict)  # the answer it must change
    stream: bool = False
    keys: tuple[str, ...] = COMPARED  # what it changes


def _stop(ref: dict) -> dict:
    """A stop string from the middle of the reference answer (word tokens only)."""
    return {**WORDS_ONLY, "stop": [ascii_stop(ref["text"])]}


SHARED: dict[str, Served] = {
    "model": Served(VLLM_REFUSES, {"model": "gpt-9"}),
    "frequency_penalty": Served(HONOURED, {"frequency_penalty": 2.0}),
    "presence_penalty": Served(HONOURED, {"presence_penalty": 2.0}),
    "repetition_penalty": Served(HONOURED, {"repetition_penalty": 2.0}),
    "logit_bias": Served(HONOURED, {"logit_bias": {"100": 100}}),
    "max_tokens": Served(HONOURED, {"max_tokens": 4}),
    "n": Served(ELSEWHERE),
    "seed": Served(HONOURED, SEEDED, {**SEEDED, "seed": 4}),
    "stop": Served(HONOURED, _stop, WORDS_ONLY),
    "stream": Served(HONOURED, stream=True, keys=("events",)),
    "stream_options": Served(
        HONOURED,
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        {"stream_options": {"include_usage": False}},
        stream=True,
        keys=("usage_events",),
    ),
    "temperature": Served(HONOURED, {**BIASED, "temperature": 1.5}, {**BIASED, "temperature": 0.3}),
    "top_p": Served(HONOURED, {**SEEDED, "top_p": 0.05}, SEEDED),
    "user": Served(INERT, {"user": "someone"}),
    "use_beam_search": Served(REFUSED, {"use_beam_search": True}),
    "top_k": Served(HONOURED, {**SEEDED, "top_k": 1}, SEEDED),
    "min_p": Served(HONOURED, {**BIASED, "min_p": 0.9}, BIASED),
    "watermarking": Served(INERT, {"watermarking": True}),  # no watermark configured
    "length_penalty": Served(REFUSED, {"length_penalty": 2.0}),
    "stop_token_ids": Served(HONOURED, lambda ref: {**WORDS_ONLY, "stop_token_ids": [ref["token_ids"][5]]}, WORDS_ONLY),
    "include_stop_str_in_output": Served(
        HONOURED, lambda ref: {**_stop(ref), "include_stop_str_in_output": True}, _stop
    ),
    "ignore_eos": Served(HONOURED, {**FORCED, "ignore_eos": True}, FORCED),
    "min_tokens": Served(HONOURED, {**FORCED, "min_tokens": 5}, FORCED),
    "skip_special_tokens": Served(
        HONOURED, {"logit_bias": {"1": 100}, "skip_special_tokens": False}, {"logit_bias": {"1": 100}}
    ),
    "spaces_between_special_tokens": Served(  # passed to vLLM's detokenizer, whose byte-level decoder here
        INERT,  # puts no space between special tokens either way
        {"logit_bias": {"1": 100}, "skip_special_tokens": False, "spaces_between_special_tokens": False},
        {"logit_bias": {"1": 100}, "skip_special_tokens": False},
    ),
    "truncate_prompt_tokens": Served(HONOURED, {"truncate_prompt_tokens": 10}),
    "truncation_side": Served(
        HONOURED, {"truncate_prompt_tokens": 10, "truncation_side": "right"}, {"truncate_prompt_tokens": 10}
    ),
    "allowed_token_ids": Served(HONOURED, {"allowed_token_ids": [100, 101, 102]}),
    "prompt_logprobs": Served(HONOURED, {"prompt_logprobs": 1}, keys=("prompt_logprobs",)),
    "bad_words": Served(HONOURED, {**PREFILL_FORCED, "bad_words": ["prefill"]}, PREFILL_FORCED),
    "response_format": Served(HONOURED, {"response_format": {"type": "json_object"}}),
    "structured_outputs": Served(HONOURED, {"structured_outputs": {"choice": ["yes", "no"]}}),
    "priority": Served(INERT, {"priority": 1}),  # first come, first served
    "request_id": Served(HONOURED, {"request_id": "field-test"}, keys=("id",)),
    "session_id": Served(INERT, {"session_id": "s1"}),
    "return_token_ids": Served(HONOURED, {"return_token_ids": True}, {"return_token_ids": False}),
    "routed_experts_prompt_start": Served(INERT, {"routed_experts_prompt_start": 1}),  # no expert routing returned
    "return_token_offsets": Served(INERT, {"return_token_offsets": True}),  # render endpoints only
    "mm_payload": Served(INERT, {"mm_payload": "none"}),  # render endpoints only
    "return_mm_kwargs": Served(INERT, {"return_mm_kwargs": False}),  # render endpoints only
    "cache_salt": Served(INERT, {"cache_salt": "tenant-a"}),  # prefix caching is off
    "kv_transfer_params": Served(REFUSED, {"kv_transfer_params": {"do_remote_decode": True}}),
    "ec_transfer_params": Served(REFUSED, {"ec_transfer_params": {}}),
    "vllm_xargs": Served(REFUSED, {"vllm_xargs": {"key": 1}}),
    "repetition_detection": Served(HONOURED, {"repetition_detection": {"max_pattern_size": 2, "min_count": 2}}),
    "thinking_token_budget": Served(VLLM_REFUSES, {"thinking_token_budget": 4}),  # no reasoning parser
    "stream_interval": Served(HONOURED, {"stream_interval": 4}, stream=True, keys=("events",)),
}
COMPLETIONS_ONLY: dict[str, Served] = {
    "prompt": Served(HONOURED, {"prompt": prompt(31)}),
    "echo": Served(HONOURED, {"echo": True}),
    "logprobs": Served(HONOURED, {"logprobs": 2}),
    "logprob_token_ids": Served(HONOURED, {"logprobs": 0, "logprob_token_ids": [5, 6]}, {"logprobs": 0}),
    "return_tokens_as_token_ids": Served(
        HONOURED, {"logprobs": 1, "return_tokens_as_token_ids": True}, {"logprobs": 1}
    ),
    "suffix": Served(VLLM_REFUSES, {"suffix": "x"}),  # no fill-in-the-middle template
    "prompt_embeds": Served(REFUSED, {"prompt_embeds": "AAAA"}),
    "add_special_tokens": Served(INERT, {"add_special_tokens": False}),  # this tokenizer adds none
}
CHAT_ONLY: dict[str, Served] = {
    "messages": Served(HONOURED, {"messages": [{"role": "user", "content": prompt(31)}]}),
    "echo": Served(HONOURED, {**CONTINUED, "echo": True}, CONTINUED, keys=(*COMPARED, "prompt_logprobs")),
    "logprobs": Served(HONOURED, {"logprobs": True}),
    "top_logprobs": Served(HONOURED, {"logprobs": True, "top_logprobs": 3}, {"logprobs": True}),
    "logprob_token_ids": Served(HONOURED, {"logprobs": True, "logprob_token_ids": [5, 6]}, {"logprobs": True}),
    "return_tokens_as_token_ids": Served(
        HONOURED, {"logprobs": True, "return_tokens_as_token_ids": True}, {"logprobs": True}
    ),
    "add_special_tokens": Served(INERT, {"add_special_tokens": True}),  # this tokenizer adds none
    "max_completion_tokens": Served(HONOURED, {"max_completion_tokens": 4}),
    "tools": Served(HONOURED, {"tools": TOOLS, "tool_choice": "none"}),  # the template renders them
    # the answer held to a call (structured outputs): with "auto" a tool call, with "none" text
    "tool_choice": Served(HONOURED, {**CALLING, "tool_choice": "auto"}, {**CALLING, "tool_choice": "none"}),
    "reasoning_effort": Served(INERT, {"reasoning_effort": "low"}),  # the template does not read it
    "include_reasoning": Served(INERT, {"include_reasoning": False}),  # no reasoning parser
    "parallel_tool_calls": Served(
        HONOURED, {**CALLING_TWICE, "parallel_tool_calls": False}, CALLING_TWICE
    ),  # the first call only
    "add_generation_prompt": Served(HONOURED, {"add_generation_prompt": False}),
    "continue_final_message": Served(HONOURED, CONTINUED, {**CONTINUED, "continue_final_message": False}),
    "documents": Served(HONOURED, {"documents": [{"title": "notes", "text": "owls count stars"}]}),
    "chat_template": Served(VLLM_REFUSES, {"chat_template": "{{ messages }}"}),  # untrusted templates
    "chat_template_kwargs": Served(INERT, {"chat_template_kwargs": {"unused": 1}}),  # the template does not read it
    "media_io_kwargs": Served(VLLM_REFUSES, {"media_io_kwargs": {"image": {}}}),  # untrusted, as by default there
    "mm_processor_kwargs": Served(INERT, {"mm_processor_kwargs": {}}),
    "return_prompt_text": Served(HONOURED, {"return_prompt_text": True}),
}
TABLES = {False: {**SHARED, **COMPLETIONS_ONLY}, True: {**SHARED, **CHAT_ONLY}}


UTILITIES = {
    "tokenize": {"model": MODEL, "prompt": prompt(SHORT), "return_token_strs": True},
    "tokenize bare": {"prompt": prompt(7), "add_special_tokens": False},
    "tokenize chat": {"messages": [{"role": "user", "content": prompt(9)}], "return_token_strs": True},
    "tokenize chat open": {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": prompt(5)}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "tokenize both": {"messages": [], "add_generation_prompt": True, "continue_final_message": True},
    "tokenize other model": {"model": "other", "prompt": "a"},
    "tokenize no prompt": {"model": MODEL},
    "detokenize": {"model": MODEL, "tokens": [5, 86, 261, 541, 594, 491, 12, 300]},
    "detokenize not ids": {"tokens": ["a"]},
}


@pytest.mark.parametrize("case", list(UTILITIES))
def test_tokenize_and_detokenize_answer_as_vllms_own_server(cpu_app, vllm_server, case):
    """Same status and body (an error's status and the field it names)."""
    url, _ = cpu_app
    path = "/" + case.split()[0]
    ours = httpx.post(f"{url}{path}", json=UTILITIES[case], timeout=60)
    theirs = httpx.post(f"{vllm_server}{path}", json=UTILITIES[case], timeout=60)
    assert ours.status_code == theirs.status_code, (ours.text, theirs.text)
    if theirs.status_code == 200:
        assert ours.json() == theirs.json()
    else:
        mine, vllms = ours.json()["error"], theirs.json()["error"]
        assert mine["code"] == vllms["code"] == theirs.status_code
        assert mine["param"] == (vllms["param"] or "").removeprefix("body.") or vllms["param"] is None


def test_version_answers_as_vllms_own_server(cpu_app, vllm_server):
    ours, theirs = httpx.get(f"{cpu_app[0]}/version", timeout=30), httpx.get(f"{vllm_server}/version", timeout=30)
    assert ours.status_code == theirs.status_code == 200
    assert ours.json()["version"] == theirs.json()["version"] and ours.json()["kairos_ray"]


def test_a_decode_engine_core_that_hangs_mid_stream_is_left_and_the_text_is_unchanged(cpu_app, undisturbed):
    """Greedy tokens: a stream migrated after its decode node's engine core stopped (SIGSTOP) equals an
    undisturbed run's."""
    fault_mid_stream(cpu_app[0], undisturbed, signal.SIGSTOP)


def test_the_field_tables_cover_every_field_of_vllms_request_models():
    """When vLLM grows a request field, this fails until the table says how the app serves it."""
    assert set(TABLES[False]) == set(CompletionRequest.model_fields)
    assert set(TABLES[True]) == set(ChatCompletionRequest.model_fields)


FIELD_BASE = {"max_tokens": 12, "temperature": 0.0}
_references: dict[bool, dict] = {}
_baselines: dict[str, Any] = {}


def resolved(value: dict | Callable[[dict], dict], chat: bool, server: str) -> dict:
    """A case's fields; callables get vLLM's greedy answer to the base request in word tokens, with its ids."""
    if not callable(value):
        return value
    if chat not in _references:
        _references[chat] = ask(server, chat, request_of(chat, 30, FIELD_BASE, WORDS_ONLY, return_token_ids=True)).body
    return value(_references[chat])


def baseline_of(key: list, ask_it: Callable[[], Any]) -> Any:
    """The app's answer to a field case's baseline request, asked once per distinct request (``key``): every
    baseline is greedy or seeded, so asking again would give the same answer, and most cases share one."""
    text = json.dumps(key, sort_keys=True)
    if text not in _baselines:
        _baselines[text] = ask_it()
    return _baselines[text]


@pytest.mark.parametrize(
    "chat, name",
    [(chat, name) for chat in (False, True) for name in TABLES[chat] if TABLES[chat][name].kind != ELSEWHERE],
    ids=lambda v: str(v),
)
def test_every_request_field_is_honoured_as_vllm_honours_it_or_refused(cpu_app, vllm_server, chat, name):
    url, _ = cpu_app
    served = TABLES[chat][name]
    body = request_of(chat, 30, FIELD_BASE, resolved(served.fields, chat, vllm_server))
    ours = ask(url, chat, body, served.stream)
    if served.kind == REFUSED:
        assert ours.status == 400 and ours.body["error"]["param"] == name, ours.body
        return
    theirs = ask(vllm_server, chat, body, served.stream)
    if served.kind == VLLM_REFUSES:
        assert 400 <= theirs.status < 500 and ours.status == theirs.status, (ours.body, theirs.body)
        return
    if "id" in served.keys:
        assert ours.body["id"] == theirs.body["id"]
    else:
        assert_same_answer(ours, theirs)
    fields, stream = resolved(served.baseline, chat, vllm_server), served.stream and name != "stream"
    baseline = baseline_of(
        [chat, fields, stream], lambda: ask(url, chat, request_of(chat, 30, FIELD_BASE, fields), stream)
    )
    changed = [k for k in served.keys if ours.body.get(k) != baseline.body.get(k)]
    if served.kind == HONOURED:
        assert changed or ours.body["logprobs"] != baseline.body["logprobs"], f"{name} changed nothing"
    else:
        assert_same_answer(ours, baseline)


R_BASE = {"input": prompt(30), "max_output_tokens": 12, "temperature": 0.0}
R_BIASED = {"temperature": 1.0, "seed": 3, "logit_bias": {"332": 7}}  # sampled, token 332 half the time (BIASED)
R_FORCED_WORD = {"logit_bias": {"332": 100}}  # "prefill" at every step
R_TOOL = {
    "type": "function",
    "name": "lookup",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
}
RESPONSES_FIELDS: dict[str, Served] = {
    "background": Served(REFUSED, {"background": True}),
    "include": Served(REFUSED, {"include": ["message.output_text.logprobs"]}),
    "input": Served(HONOURED, {"input": prompt(31)}),
    "instructions": Served(HONOURED, {"instructions": "answer in one word"}),
    "max_output_tokens": Served(HONOURED, {"max_output_tokens": 4}),
    "max_tool_calls": Served(HONOURED, {"max_tool_calls": 2}),  # echoed (it bounds built-in tools)
    "metadata": Served(HONOURED, {"metadata": {"k": "v"}}),  # echoed
    "model": Served(VLLM_REFUSES, {"model": "gpt-9"}),
    "logit_bias": Served(HONOURED, R_FORCED_WORD),
    "parallel_tool_calls": Served(HONOURED, {"parallel_tool_calls": False}),  # echoed
    "previous_response_id": Served(REFUSED, {"previous_response_id": "resp_1"}),
    "prompt": Served(REFUSED, {"prompt": {"id": "pmpt_1"}}),
    "reasoning": Served(HONOURED, {"reasoning": {"effort": "low"}}),  # echoed
    "include_reasoning": Served(INERT, {"include_reasoning": False}),  # no reasoning parser
    "service_tier": Served(HONOURED, {"service_tier": "flex"}),  # echoed
    "store": Served(INERT, {"store": False}),  # nothing is stored either way
    "stream": Served(ELSEWHERE),  # test_responses_answer_as_vllms_own_server_on_both_routes
    "temperature": Served(HONOURED, {**R_BIASED, "temperature": 1.5}, R_BIASED),
    "text": Served(HONOURED, {"text": {"format": {"type": "json_object"}}}),
    "tool_choice": Served(INERT, {"tool_choice": "auto"}),
    "tools": Served(HONOURED, {"tools": [R_TOOL]}),  # the template renders them
    "top_logprobs": Served(INERT, {"top_logprobs": 2}),  # without output logprobs asked for
    "top_p": Served(HONOURED, {**R_BIASED, "top_p": 0.05}, R_BIASED),
    "top_k": Served(HONOURED, {**R_BIASED, "top_k": 1}, R_BIASED),
    "min_p": Served(HONOURED, {**R_BIASED, "min_p": 0.9}, R_BIASED),
    "truncation": Served(HONOURED, {"truncation": "auto"}),  # echoed
    "user": Served(HONOURED, {"user": "someone"}),  # echoed
    "skip_special_tokens": Served(
        HONOURED, {"logit_bias": {"1": 100}, "skip_special_tokens": False}, {"logit_bias": {"1": 100}}
    ),
    "include_stop_str_in_output": Served(
        HONOURED,
        {**R_FORCED_WORD, "stop": ["fill"], "include_stop_str_in_output": True},
        {**R_FORCED_WORD, "stop": ["fill"]},
    ),
    "presence_penalty": Served(HONOURED, {"presence_penalty": 2.0}),
    "frequency_penalty": Served(HONOURED, {"frequency_penalty": 2.0}),
    "prompt_cache_key": Served(INERT, {"prompt_cache_key": "k"}),
    "watermarking": Served(INERT, {"watermarking": True}),  # no watermark configured
    "request_id": Served(HONOURED, {"request_id": "resp_field-test"}, keys=("id",)),
    "session_id": Served(INERT, {"session_id": "s1"}),
    "media_io_kwargs": Served(VLLM_REFUSES, {"media_io_kwargs": {"image": {}}}),
    "mm_processor_kwargs": Served(INERT, {"mm_processor_kwargs": {}}),
    "priority": Served(INERT, {"priority": 1}),  # first come, first served
    "mm_payload": Served(INERT, {"mm_payload": "none"}),
    "return_mm_kwargs": Served(INERT, {"return_mm_kwargs": False}),
    "cache_salt": Served(INERT, {"cache_salt": "tenant-a"}),
    "enable_response_messages": Served(REFUSED, {"enable_response_messages": True}),
    "previous_input_messages": Served(  # read by vLLM's server with a stored previous response only
        INERT,
        {"previous_input_messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]},
    ),
    "structured_outputs": Served(HONOURED, {"structured_outputs": {"choice": ["yes", "no"]}}),
    "repetition_penalty": Served(HONOURED, {"repetition_penalty": 2.0}),
    "seed": Served(HONOURED, {**R_BIASED, "seed": 4}, R_BIASED),
    "stop": Served(HONOURED, {**R_FORCED_WORD, "stop": ["fill"]}, R_FORCED_WORD),
    "stop_token_ids": Served(HONOURED, {**R_FORCED_WORD, "stop_token_ids": [332]}, R_FORCED_WORD),
    "ignore_eos": Served(HONOURED, {**FORCED, "ignore_eos": True}, FORCED),
    "vllm_xargs": Served(REFUSED, {"vllm_xargs": {"key": 1}}),
    "kv_transfer_params": Served(REFUSED, {"kv_transfer_params": {"do_remote_decode": True}}),
    "ec_transfer_params": Served(REFUSED, {"ec_transfer_params": {}}),
    "chat_template_kwargs": Served(INERT, {"chat_template_kwargs": {"unused": 1}}),  # the template does not read it
}


def test_the_responses_field_table_covers_every_field_of_vllms_responses_request():
    assert set(RESPONSES_FIELDS) == set(ResponsesRequest.model_fields)


def normalized(r: httpx.Response) -> dict:
    """A ``/v1/responses`` body as two servers' can be compared: ids, times, the route and cached-token counts
    (each server's own cache) left out."""
    body = {k: v for k, v in r.json().items() if k not in ("id", "created_at", "kairos")}
    if body.get("usage"):
        body["usage"] = {k: v for k, v in body["usage"].items() if k != "input_tokens_details"}
    body["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in body["output"]]
    return body


@pytest.mark.parametrize("name", [n for n, s in RESPONSES_FIELDS.items() if s.kind != ELSEWHERE])
def test_every_responses_field_is_served_as_vllm_serves_it_or_refused(cpu_app, vllm_server, name):
    url, _ = cpu_app
    served = RESPONSES_FIELDS[name]
    assert not callable(served.fields) and not callable(served.baseline)

    def post(server: str, fields: dict) -> httpx.Response:
        return httpx.post(f"{server}/v1/responses", json={"model": MODEL, **R_BASE, **fields}, timeout=600)

    ours = post(url, served.fields)
    if served.kind == REFUSED:
        assert ours.status_code == 400 and ours.json()["error"]["param"] == name, ours.text
        return
    theirs = post(vllm_server, served.fields)
    if served.kind == VLLM_REFUSES:
        assert 400 <= theirs.status_code < 500 and ours.status_code == theirs.status_code, (ours.text, theirs.text)
        return
    assert ours.status_code == theirs.status_code == 200, (ours.text, theirs.text)
    if "id" in served.keys:
        assert ours.json()["id"] == theirs.json()["id"] == served.fields["request_id"]
        return
    assert normalized(ours) == normalized(theirs)
    baseline = baseline_of(["responses", served.baseline], lambda: normalized(post(url, served.baseline)))
    if served.kind == HONOURED:
        assert normalized(ours) != baseline, f"{name} changed nothing"
    else:
        assert normalized(ours) == baseline


def test_both_faulted_decode_replicas_are_replaced_and_serve_as_before(cpu_app, undisturbed):
    """Serve replaced the replicas of this module's two engine-core faults (dies, hangs): two decode nodes in the
    router's view again, and the app serves the deflected prompt as before."""
    wait_for_decode_nodes(2)
    assert greedy_text(cpu_app[0], prompt(SHORT), 48) == undisturbed


def test_every_per_request_structure_is_empty_once_idle(cpu_app):
    """After this module's requests (both routes, failed and migrated ones among them) and a client gone
    mid-stream, nothing is kept per request: ingress, router, engines, vLLM's own state, staged KV."""
    url, _ = cpu_app
    wait_for_decode_nodes(2)
    body = {"model": MODEL, "prompt": prompt(LONG), "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))  # then the client goes away
    found = wait_for_no_residue(within_s=120)
    assert {r.process.split("-")[0] for r in found} == {"ingress", "router", "prefill", "decode"}
