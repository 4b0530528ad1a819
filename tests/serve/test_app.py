"""The emulated 2P2D app under real Ray and Serve, driven by real HTTP clients (httpx and openai)."""

import asyncio
import csv
import itertools
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import ray
from ray import serve
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kairos_ray.bench.faults import replica_names
from kairos_ray.engines.emulated import BLOCK_TOKENS, VOCAB, token_id
from kairos_ray.messages import LiveState, Role

from .conftest import MODEL, dashboard_series, wait_for_no_residue, wait_for_prefix, wait_for_series

pytestmark = pytest.mark.ray


def completion(url, **body):
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body}, timeout=120)


def at_once(url, count, **body):
    """``count`` identical completions sent concurrently."""

    async def send():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            request = {"model": MODEL, **body}
            return await asyncio.gather(*(client.post("/v1/completions", json=request) for _ in range(count)))

    return asyncio.run(send())


def test_health_and_models(live_app):
    url, _ = live_app
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [MODEL]


def test_completion_reports_route_nodes_and_breakdown(live_app):
    url, _ = live_app
    r = completion(url, prompt=list(range(3000)), max_tokens=5)
    assert r.status_code == 200
    body = r.json()
    assert body["usage"] == {"prompt_tokens": 3000, "completion_tokens": 5, "total_tokens": 3005}
    assert r.headers["x-kairos-decode-node"].startswith("decode-")
    parts = dict(p.split("=") for p in r.headers["x-kairos-breakdown"].split(";"))
    assert set(parts) == {"prefill_queue", "prefill_exec", "kv_transfer", "decode_queue"}
    assert sum(map(float, parts.values())) == pytest.approx(float(r.headers["x-kairos-ttft-s"]), abs=1e-5)
    kairos = body["kairos"]
    assert kairos["route"] == r.headers["x-kairos-route"] and kairos["decode_node"] == r.headers["x-kairos-decode-node"]
    schedule = [int(c) for c in r.headers["x-kairos-chunk-schedule"].split(",") if c]
    if kairos["route"] == "deflect":  # prefilled in place: the whole prompt in chunks, nothing transferred
        assert sum(schedule) == 3000 and kairos["prefill_node"] is None and float(parts["kv_transfer"]) == 0.0
        assert r.headers["x-kairos-prefill-node"] == r.headers["x-kairos-kv-transport"] == ""
    else:  # prefilled on a prefill node, its KV through the object store
        assert schedule == [] and kairos["prefill_node"] == r.headers["x-kairos-prefill-node"] != ""
        assert r.headers["x-kairos-kv-transport"] == "object_store" and float(parts["kv_transfer"]) > 0.0
    assert r.headers["x-kairos-fallback"] == "0" and r.headers["x-kairos-reason"].startswith("decode ")
    assert len(body["choices"][0]["text"].split()) == 5


def test_a_burst_takes_both_routes(live_app):
    url, _ = live_app

    # no earlier prompt begins like this one: the nodes' prefix caches hold none of it
    responses = at_once(url, 12, prompt=list(range(100_000, 108_000)), max_tokens=8)
    assert all(r.status_code == 200 for r in responses)
    routes = {r.headers["x-kairos-route"] for r in responses}
    assert routes == {"prefill", "deflect"}
    for r in responses:
        kairos = r.json()["kairos"]
        if kairos["route"] == "deflect":
            assert sum(kairos["chunk_schedule"]) == 8000 and kairos["prefill_node"] is None
            assert float(kairos["breakdown"]["kv_transfer_s"]) == 0.0
        else:
            assert kairos["chunk_schedule"] == [] and kairos["prefill_node"].startswith("prefill-")
            assert kairos["breakdown"]["kv_transfer_s"] > 0.0


def test_a_conversation_s_next_turn_is_deflected_to_the_decode_node_holding_its_history(live_app):
    url, _ = live_app
    prompt = list(range(200_000, 203_000))
    first = completion(url, prompt=prompt, max_tokens=256, return_token_ids=True)
    holder = first.headers["x-kairos-decode-node"]
    history = prompt + first.json()["choices"][0]["token_ids"]
    turn = history + list(range(300_000, 300_100))  # the history, then the next message
    cached = (len(history) - 1) // BLOCK_TOKENS * BLOCK_TOKENS  # all but the last answer token's KV, whole blocks
    wait_for_prefix(holder, turn, BLOCK_TOKENS, cached)
    second = completion(url, prompt=turn, max_tokens=8)
    assert second.status_code == 200
    kairos = second.json()["kairos"]
    assert (kairos["route"], kairos["decode_node"]) == ("deflect", holder), kairos["reason"]
    assert sum(kairos["chunk_schedule"]) == len(turn) - cached  # priced and run as the uncached suffix
    assert int(second.headers["x-kairos-cached-tokens"]) == kairos["cached_tokens"] == cached


