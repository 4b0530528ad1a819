"""The ingress's response shapes, without Serve: OpenAI bodies, server-sent events and the route report.

The whole ingress under real Serve and HTTP clients is in ``test_app.py``.
"""

import json

import pytest

from kairos_ray.core import Route
from kairos_ray.messages import TokenEvent, TTFTBreakdown
from kairos_ray.serve.auth import ApiKeys
from kairos_ray.serve.dispatch import RouteTaken
from kairos_ray.serve.responses import ResponseWriter, route_headers

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


def events(lines: list[str]) -> list[dict]:
    assert all(line.startswith("data: ") and line.endswith("\n\n") for line in lines)
    return [json.loads(line[6:]) for line in lines if line != "data: [DONE]\n\n"]


@pytest.mark.parametrize("route", [DEFLECTED, HANDED_OFF])
def test_headers_report_the_route_and_a_breakdown_that_adds_up(route):
    headers = route_headers(route)
    parts = dict(item.split("=") for item in headers["x-kairos-breakdown"].split(";"))
    assert set(parts) == {"prefill_queue", "prefill_exec", "kv_transfer", "decode_queue"}
    assert sum(map(float, parts.values())) == pytest.approx(float(headers["x-kairos-ttft-s"]))
    assert headers["x-kairos-route"] == route.route.value
    assert headers["x-kairos-prefill-node"] == (route.prefill_node or "")
    assert headers["x-kairos-chunk-schedule"] == ",".join(map(str, route.chunk_schedule))
    assert headers["x-kairos-kv-transport"] == route.kv_transport
    assert headers["x-kairos-fallback"] == ("1" if route.fallback else "0")


def test_a_full_completion_body_counts_its_tokens_and_carries_the_route():
    body = ResponseWriter("m", False, DEFLECTED, prompt_tokens=1636).full(tokens(3))
    assert body["id"] == "cmpl-42" and body["object"] == "text_completion" and body["model"] == "m"
    (choice,) = body["choices"]
    assert choice["text"] == " t0 t1 t2" and choice["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 1636, "completion_tokens": 3, "total_tokens": 1639}
    assert body["kairos"]["route"] == "deflect" and body["kairos"]["chunk_schedule"] == [1024, 512, 100]


def test_a_chat_stream_opens_with_the_role_and_the_route_and_closes_with_usage():
    writer = ResponseWriter("m", True, HANDED_OFF, prompt_tokens=7)
    lines = [writer.token(t) for t in tokens(3)] + [writer.usage(3), writer.done()]
    assert lines[-1] == "data: [DONE]\n\n"
    chunks = events(lines)
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


def test_continuous_usage_counts_the_tokens_so_far_in_every_event():
    writer = ResponseWriter("m", False, DEFLECTED, prompt_tokens=10, continuous_usage=True)
    chunks = events([writer.token(t) for t in tokens(3)])
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3]
    assert all(c["usage"]["prompt_tokens"] == 10 for c in chunks)
    plain = events([ResponseWriter("m", False, DEFLECTED, prompt_tokens=10).token(tokens(1)[0])])
    assert "usage" not in plain[0]
