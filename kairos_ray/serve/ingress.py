"""OpenAI-compatible ingress: validate, admit, dispatch, stream the tokens.

One request's path:

1. validate the body (400 with an OpenAI error object otherwise) and count
   its prompt tokens (``serve.tokens``); prompt + max_tokens must fit the context;
2. admit it if fewer than ``max_in_flight`` requests are in flight, else 429
   with ``Retry-After``;
3. run it over the router and the pools until its first token (``serve.dispatch``);
4. answer, streamed or not (``serve.responses``), with the route, nodes and
   TTFT breakdown in ``x-kairos-*`` headers and in a ``kairos`` field of the
   body, which OpenAI clients ignore.
"""

from __future__ import annotations

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

from kairos_ray.messages import EngineRequest, TokenEvent
from kairos_ray.serve.args import ServingConfig
from kairos_ray.serve.dispatch import Dispatcher, Started
from kairos_ray.serve.live import live_state
from kairos_ray.serve.metrics import IngressMetrics
from kairos_ray.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body
from kairos_ray.serve.responses import ResponseWriter, route_headers
from kairos_ray.serve.tokens import PromptTokenizer

logger = logging.getLogger("ray.serve")
app = FastAPI(title="Kairos-Ray", description="OpenAI-compatible serving with load-aware prefill deflection")


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
        self.model_id = model_id
        self.tokenize = PromptTokenizer(tokenizer)
        self.opts = ServingConfig.model_validate(serving)
        self.in_flight = 0
        self._ids = itertools.count(random.getrandbits(30) << 20)
        self.metrics = IngressMetrics()
        self.dispatcher = Dispatcher(router, prefill, decode, self.opts.decision_timeout_s, self.metrics)

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

    @app.get("/kairos/state")
    async def kairos_state(self) -> Response:
        """The live view ``kairos top`` shows: ``messages.LiveState`` as JSON (503 if the router does not answer)."""
        try:
            return JSONResponse(await live_state(self.dispatcher.router, self.metrics.window))
        except Exception as exc:  # whatever keeps the router from answering
            return _error(503, f"the router did not answer: {type(exc).__name__}: {exc}")

    # ---- one request -------------------------------------------------------------------------

    def _bad_request(self, message: str, param: str | None = None) -> JSONResponse:
        self.metrics.rejected.inc(tags={"reason": "bad-request"})
        return _error(400, message, param)

    async def _serve(
        self, request: Request, kind: type[CompletionRequest | ChatCompletionRequest], chat: bool
    ) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self._bad_request("request body is not valid JSON")
        if not isinstance(body, dict):
            return self._bad_request("request body must be a JSON object")
        try:
            req = kind.model_validate(body)
        except ValidationError as exc:
            return self._bad_request(*_validation_message(exc))
        if req.model != self.model_id:
            return self._bad_request(f"model {req.model!r} is not served here; available: {self.model_id!r}", "model")
        prompt_param = "messages" if chat else "prompt"
        try:
            prompt_tokens, prompt_ids = self.tokenize(req)
        except ValueError as exc:
            return self._bad_request(str(exc), prompt_param)
        if prompt_tokens + req.output_tokens > self.opts.context_tokens:
            return self._bad_request(
                f"prompt ({prompt_tokens} tokens) plus max_tokens ({req.output_tokens}) exceeds the "
                f"{self.opts.context_tokens}-token context",
                prompt_param,
            )
        if self.in_flight >= self.opts.max_in_flight:
            self.metrics.rejected.inc(tags={"reason": "overload"})
            return _error(
                429,
                f"server busy: {self.in_flight} requests in flight; retry after {self.opts.retry_after_s} s",
                headers={"Retry-After": str(self.opts.retry_after_s)},
            )
        self.in_flight += 1
        engine_request = EngineRequest(
            next(self._ids),
            prompt_tokens,
            req.output_tokens,
            time.time(),
            prompt_token_ids=prompt_ids,
            sampling=req.sampling(),
        )
        try:
            started = await self.dispatcher.start(engine_request)
        except Exception as exc:
            self.in_flight -= 1
            logger.exception("request failed before its first token")
            return _error(500, f"request failed: {type(exc).__name__}: {exc}")
        writer = ResponseWriter(self.model_id, chat, started.route, prompt_tokens)
        headers = route_headers(started.route)
        if req.stream:
            return StreamingResponse(
                self._sse(writer, started, req.include_usage), media_type="text/event-stream", headers=headers
            )
        try:
            tokens = [started.first]
            tokens += [event async for event in self._timed(started)]
        finally:
            self.in_flight -= 1
        return JSONResponse(writer.full(tokens), headers=headers)

    async def _timed(self, started: Started) -> AsyncIterator[TokenEvent]:
        """The tokens after the first, observing every gap."""
        route = started.route.route.value
        last_s = time.monotonic()
        async for event in started.rest:
            now = time.monotonic()
            self.metrics.tbt.observe(now - last_s, tags={"route": route})
            last_s = now
            yield event

    async def _sse(self, writer: ResponseWriter, started: Started, include_usage: bool) -> AsyncIterator[str]:
        try:
            count = 1
            yield writer.token(started.first)
            async for event in self._timed(started):
                count += 1
                yield writer.token(event)
            if include_usage:
                yield writer.usage(count)
            yield writer.done()
        finally:
            self.in_flight -= 1