def test_openai_client_streams_and_not(live_app):
    url, _ = live_app
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    full = client.completions.create(model=MODEL, prompt="one two three four", max_tokens=6)
    assert full.usage.prompt_tokens == 4 and full.usage.completion_tokens == 6
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="one two", max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len([t for t in texts if t]) == 6
    assert chunks[-1].usage.completion_tokens == 6
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=3
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == 6 and chat.usage.completion_tokens == 3
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    deltas = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert len(deltas) == 4


def test_tokens_are_deterministic(live_app):
    url, _ = live_app
    text = completion(url, prompt="a b c", max_tokens=5).json()["choices"][0]["text"].split()
    ids = [int(t.removeprefix("tok")) for t in text]
    # token i of request r is token_id(r, i): consecutive tokens differ by a fixed step
    step = (token_id(0, 1) - token_id(0, 0)) % VOCAB
    assert all((b - a) % VOCAB == step for a, b in itertools.pairwise(ids))


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": MODEL, "prompt": "x", "temperature": -1}, "temperature"),
        ({"model": MODEL, "prompt": "x", "use_beam_search": True}, "use_beam_search"),
        ({"model": MODEL, "prompt": "x", "kv_transfer_params": {}}, "kv_transfer_params"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "n": 65}, "n"),
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": list(range(32_760)), "max_tokens": 100}, "prompt"),
    ],
)
def test_bad_requests_get_a_400_error_object(live_app, body, param):
    url, _ = live_app
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_an_unknown_model_is_a_404_naming_it(live_app):
    url, _ = live_app
    r = httpx.post(f"{url}/v1/completions", json={"model": "gpt-9", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_malformed_json_is_a_400_and_the_service_keeps_serving(live_app):
    url, _ = live_app
    r = httpx.post(f"{url}/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert completion(url, prompt="still here", max_tokens=2).status_code == 200


def test_overload_answers_429_with_retry_after_and_loses_nothing(live_app):
    url, _ = live_app

    # each runs for seconds (300 tokens), so the 90 overlap however fast the ingress takes them
    responses = at_once(url, 90, prompt=list(range(500)), max_tokens=300)
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 429}, codes
    for r in responses:
        if r.status_code == 429 and "x-kairos-shed" in r.headers:  # admission's: no route in time once queues grew
            assert int(r.headers["retry-after"]) >= 1 and "objective" in r.json()["error"]["message"]
        elif r.status_code == 429:  # the in-flight cap's (48 here)
            assert r.headers["retry-after"] == "1" and r.json()["error"]["message"].startswith("server busy")
        else:
            assert r.json()["usage"]["completion_tokens"] == 300  # every admitted request completes
    assert httpx.get(f"{url}/health").json()["in_flight"] == 0


SHED_PROMPT = 30_000  # its prefill alone takes 3.8 s on the A100 profile: past 0.9 x the 4 s objective everywhere


def test_a_request_no_route_serves_in_time_is_shed_at_once_with_429_and_retry_after(live_app):
    url, _ = live_app
    for stream in (False, True):
        body = {"model": MODEL, "prompt": list(range(SHED_PROMPT)), "max_tokens": 4, "stream": stream}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as shed:
            shed.read()
        assert shed.status_code == 429, shed.text
        assert shed.headers["x-kairos-shed"] == "no-route-in-time" and int(shed.headers["retry-after"]) >= 1
        error = shed.json()["error"]
        assert error["type"] == "rate_limit_error" and "time-to-first-token objective" in error["message"]
        assert "Traceback" not in shed.text
    # a prompt whose prefill fits the objective is served
    assert completion(url, prompt=list(range(SHED_PROMPT // 2)), max_tokens=4).status_code == 200
    assert httpx.get(f"{url}/health").json()["in_flight"] == 0


def test_a_list_of_prompts_is_one_choice_per_prompt_each_routed_on_its_own(live_app):
    url, _ = live_app
    prompts = [list(range(40)), list(range(3_000, 9_000)), [7, 8, 9]]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 5, "return_token_ids": True}
    whole = completion(url, **body)
    assert whole.status_code == 200, whole.text
    choices = whole.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2] and all(len(c["token_ids"]) == 5 for c in choices)
    assert all(c["kairos"]["decode_node"].startswith("decode-") for c in choices)  # each choice its own route
    assert whole.json()["usage"] == {"prompt_tokens": 40 + 6_000 + 3, "completion_tokens": 15, "total_tokens": 6_058}
    assert whole.headers["x-kairos-decode-node"] == choices[0]["kairos"]["decode_node"]  # the first prompt's
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True, "stream_options": {
            "include_usage": True}}, timeout=120) as r:  # fmt: skip
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert {e["id"] for e in events} == {events[0]["id"]}
    for index in range(3):  # each choice's tokens in order, closed by its finish reason
        own = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert sum(len(c["token_ids"]) for c in own) == 5 and own[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in own[:-1])
    assert events[-1]["usage"] == whole.json()["usage"] and events[-1]["choices"] == []
    assert httpx.get(f"{url}/health").json()["in_flight"] == 0


def test_n_samples_are_n_choices_and_the_prompt_is_counted_once(live_app):
    url, _ = live_app
    r = completion(url, prompt=list(range(60_000, 61_000)), max_tokens=4, n=3, seed=5)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2] and len({c["text"] for c in body["choices"]}) == 3
    assert body["usage"] == {"prompt_tokens": 1_000, "completion_tokens": 12, "total_tokens": 1_012}
    assert httpx.get(f"{url}/health").json()["in_flight"] == 0


