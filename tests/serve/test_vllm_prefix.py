"""Prefix-aware routing on real vLLM CPU engines: ``serve_configs/2p2d-cpu.yaml`` on one prefill node and its two
decode nodes.

The engines publish their KV cache events to their actors, which report the
changes to the router (``engines.vllm_events``); the ingress hashes each
prompt as vLLM does. A conversation's next turn, whose prompt is the last
turn's prompt, its answer and a new message, must then be deflected by the
router's own decision to the decode node that served the last turn, priced
and run as the uncached suffix, and vLLM must find the history cached there.

The router decides with prefix-aware SL (``sl:400+prefix``): it deflects a
prompt whose uncached suffix on some decode node is short, to the node where
its plan is fastest (here one step on the holder against seven elsewhere).
Whether Kairos deflects such a turn at all depends on the engines' measured
speeds (four engines share two cores here, and the router prices each node
on its own steps), so its choice for a next turn is tested where step times
are the model's (the emulated app, ``tests/serve/test_app.py``).
"""

import random

import httpx
import pytest

from tests.serve.conftest import CPU_MODEL, use_policy, wait_for_prefix

pytestmark = [pytest.mark.ray, pytest.mark.vllm]

MODEL = CPU_MODEL
BLOCK_TOKENS = 128  # vLLM's block size on the CPU
VOCAB = 1024  # the tiny model's


@pytest.fixture(scope="module")
def shipped_app(cpu_app):
    """The vLLM CPU app deciding with prefix-aware SL (module docstring): (base URL, metrics URL)."""
    use_policy("sl:400+prefix")
    return cpu_app


def completion(url: str, prompt: list[int], max_tokens: int, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **extra}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r


def next_turn(url: str, seed: int) -> tuple[str, list[int], int]:
    """(holder, turn, cached): a conversation's first turn (600 tokens, a 200-token answer) served, its next turn
    (that history and 60 new tokens), and the history's tokens its decode node holds once the router's mirror shows
    them."""
    rng = random.Random(seed)
    prompt = rng.choices(range(VOCAB), k=600)
    first = completion(url, prompt, max_tokens=200)
    holder = first.headers["x-kairos-decode-node"]
    history = prompt + first.json()["choices"][0]["token_ids"]
    turn = history + rng.choices(range(VOCAB), k=60)  # the history, then the next message
    cached = (len(history) - 1) // BLOCK_TOKENS * BLOCK_TOKENS  # the KV of all but the last answer token
    assert cached >= 5 * BLOCK_TOKENS
    wait_for_prefix(holder, turn, BLOCK_TOKENS, cached)
    return holder, turn, cached


def test_a_conversation_s_next_turn_goes_to_the_decode_node_holding_its_history(shipped_app):
    url, _ = shipped_app
    holder, turn, cached = next_turn(url, seed=16)
    second = completion(url, turn, max_tokens=8)
    kairos = second.json()["kairos"]
    assert (kairos["route"], kairos["decode_node"]) == ("deflect", holder), kairos["reason"]
    assert not kairos["fallback"]
    assert sum(kairos["chunk_schedule"]) == len(turn) - cached  # priced and run as the uncached suffix
    assert int(second.headers["x-kairos-cached-tokens"]) == cached  # vLLM's own hit on that node
