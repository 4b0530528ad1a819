"""OpenAI-compatible ingress: authenticate, admit, validate, dispatch, stream the tokens.

One request's path:

1. the API key, when one is set (``serve.auth``): 401 otherwise;
2. admission, before any expensive work: a slot if fewer than
   ``max_in_flight`` requests are in flight, else 429 with ``Retry-After``;
   the slot is released exactly once however the request ends
   (``serve.admission``);
3. the body: 413 past ``max_body_bytes``; parsed, rendered and turned into
   vLLM ``SamplingParams`` as vLLM's OpenAI server does it (``serve.tokens``),
   a 400 with an OpenAI error object naming the field for anything vLLM's
   server refuses or the app does not serve (``serve.protocol``); large
   bodies are parsed off the event loop, prompts tokenized on vLLM's
   renderer's threads;
4. the request runs over the router and the pools (``serve.dispatch``), with
   retries before its first token and migrations after it; what cannot be
   served is a 503/504 error object before the first byte, an SSE ``error``
   event then ``[DONE]`` after it;
5. the answer, streamed or not (``serve.responses``), reports the route,
   nodes and TTFT breakdown in ``x-kairos-*`` headers and in a ``kairos``
   field of the body, which OpenAI clients ignore.

A client that goes away cancels its request: the engines abort it and the
prefill node releases its KV.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from kairos_ray.messages import EngineRequest, TokenEvent
from kairos_ray.serve.admission import Admission, GuardedStream
from kairos_ray.serve.args import ServingConfig
from kairos_ray.serve.auth import ApiKeys
from kairos_ray.serve.dispatch import Dispatcher, RequestFailed, RequestRun, ServingLimits, StreamBroken
from kairos_ray.serve.live import live_state
from kairos_ray.serve.metrics import IngressMetrics
from kairos_ray.serve.protocol import PreparedRequest, RequestError, error_body
from kairos_ray.serve.responses import ResponseWriter, route_headers
from kairos_ray.serve.tokens import Preprocessor

logger = logging.getLogger("ray.serve")
app = FastAPI(title="Kairos-Ray", description="OpenAI-compatible serving with load-aware prefill deflection")

OFF_LOOP_BYTES = 64 << 10  # bodies at least this large are parsed in a thread


def _error(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = {401: "authentication_error", 413: "invalid_request_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return JSONResponse(error_body(message, param, kind, status), status_code=status, headers=headers)


def _parse(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError(400, "request body is not valid JSON") from None
    except RecursionError:
        raise RequestError(400, "request body is nested too deeply") from None


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
        model_source: str | None = None,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.model_id = model_id
        self.opts = opts = ServingConfig.model_validate(serving)
        self.preprocess = Preprocessor(model_id, opts.context_tokens, model_source, engine_kwargs)
        self.keys = ApiKeys.gather(opts.api_keys, opts.api_key_env, opts.api_key_file)
        if opts.require_api_key and not self.keys.required:
            raise ValueError(
                f"serving.require_api_key is set but no API key was found (serving.api_keys, the environment "
                f"variable {opts.api_key_env} or serving.api_key_file)"
            )
        self.admission = Admission(opts.max_in_flight)
        self._ids = itertools.count(random.getrandbits(30) << 20)
        self.metrics = IngressMetrics()
        limits = ServingLimits(
            opts.decision_timeout_s,
            opts.first_token_timeout_s,
            opts.token_stall_timeout_s,
            opts.max_attempts,
            opts.max_migrations,
        )
        self.router = router
        listener = f"{serve.get_replica_context().replica_id.unique_id}-{secrets.token_hex(4)}"
        self.dispatcher = Dispatcher(router, prefill, decode, limits, self.metrics, listener)

    # ---- plain endpoints -------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict[str, Any]:
        return {"status": "ok", "in_flight": self.admission.in_flight}

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        if not self.keys.allows(request.headers.get("authorization")):
            return self._unauthorized()
        data = [{"id": self.model_id, "object": "model", "owned_by": "kairos-ray"}]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    @app.get("/kairos/state")
    async def kairos_state(self, request: Request) -> Response:
        """The live view ``kairos top`` shows: ``messages.LiveState`` as JSON (503 if the router does not answer)."""
        if not self.keys.allows(request.headers.get("authorization")):
            return self._unauthorized()
        try:
            return JSONResponse(await live_state(self.router, self.metrics.window))
        except Exception as exc:  # whatever keeps the router from answering
            return _error(503, f"the router did not answer: {type(exc).__name__}: {exc}")

    # ---- one request -------------------------------------------------------------------------

    def _unauthorized(self) -> JSONResponse:
        self.metrics.rejected.inc(tags={"reason": "unauthorized"})
        return _error(
            401, "a valid API key is required: Authorization: Bearer <key>", headers={"WWW-Authenticate": "Bearer"}
        )

    async def _serve(self, request: Request, chat: bool) -> Response:
        if not self.keys.allows(request.headers.get("authorization")):
            return self._unauthorized()
        slot = self.admission.try_acquire()
        if slot is None:
            self.metrics.rejected.inc(tags={"reason": "overload"})
            retry_s = self.opts.retry_after_s
            message = f"server busy: {self.admission.in_flight} requests in flight; retry after {retry_s} s"
            return _error(429, message, headers={"Retry-After": str(retry_s)})
        streaming = False
        try:
            try:
                prepared = await self._validated(request, chat)
            except RequestError as bad:
                reason = "too-large" if bad.status == 413 else "bad-request"
                self.metrics.rejected.inc(tags={"reason": reason})
                return _error(bad.status, bad.message, bad.param)
            engine_request = EngineRequest(
                next(self._ids),
                prepared.prompt_tokens,
                prepared.max_tokens,
                time.time(),
                prompt_token_ids=prepared.prompt_token_ids,
                # emulated engines ignore it (and so need no vLLM to unpickle it)
                sampling=prepared.sampling if self.preprocess.vllm else None,
                priority=prepared.priority,
                cache_salt=prepared.cache_salt,
            )
            run = self.dispatcher.run(engine_request)
            try:
                first = await run.start()
            except RequestFailed as failed:
                logger.warning("request %s failed: %s", engine_request.request_id, failed.message)
                return _error(failed.status, failed.message)
            except BaseException:
                run.close()
                raise
            assert run.route is not None
            writer = ResponseWriter(self.model_id, run.route, prepared)
            headers = route_headers(run.route)
            if prepared.options.stream:

                def done() -> None:
                    run.close()
                    slot.release()

                events = self._sse(writer, run, first)
                streaming = True
                return GuardedStream(events, done, media_type="text/event-stream", headers=headers)
            try:
                tokens = list(first)
                async for ready in self._timed(run):
                    tokens += ready
            except StreamBroken as broken:
                return _error(503, f"request failed after its first token: {broken}")
            finally:
                run.close()
            return JSONResponse(writer.full(tokens), headers=headers)
        finally:
            if not streaming:
                slot.release()

    async def _validated(self, request: Request, chat: bool) -> PreparedRequest:
        """The request, parsed, rendered and checked as vLLM's server does it; raises ``RequestError``."""
        body = await self._body(request)
        off_loop = len(body) >= OFF_LOOP_BYTES
        data = await asyncio.to_thread(_parse, body) if off_loop else _parse(body)
        return await self.preprocess.prepare(data, chat, off_loop)

    async def _body(self, request: Request) -> bytes:
        """The raw body, refused with 413 as soon as it passes ``max_body_bytes``."""
        limit = self.opts.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise RequestError(413, f"request body of {int(declared)} bytes exceeds the {limit}-byte limit")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(413, f"request body exceeds the {limit}-byte limit")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _timed(self, run: RequestRun) -> AsyncIterator[list[TokenEvent]]:
        """The tokens after the first ones, observing every gap (tokens that come together: a gap of 0)."""
        tags = {"route": run.route.route.value if run.route else ""}
        last_s = time.monotonic()
        observe = self.metrics.tbt.observe
        async for ready in run.rest():
            now = time.monotonic()
            observe(now - last_s, tags=tags)
            for _ in range(len(ready) - 1):
                observe(0.0, tags=tags)
            last_s = now
            yield ready

    async def _sse(self, writer: ResponseWriter, run: RequestRun, first: list[TokenEvent]) -> AsyncGenerator[str, None]:
        """One event per token (or group); the tokens that come together go out in one write."""
        count = len(first)
        yield writer.tokens(first)
        try:
            async for ready in self._timed(run):
                count += len(ready)
                yield writer.tokens(ready)
        except StreamBroken as broken:
            yield writer.error(f"request failed after {count} tokens: {broken}")
        else:
            if writer.options.include_usage:
                yield writer.usage(count)
        yield writer.done()