@pytest.mark.parametrize("scored", [False, True], ids=["plain", "prompt_logprobs"])
def test_n_samples_build_their_prompt_s_kv_once(live_app, scored):
    """The first sample builds the prompt's KV (a deflection, or a prefill and a hand-off); the other three are
    deflected to its decode node, where all of the prompt's 16-token blocks but the one with its last token
    are cached, before that node has reported it. With prompt logprobs too: the first sample computes them
    (priced cache-blind, as vLLM reads no cache for it), the others read its blocks."""
    url, _ = live_app
    prompt = list(range(70_000, 76_000)) if not scored else list(range(80_000, 86_000))
    r = completion(url, prompt=prompt, max_tokens=4, n=4, seed=7, **({"prompt_logprobs": 1} if scored else {}))
    assert r.status_code == 200, r.text
    first, *rest = [c["kairos"] for c in r.json()["choices"]]
    for sample in rest:
        assert sample["route"] == "deflect" and sample["decode_node"] == first["decode_node"], (first, sample)
        assert sample["cached_tokens"] == (len(prompt) - 1) // 16 * 16, sample


def test_a_list_with_a_prompt_no_route_serves_in_time_is_shed_whole_and_lists_are_capped(live_app):
    url, _ = live_app
    fresh = list(range(400_000, 400_000 + SHED_PROMPT))  # no node holds any of it
    shed = completion(url, prompt=[list(range(10)), fresh], max_tokens=4)
    assert shed.status_code == 429 and shed.headers["x-kairos-shed"] == "no-route-in-time", shed.text
    capped = completion(url, prompt=["a b"] * 65, max_tokens=1)
    assert capped.status_code == 400 and capped.json()["error"]["param"] == "prompt"
    assert httpx.get(f"{url}/health").json()["in_flight"] == 0
    wait_for_no_residue()  # the prompt that was admitted took nothing it kept


def test_a_less_important_request_is_shed_first_and_an_important_one_served(live_app):
    url, _ = live_app
    # priority 40 may use 0.75 ** 40 of the objective (a few microseconds): no first token comes that soon
    low = completion(url, prompt=list(range(300)), max_tokens=4, priority=40)
    assert low.status_code == 429 and low.headers["x-kairos-shed"] == "priority", low.text
    assert completion(url, prompt=list(range(300)), max_tokens=4, priority=0).status_code == 200
    assert completion(url, prompt=list(range(300)), max_tokens=4, priority=-5).status_code == 200
    # the live view counts it by reason and by class, and the served ones in goodput
    deadline = time.monotonic() + 30
    while True:
        service = LiveState.from_json(httpx.get(f"{url}/kairos/state", timeout=30).json()).service
        if service.shed_by_priority.get("40") or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert service.shed.get("priority", 0) >= 1 and service.shed_by_priority.get("40", 0) >= 1
    assert service.goodput_rps > 0


