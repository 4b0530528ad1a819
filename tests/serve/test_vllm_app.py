"""End to end on real vLLM CPU engines: ``serve_configs/2p2d-cpu.yaml`` under ``serve.run``, the openai client.

The shipped config decides with the Kairos policy; here the ``sl:<tokens>``
baseline routes instead (short prompts deflected, long ones disaggregated), so
that both routes are taken on purpose, whatever this machine's speed.
"""

import contextlib
import json
import os
import signal
import time

import httpx
import openai
import pytest
from ray import serve
from transformers import AutoTokenizer

from kairos_ray.bench import faults
from kairos_ray.messages import Role
from kairos_ray.serve.args import AppArgs
from tests.serve.conftest import running_app
from tests.serve.test_args import args_of

MODEL = "tiny-llama"
SHORT, LONG = 120, 700  # prompt words: deflected (<= 400 tokens) and disaggregated
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
def cpu_app():
    args = args_of("2p2d-cpu.yaml")
    args["kairos"]["policy"]["name"] = "sl:400"
    args["serving"]["engine_stall_timeout_s"] = 8.0  # a stopped engine core shows within seconds
    with running_app(args, MODEL, ready_within_s=420) as urls:
        yield urls


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(
        AppArgs.model_validate(args_of("2p2d-cpu.yaml")).decode_config.model_loading_config.source
    )


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
    assert sum(1 for c in chunks if c.choices) == 6
    (usage,) = [c.usage for c in chunks if c.usage is not None]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert usage.prompt_tokens == len(expected if isinstance(expected, list) else expected["input_ids"])


def test_token_ids_outside_the_vocabulary_are_a_400(cpu_app):
    url, _ = cpu_app
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [5, 99_999], "max_tokens": 2}, timeout=60)
    assert r.status_code == 400
    assert "token ids" in r.json()["error"]["message"]


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
    """Serve replaces a failed replica; its new engine takes a minute or two to start on 2 cores."""
    deadline = time.monotonic() + timeout_s
    while len(decode_nodes()) < count:
        assert time.monotonic() < deadline, f"{count} decode nodes not back within {timeout_s} s"
        time.sleep(2)


@pytest.mark.parametrize("fault", ["kill -9", "SIGSTOP"])
def test_a_decode_engine_core_that_dies_or_hangs_mid_stream_is_left_and_the_text_is_unchanged(cpu_app, fault):
    """Greedy tokens: a stream migrated after its decode node's engine core died (or stopped) equals an
    undisturbed run's; the failed node leaves the router's view and Serve replaces its replica."""
    url, _ = cpu_app
    wait_for_decode_nodes(2)
    text = prompt(SHORT)  # deflected: prefilled on a decode node
    reference = greedy_text(url, text, 48)
    stopped = []

    def inject(node: str) -> None:
        pid = faults.engine_pid("kairos", node)
        os.kill(pid, signal.SIGKILL if fault == "kill -9" else signal.SIGSTOP)
        stopped.append((node, pid))

    try:
        streamed, node, count = disturbed_stream(url, text, 48, inject)
        assert stopped and count == 48
        assert streamed == reference
        deadline = time.monotonic() + 15
        while node in decode_nodes():  # unhealthy: out of the view within a heartbeat or two
            assert time.monotonic() < deadline, f"{node} still in the router's view"
            time.sleep(0.2)
    finally:
        for _, pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    wait_for_decode_nodes(2)
    assert greedy_text(url, text, 48) == reference  # and the app serves as before
