"""OpenAI-compatible ingress: validate, admit, ask the router, run the route, stream the tokens.

One request's path:

1. validate the body (400 with an OpenAI error object otherwise) and count
   its prompt tokens; prompt + max_tokens must fit the context;
2. admit it if fewer than ``max_in_flight`` requests are in flight, else 429
   with ``Retry-After``;
3. ask the router (``decision_timeout_s``); if it cannot decide, fall back to
   plain disaggregation over round-robin nodes and count the fallback;
4. ``deflect``: stream from the chosen decode node, which prefills in place per
   the chunk schedule; ``prefill``: the prefill node prefills and returns a KV
   hand-off (a Ray object reference), the decode node fetches the KV and streams;
5. answer with the route, nodes and TTFT breakdown in ``x-kairos-*`` headers and
   in a ``kairos`` field of the body, which OpenAI clients ignore.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from kairos_ray.engines import EngineRequest, TokenEvent
from kairos_ray.serve.args import ServingConfig
from kairos_ray.serve.metrics import IngressMetrics
from kairos_ray.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body
from kairos_ray.serve.tokens import PromptTokenizer

logger = logging.getLogger("ray.serve")
app = FastAPI(title="Kairos-Ray", description="OpenAI-compatible serving with load-aware prefill deflection")

BREAKDOWN = ("prefill_queue_s", "prefill_exec_s", "kv_transfer_s", "decode_queue_s")


def _error(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(message, param, kind), status_code=status, headers=headers)


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    return f"{param}: {err['msg']} (got {err.get('input')!r})" if param else err["msg"], param


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=2048)
@serve.ingress(app)
class Ingress:
    def __init__(
        self,
        router: DeploymentHandle,
        prefill: DeploymentHandle,
        decode: DeploymentHandle,
        model_id: str,
        serving: dict[str, Any],
        tokenizer: str | None = None,
    ) -> None:
        self.router, self.prefill, self.decode = router, prefill, decode  # the pools: calls name their node
        self.model_id = model_id
        self.tokenize = PromptTokenizer(tokenizer)
        self.opts = ServingConfig.model_validate(serving)
        self.in_flight = 0
        self._ids = itertools.count(random.getrandbits(30) << 20)
        self.metrics = IngressMetrics()

    # ---- plain endpoints -------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict[str, Any]:
        return {"status": "ok", "in_flight": self.in_flight}

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "owned_by": "kairos-ray"}]}

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest, chat=True)

    # ---- one request -------------------------------------------------------------------------

    async def _serve(
        self, request: Request, kind: type[CompletionRequest | ChatCompletionRequest], chat: bool
    ) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            self.metrics.rejected.inc(tags={"reason": "bad-request"})
            return _error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            self.metrics.rejected.inc(tags={"reason": "bad-request"})
            return _error(400, "request body must be a JSON object")
        try:
            req = kind.model_validate(body)
        except ValidationError as exc:
            self.metrics.rejected.inc(tags={"reason": "bad-request"})
            return _error(400, *_validation_message(exc))
        if req.model != self.model_id:
            self.metrics.rejected.inc(tags={"reason": "bad-request"})
            return _error(400, f"model {req.model!r} is not served here; available: {self.model_id!r}", "model")
        try:
            prompt_tokens, prompt_ids = self.tokenize(req)
        except ValueError as exc:
            self.metrics.rejected.inc(tags={"reason": "bad-request"})
            return _error(400, str(exc), "messages" if chat else "prompt")
        if prompt_tokens + req.output_tokens > self.opts.context_tokens:
            self.metrics.rejected.inc(tags={"reason": "bad-request"})
            return _error(
                400,
                f"prompt ({prompt_tokens} tokens) plus max_tokens ({req.output_tokens}) exceeds the "
                f"{self.opts.context_tokens}-token context",
                "prompt" if not chat else "messages",
            )
        if self.in_flight >= self.opts.max_in_flight:
            self.metrics.rejected.inc(tags={"reason": "overload"})
            return _error(
                429,
                f"server busy: {self.in_flight} requests in flight; retry after {self.opts.retry_after_s} s",
                headers={"Retry-After": str(self.opts.retry_after_s)},
            )
        self.in_flight += 1
        try:
            started = await self._start(
                EngineRequest(
                    next(self._ids),
                    prompt_tokens,
                    req.output_tokens,
                    time.time(),
                    prompt_token_ids=prompt_ids,
                    sampling=req.sampling(),
                )
            )
        except Exception as exc:
            self.in_flight -= 1
            logger.exception("request failed before its first token")
            return _error(500, f"request failed: {type(exc).__name__}: {exc}")
        route, first, stream = started
        headers = self._headers(route)
        if req.stream:
            return StreamingResponse(
                self._sse(req, chat, route, first, stream, prompt_tokens),
                media_type="text/event-stream",
                headers=headers,
            )
        try:
            tokens = [first]
            tokens += [event async for event in self._timed(stream, route)]
        finally:
            self.in_flight -= 1
        body_out = self._full_response(chat, tokens, prompt_tokens, route)
        return JSONResponse(body_out, headers=headers)

    async def _decide(self, request: EngineRequest) -> dict[str, Any]:
        try:
            return await asyncio.wait_for(
                self.router.decide.remote(request.request_id, request.prompt_tokens), self.opts.decision_timeout_s
            )
        except Exception as exc:  # the router cannot decide: plain disaggregation on any nodes, counted
            self.metrics.fallbacks.inc(tags={"route": "prefill", "reason": "fallback"})
            logger.warning("router could not decide (%s: %s); disaggregating", type(exc).__name__, exc)
            return {
                "route": "prefill",
                "prefill_node": None,
                "decode_node": None,
                "chunk_schedule": (),
                "reason": f"fallback: {type(exc).__name__}",
                "fallback": True,
            }

    async def _start(self, request: EngineRequest) -> tuple[dict[str, Any], TokenEvent, AsyncIterator[TokenEvent]]:
        """Route the request and wait for its first token: (route info, first token, the rest)."""
        decision = await self._decide(request)
        decode = self.decode.options(stream=True)
        if decision["route"] == "deflect":
            request = dataclasses.replace(request, chunk_schedule=tuple(decision["chunk_schedule"]))
            stream = decode.generate.remote(request, None, node=decision["decode_node"])
        else:
            request = dataclasses.replace(request, kv_receiver=decision["decode_node"] or "")
            handoff = await self.prefill.prefill.remote(request, node=decision["prefill_node"])
            decision["prefill_node"] = handoff.node_id  # where it ran (the chosen node unless that one is gone)
            decision["kv_transport"] = handoff.transport
            stream = decode.generate.remote(request, handoff, node=decision["decode_node"])
        iterator = stream.__aiter__()
        first: TokenEvent = await iterator.__anext__()
        decision["decode_node"] = first.node_id
        if decision["route"] != "deflect":  # the decode node has the KV: free it on the prefill node
            self.prefill.release.remote(request.request_id, node=decision["prefill_node"])
        ttft = time.time() - request.arrival_wall_s
        timings = {name: first.timings.get(name, 0.0) for name in BREAKDOWN}
        # What the engines did not time (routing, RPCs) is waiting before the prefill starts.
        timings["prefill_queue_s"] += max(0.0, ttft - sum(timings.values()))
        self.metrics.ttft.observe(ttft, tags={"route": decision["route"]})
        route = {
            **decision,
            "request_id": request.request_id,
            "ttft_s": ttft,
            "breakdown": timings,
            "last_token_s": time.monotonic(),
        }
        return route, first, iterator

    async def _timed(self, stream: AsyncIterator[TokenEvent], route: dict[str, Any]) -> AsyncIterator[TokenEvent]:
        """The remaining tokens, observing every gap."""
        async for event in stream:
            now = time.monotonic()
            self.metrics.tbt.observe(now - route["last_token_s"], tags={"route": route["route"]})
            route["last_token_s"] = now
            yield event

    def _headers(self, route: dict[str, Any]) -> dict[str, str]:
        schedule = route.get("chunk_schedule") or ()
        return {
            "x-kairos-route": route["route"],
            "x-kairos-prefill-node": route.get("prefill_node") or "",  # empty when deflected
            "x-kairos-decode-node": route["decode_node"],
            "x-kairos-chunk-schedule": ",".join(str(c) for c in schedule),
            "x-kairos-kv-transport": route.get("kv_transport", ""),  # empty when deflected
            "x-kairos-ttft-s": f"{route['ttft_s']:.6f}",
            "x-kairos-breakdown": ";".join(f"{k[:-2]}={v:.6f}" for k, v in route["breakdown"].items()),
            "x-kairos-reason": route.get("reason", ""),
            "x-kairos-fallback": "1" if route.get("fallback") else "0",
        }

    @staticmethod
    def _kairos_field(route: dict[str, Any]) -> dict[str, Any]:
        return {
            "route": route["route"],
            "prefill_node": route.get("prefill_node"),
            "decode_node": route["decode_node"],
            "chunk_schedule": list(route.get("chunk_schedule") or ()),
            "kv_transport": route.get("kv_transport", ""),
            "ttft_s": route["ttft_s"],
            "breakdown": route["breakdown"],
            "reason": route.get("reason", ""),
            "fallback": bool(route.get("fallback")),
        }

    def _full_response(
        self, chat: bool, tokens: list[TokenEvent], prompt_tokens: int, route: dict[str, Any]
    ) -> dict[str, Any]:
        text = "".join(t.text for t in tokens)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(tokens),
            "total_tokens": prompt_tokens + len(tokens),
        }
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{route['request_id']}"
        choice: dict[str, Any] = {"index": 0, "finish_reason": tokens[-1].finish_reason or "length", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_id,
            "choices": [choice],
            "usage": usage,
            "kairos": self._kairos_field(route),
        }

    async def _sse(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        chat: bool,
        route: dict[str, Any],
        first: TokenEvent,
        stream: AsyncIterator[TokenEvent],
        prompt_tokens: int,
    ) -> AsyncIterator[str]:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{route['request_id']}"
        created = int(time.time())
        count = 0

        def chunk(event: TokenEvent | None, extra: dict[str, Any] | None = None) -> str:
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
            text = event.text if event is not None else ""
            if chat:
                choice["delta"] = {"content": text} if event is not None else {}
                if event is not None and event.index == 0:
                    choice["delta"]["role"] = "assistant"
            else:
                choice["text"] = text
            if event is not None and event.finished:
                choice["finish_reason"] = event.finish_reason or "length"
            body: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": self.model_id,
                "choices": [choice],
                **(extra or {}),
            }
            return f"data: {json.dumps(body)}\n\n"

        try:
            count = 1
            yield chunk(first, {"kairos": self._kairos_field(route)})
            async for event in self._timed(stream, route):
                count += 1
                yield chunk(event)
            if req.include_usage:
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": count,
                    "total_tokens": prompt_tokens + count,
                }
                body: dict[str, Any] = {
                    "id": rid,
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created,
                    "model": self.model_id,
                    "choices": [],
                    "usage": usage,
                }
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1
