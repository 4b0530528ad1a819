"""OpenAI response bodies and server-sent events for a served request, plus Kairos's route report.

Every response carries the route in ``x-kairos-*`` headers and in a
``kairos`` field of the body (the first chunk of a stream), which OpenAI
clients ignore.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from kairos_ray.messages import TokenEvent
from kairos_ray.serve.dispatch import RouteTaken
from kairos_ray.serve.protocol import error_body


def route_headers(route: RouteTaken) -> dict[str, str]:
    return {
        "x-kairos-route": route.route.value,
        "x-kairos-prefill-node": route.prefill_node or "",  # empty when deflected
        "x-kairos-decode-node": route.decode_node,
        "x-kairos-chunk-schedule": ",".join(str(c) for c in route.chunk_schedule),
        "x-kairos-kv-transport": route.kv_transport,  # empty when deflected
        "x-kairos-ttft-s": f"{route.ttft_s:.6f}",
        "x-kairos-breakdown": ";".join(
            f"{name[:-2]}={getattr(route.breakdown, name):.6f}"
            for name in ("prefill_queue_s", "prefill_exec_s", "kv_transfer_s", "decode_queue_s")
        ),
        "x-kairos-reason": route.reason,
        "x-kairos-fallback": "1" if route.fallback else "0",
    }


def route_field(route: RouteTaken) -> dict[str, Any]:
    """The body's ``kairos`` field."""
    b = route.breakdown
    return {
        "route": route.route.value,
        "prefill_node": route.prefill_node,
        "decode_node": route.decode_node,
        "chunk_schedule": list(route.chunk_schedule),
        "kv_transport": route.kv_transport,
        "ttft_s": route.ttft_s,
        "breakdown": {
            "prefill_queue_s": b.prefill_queue_s,
            "prefill_exec_s": b.prefill_exec_s,
            "kv_transfer_s": b.kv_transfer_s,
            "decode_queue_s": b.decode_queue_s,
        },
        "reason": route.reason,
        "fallback": route.fallback,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseWriter:
    """Bodies of one request's response, non-streamed or as server-sent events."""

    def __init__(
        self, model_id: str, chat: bool, route: RouteTaken, prompt_tokens: int, continuous_usage: bool = False
    ) -> None:
        self.model_id, self.chat, self.route, self.prompt_tokens = model_id, chat, route, prompt_tokens
        self.continuous_usage = continuous_usage  # usage in every token event
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{route.request_id}"
        self.created = int(time.time())

    def full(self, tokens: Sequence[TokenEvent]) -> dict[str, Any]:
        """The whole response body of a request that was not streamed."""
        text = "".join(t.text for t in tokens)
        choice: dict[str, Any] = {"index": 0, "finish_reason": tokens[-1].finish_reason or "length", "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model_id,
            "choices": [choice],
            "usage": usage(self.prompt_tokens, len(tokens)),
            "kairos": route_field(self.route),
        }

    def _event(self, body: dict[str, Any]) -> str:
        return f"data: {json.dumps(body)}\n\n"

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model_id,
            "choices": choices,
            **extra,
        }

    def token(self, event: TokenEvent) -> str:
        """The event of one streamed token; the first carries the ``kairos`` field."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
        if self.chat:
            choice["delta"] = {"content": event.text}
            if event.index == 0:
                choice["delta"]["role"] = "assistant"
        else:
            choice["text"] = event.text
        if event.finished:
            choice["finish_reason"] = event.finish_reason or "length"
        extra: dict[str, Any] = {"kairos": route_field(self.route)} if event.index == 0 else {}
        if self.continuous_usage:
            extra["usage"] = usage(self.prompt_tokens, event.index + 1)
        return self._event(self._chunk([choice], **extra))

    def usage(self, completion_tokens: int) -> str:
        """The closing usage event (``stream_options.include_usage``)."""
        return self._event(self._chunk([], usage=usage(self.prompt_tokens, completion_tokens)))

    def error(self, message: str) -> str:
        """An OpenAI error object as a stream event: the stream cannot go on (``[DONE]`` follows)."""
        return self._event(error_body(message, None, "server_error", 503))

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"