def test_metrics_reach_the_prometheus_endpoint_and_cover_the_dashboard(live_app):
    url, metrics_url = live_app
    completion(url, prompt=list(range(1000)), max_tokens=4)
    assert completion(url, prompt=list(range(300)), max_tokens=4, priority=40).status_code == 429  # ray_kairos_shed
    queried = dashboard_series("ray_kairos_")  # the vLLM engines' ray_vllm_* series: test_ray_llm_config.py
    assert len(queried) >= 10
    text = wait_for_series(metrics_url, queried)
    assert 'route="prefill"' in text and 'node="decode-' in text


def test_prefill_nodes_free_handed_off_kv(live_app):
    url, _ = live_app
    for _ in range(3):
        assert completion(url, prompt=list(range(2000)), max_tokens=2).status_code == 200
    router = serve.get_deployment_handle("Router", app_name="kairos")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = router.snapshot.remote().result().values()
        pinned = [s.pinned_kv for s in states if s.role is Role.PREFILL]
        if len(pinned) == 2 and not any(pinned):
            return
        time.sleep(0.5)
    pytest.fail(f"prefill nodes still hold KV: {pinned}")


def test_no_serve_replica_loads_scikit_learn(live_app):
    """The fitter's scikit-learn is the router's actor's alone: the ingress, the router's Serve replica and the
    nodes load neither it nor, through vLLM's config, transformers' use of it, in the processes Serve really
    starts (it unpickles a replica's class and arguments in an order of its own; Ray imports the router's actor
    class wherever its handle is used)."""

    def loaded(_replica):
        import sys as replica_sys

        return sorted({name.split(".")[0] for name in replica_sys.modules} & {"sklearn", "vllm", "kairos_ray"})

    names = {
        deployment: replica_names("kairos", deployment) for deployment in ("Ingress", "Router", "prefill", "decode")
    }
    assert all(names.values()), names
    for deployment, replicas in names.items():
        for name in replicas:
            modules = ray.get(ray.get_actor(name, namespace="serve").__ray_call__.remote(loaded), timeout=60)
            assert "kairos_ray" in modules and "sklearn" not in modules, (name, modules)
            if deployment == "Ingress":
                assert "vllm" in modules  # vLLM's OpenAI protocol, the path that used to bring scikit-learn


def test_kairos_bench_replays_a_workload_against_the_app(live_app, tmp_path):

    url, _ = live_app
    out = tmp_path / "bench"
    kairos = Path(sys.executable).parent / "kairos"
    result = subprocess.run(
        [str(kairos), "bench", "--url", url, "--workload", "lpld", "--rps", "6", "--requests", "24",
         "--seed", "4", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "24 of 24 requests served" in result.stdout
    with (out / "summary.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert row["requests"] == "24" and row["failed"] == "0"
    assert float(row["p95_ttft_s"]) > 0 and float(row["p95_tbt_s"]) > 0
    with (out / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["route"] for r in rows} <= {"prefill", "deflect"} and len(rows) == 24
    assert all(float(r["ttft_s"]) > 0 and r["decode_node"].startswith("decode-") for r in rows)
    assert (out / "p95_ttft_vs_rps.png").exists()


def test_vllm_bench_serve_runs_unchanged(live_app, tmp_path):

    # vLLM's benchmark tokenizes its random prompts; a small byte-level BPE made here stands in for a hub download
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = ["load aware prefill deflection for disaggregated serving on ray with vllm engines"] * 20
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 32768}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))

    url, _ = live_app
    code = (
        "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
        "from vllm.benchmarks.serve import add_cli_args, main; "
        "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "--backend", "openai", "--base-url", url, "--model", MODEL,
         "--tokenizer", str(tmp_path), "--dataset-name", "random", "--random-input-len", "200",
         "--random-output-len", "16", "--num-prompts", "20", "--request-rate", "10", "--ignore-eos",
         "--ready-check-timeout-sec", "60"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"Successful requests:\s+20\b", result.stdout), result.stdout[-3000:]
    assert re.search(r"Failed requests:\s+0\b", result.stdout)
