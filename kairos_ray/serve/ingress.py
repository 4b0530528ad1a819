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
4. the router decides its route, and admission may shed it (``core.admission``:
   no route would give its first token within the TTFT objective): 429 at
   once with ``Retry-After`` from the estimated drain, nothing taken;
5. the request runs over the router and the pools (``serve.dispatch``) (a
   request of several choices, ``n`` samples or a list of prompts: a run per
   choice, each in an admission place, concurrently), with
   retries before its first token and migrations after it; what cannot be
   served is a 503/504 error object before the first byte, an SSE ``error``
   event then ``[DONE]`` after it;
6. the answer, streamed or not (``serve.responses``), reports the route,
   nodes and TTFT breakdown in ``x-kairos-*`` headers and in a ``kairos``
   field of the body, which OpenAI clients ignore.

A client that goes away cancels its request: the engines abort it and the
prefill node releases its KV.

``/v1/responses`` (text in and out) runs as a chat and answers as vLLM's
server does (``serve.responses_api``). ``/tokenize``, ``/detokenize`` and
``/version`` answer as vLLM's server does, behind the API key; no engine is
called.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import random
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle
from vllm import __version__ as VLLM_VERSION

from kairos_ray import __version__
from kairos_ray.config import SLOConfig
from kairos_ray.messages import SHED_HEADER, EngineRequest, Residue, TokenEvent
from kairos_ray.metrics import TBT_ALLOWED_SHARE
from kairos_ray.serve.admission import Admission, GuardedStream
from kairos_ray.serve.args import ServingConfig
from kairos_ray.serve.auth import ApiKeys
from kairos_ray.serve.delivery import NodeGroups
from kairos_ray.serve.dispatch import (
    Dispatcher,
    RequestFailed,
    RequestRun,
    RouteTaken,
    ServingLimits,
    Shed,
    StreamBroken,
)
from kairos_ray.serve.live import live_state
from kairos_ray.serve.metrics import IngressMetrics
from kairos_ray.serve.protocol import PreparedRequest, RequestError, error_body
from kairos_ray.serve.responses import (
    Exposure,
    ResponseWriter,
    batch_body,
    prompt_tokens,
    reasoning_tokens,
    route_headers,
)
from kairos_ray.serve.responses_api import ResponsesWriter
from kairos_ray.serve.tokens import Preprocessor

logger = logging.getLogger("ray.serve")
_T = TypeVar("_T")
# FastAPI's own /docs and /openapi.json are off: they are served below, to admin keys, when ``serving.api_docs``
app = FastAPI(
    title="Kairos-Ray",
    description="OpenAI-compatible serving with load-aware prefill deflection",
    openapi_url=None,
    docs_url=None,
    redoc_url=None,
)

# Bodies at least this large are parsed in a thread. Parsing holds the GIL either way (JSON and vLLM's request
# models are C and Rust), so a thread spares the other requests little and costs this one a trip through the busy
# loop per hop: a full context's prompt (about 250 KB of token ids) is parsed on the loop.
OFF_LOOP_BYTES = 512 << 10
# Serve's proxy reads these from the client and would let it keep its request running after it left, or past
# Serve's request_timeout_s: a request that carries one is refused before any work starts.
PROXY_HEADERS = ("x-request-disconnect-disabled", "x-request-timeout-seconds")


def _error(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = {
        401: "authentication_error",
        403: "permission_error",
        408: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
    }.get(status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse(error_body(message, param, kind, status), status_code=status, headers=headers)


@dataclass(slots=True)
class _Gaps:
    """One request's gaps between tokens after its first: how many, and how many over the TBT objective."""

    count: int = 0
    over: int = 0


def _parse(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError(400, "request body is not valid JSON") from None
    except RecursionError:
        raise RequestError(400, "request body is nested too deeply") from None


def _failed(future: asyncio.Future[Any]) -> bool:
    """A call that is over without an answer (an answer to ask again for, not to share)."""
    return future.done() and (future.cancelled() or future.exception() is not None)


def _route(run: RequestRun) -> RouteTaken:
    """The route of a request that has its first token."""
    assert run.route is not None
    return run.route


async def _started(runs: list[RequestRun], prompts: tuple[PreparedRequest, ...]) -> list[list[TokenEvent]]:
    """The first tokens of each of a request's runs (a prompt's ``n`` samples in a row): the prompts' first
    samples at once, each prompt's other samples once its first sample's KV is built, the router told which
    decode node holds that KV (before the node's own report says so), so that a prefix-aware policy prices them
    there as the prompt's uncached suffix rather than build its KV again. The prompt's logprobs, if asked for,
    are its first sample's (the others run without them: ``tokens._sample``)."""
    groups: list[list[int]] = []  # the runs of each prompt, its first sample's first
    for index, prompt in enumerate(prompts):
        if prompt.sample == 0:
            groups.append([])
        groups[-1].append(index)
    firsts: list[list[TokenEvent]] = [[] for _ in runs]

    async def samples(group: list[int]) -> None:
        head, *rest = group
        firsts[head] = await runs[head].start()
        held_on = _route(runs[head]).decode_node
        shared = firsts[head][0].prompt_logprobs
        for index, tokens in zip(rest, await _all(runs[i].start(held_on) for i in rest), strict=True):
            firsts[index] = [dataclasses.replace(tokens[0], prompt_logprobs=shared), *tokens[1:]] if shared else tokens

    await _all(samples(group) for group in groups)
    return firsts


async def _all(calls: Iterable[Awaitable[_T]]) -> list[_T]:
    """The results of concurrent calls, in order; the first failure cancels the rest and is raised. A lone call
    is awaited as it is (no task: most requests have one choice)."""
    calls = list(calls)
    if len(calls) == 1:
        return [await calls[0]]
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _interleaved(streams: list[AsyncGenerator[str, None]]) -> AsyncGenerator[str, None]:
    """The items of several streams as each comes; the first failure ends them all and is raised."""
    queue: asyncio.Queue[tuple[str | None, BaseException | None]] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[str, None]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((item, None))
        except Exception as exc:
            queue.put_nowait((None, exc))
        else:
            queue.put_nowait((None, None))

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        for _ in streams:
            while True:
                item, failure = await queue.get()
                if failure is not None:
                    raise failure
                if item is None:
                    break
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


# Serve ships the class below to its replicas pickled by value: the helpers its methods call are defined above it,
# where cloudpickle finds them all (tests/serve/test_ingress.py checks).
@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=2048)
@serve.ingress(app)
class Ingress:
    def __init__(
        self,
        routers: list[DeploymentHandle[Any]],
        prefill: list[DeploymentHandle[Any]],
        decode: list[DeploymentHandle[Any]],
        model_id: str,
        opts: ServingConfig,
        slo: SLOConfig,
        model_source: str | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        parsing_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.model_id = model_id
        self.opts, self.slo = opts, slo
        self.preprocess = Preprocessor(model_id, opts.context_tokens, model_source, engine_kwargs, parsing_kwargs)
        self.keys = ApiKeys.gather(
            opts.api_keys, opts.api_key_env, opts.api_key_file, opts.admin_api_keys, opts.admin_api_key_env
        )
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
        self.routers = routers  # a shard's each (serving.router_shards)
        listener = f"{serve.get_replica_context().replica_id.unique_id}-{secrets.token_hex(4)}"
        self.dispatcher = Dispatcher(routers, NodeGroups(prefill), NodeGroups(decode), limits, self.metrics, listener)
        self._state: tuple[float, asyncio.Future[dict[str, Any]]] | None = None  # the last live view and when

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

    @app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API for text in and out, as vLLM's server serves it (``serve.responses_api``)."""
        return await self._serve(request, chat=True, responses=True)

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize``: a prompt's token ids, or a chat's as its template renders them."""
        return await self._utility(request, self.preprocess.tokenize)

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``/detokenize``: the text of token ids."""
        return await self._utility(request, self.preprocess.detokenize)

    @app.get("/version")
    async def version(self, request: Request) -> Response:
        """vLLM's ``/version`` (the engines' vLLM), and this app's own."""
        if not self.keys.allows(request.headers.get("authorization")):
            return self._unauthorized()
        return JSONResponse({"version": VLLM_VERSION, "kairos_ray": __version__})

    @app.get("/kairos/state")
    async def kairos_state(self, request: Request) -> Response:
        """The live view ``kairos top`` shows: ``messages.LiveState`` as JSON (503 if the router does not answer).

        To admin keys only (it shows every tenant's traffic), and asked of the router at most every
        ``state_refresh_s``: callers in between share the last answer, so that no caller can load the
        single router's loop, which every routing decision waits for.
        """
        denied = self._admin_only(request)
        if denied is not None:
            return denied
        now = time.monotonic()
        last = self._state
        if last is None or now - last[0] >= self.opts.state_refresh_s or _failed(last[1]):
            router = self.routers[self.dispatcher.decisions.live()[0]]  # a live shard: each has every node's state
            last = self._state = (now, asyncio.ensure_future(live_state(router, self.metrics.window)))
        try:
            return JSONResponse(await asyncio.shield(last[1]))
        except Exception as exc:  # whatever keeps the router from answering
            logger.warning("GET /kairos/state: the router did not answer (%s: %s)", type(exc).__name__, exc)
            return _error(503, "the router did not answer; try again")

    @app.get("/openapi.json")
    async def openapi(self, request: Request) -> Response:
        """FastAPI's schema of these endpoints, to admin keys where ``serving.api_docs`` is on (404 otherwise)."""
        denied = self._docs_denied(request)
        return denied or JSONResponse(app.openapi())

    @app.get("/docs")
    async def docs(self, request: Request) -> Response:
        """FastAPI's interactive API page over ``/openapi.json``, on the same terms."""
        from fastapi.openapi.docs import get_swagger_ui_html

        denied = self._docs_denied(request)
        return denied or get_swagger_ui_html(openapi_url="/openapi.json", title="Kairos-Ray")

    def residue(self) -> Residue:
        """What this replica keeps per request (``messages.Residue``): all 0 once idle."""
        return Residue("ingress", {"in_flight": self.admission.in_flight, **self.dispatcher.residue()})

    # ---- one request -------------------------------------------------------------------------

    def _unauthorized(self) -> JSONResponse:
        self.metrics.rejected.inc(tags={"reason": "unauthorized"})
        return _error(
            401, "a valid API key is required: Authorization: Bearer <key>", headers={"WWW-Authenticate": "Bearer"}
        )

    def _admin_only(self, request: Request) -> JSONResponse | None:
        """401 without an accepted key, 403 with one that is not an admin key; None for an admin."""
        authorization = request.headers.get("authorization")
        if not self.keys.allows(authorization):
            return self._unauthorized()
        if not self.keys.admin(authorization):
            self.metrics.rejected.inc(tags={"reason": "forbidden"})
            return _error(403, "an admin API key is required (serving.admin_api_keys)")
        return None

    def _docs_denied(self, request: Request) -> JSONResponse | None:
        if not self.opts.api_docs:
            return _error(404, "not found (the API docs are off: serving.api_docs)")
        return self._admin_only(request)

    def _exposure(self, authorization: str | None) -> Exposure:
        """What of its route a request's response shows (``serving.expose_routing``; everything to admin keys)."""
        if self.keys.required and self.keys.admin(authorization):
            return Exposure.FULL
        if not self.opts.expose_routing:
            return Exposure.NONE
        return Exposure.ROUTE if self.keys.required else Exposure.FULL  # an open app: every caller is its admin

    async def _serve(self, request: Request, chat: bool, responses: bool = False) -> Response:
        authorization = request.headers.get("authorization")
        if not self.keys.allows(authorization):
            return self._unauthorized()
        header = next((h for h in PROXY_HEADERS if h in request.headers), None)
        if header is not None:
            self.metrics.rejected.inc(tags={"reason": "bad-request"})
            return _error(400, f"the header {header} is not accepted: a request ends when its client leaves", header)
        slot = self.admission.try_acquire()
        if slot is None:
            self.metrics.rejected.inc(tags={"reason": "overload"})
            return self._busy()
        streaming = False
        try:
            request_id = next(self._ids)
            try:
                prompts = await self._validated(request, chat, responses)
            except RequestError as bad:
                reason = "too-large" if bad.status == 413 else "bad-request"
                self.metrics.rejected.inc(tags={"reason": reason})
                return _error(bad.status, bad.message, bad.param)
            except Exception:  # not the body's fault: the details go to the log, not to the client
                logger.exception("request %s could not be prepared", request_id)
                return _error(500, f"the request could not be prepared (request {request_id})")
            if len(prompts) > self.admission.limit:  # would never be admitted: not a "try again"
                self.metrics.rejected.inc(tags={"reason": "bad-request"})
                limit, param = self.admission.limit, "n" if prompts[-1].sample else "prompt"
                return _error(400, f"{param}: at most {limit} choices per request here (max_in_flight)", param)
            if not slot.widen(len(prompts) - 1):  # a place for each prompt
                self.metrics.rejected.inc(tags={"reason": "overload"})
                return self._busy()
            ids = [request_id, *(next(self._ids) for _ in prompts[1:])]
            runs = [self.dispatcher.run(self._engine_request(i, p)) for i, p in zip(ids, prompts, strict=True)]
            try:
                firsts = await _started(runs, prompts)
            except BaseException as exc:
                for run in runs:
                    run.close()
                if isinstance(exc, Shed):  # counted, not logged: under overload there are many
                    self.metrics.shed(exc.reason, prompts[0].priority)
                    headers = {"Retry-After": str(exc.retry_after_s), SHED_HEADER: exc.reason}
                    return _error(429, f"{exc.message} (request {request_id})", headers=headers)
                if isinstance(exc, RequestFailed):
                    logger.warning("request %s failed: %s (%s)", request_id, exc.message, exc.detail)
                    return _error(exc.status, f"{exc.message} (request {request_id})")
                raise
            exposure = self._exposure(authorization)
            writers = [
                ResponsesWriter(self.model_id, _route(run), p, exposure)
                if responses
                else ResponseWriter(self.model_id, _route(run), p, exposure, index, named_after=request_id)
                for index, (run, p) in enumerate(zip(runs, prompts, strict=True))
            ]
            headers = route_headers(writers[0].route, exposure)  # the first prompt's; each choice shows its own
            if prompts[0].options.stream:

                def done() -> None:
                    for run in runs:
                        run.close()
                    slot.release()

                events = self._sse(writers, runs, firsts)
                streaming = True
                return GuardedStream(events, done, media_type="text/event-stream", headers=headers)
            try:
                outputs = await _all(self._collected(run, first) for run, first in zip(runs, firsts, strict=True))
            except StreamBroken as broken:
                logger.warning("request %s broke: %s (%s)", request_id, broken.message, broken.detail)
                return _error(503, f"request {request_id} failed after its first token: {broken.message}")
            finally:
                for run in runs:
                    run.close()
            bodies = [writer.full(tokens) for writer, tokens in zip(writers, outputs, strict=True)]
            body = bodies[0] if len(bodies) == 1 else batch_body(bodies, prompt_tokens(writers))
            return JSONResponse(body, headers=headers)
        finally:
            if not streaming:
                slot.release()

    def _engine_request(self, request_id: int, prepared: PreparedRequest) -> EngineRequest:
        return EngineRequest(
            request_id,
            prepared.prompt_tokens,
            prepared.max_tokens,
            time.time(),
            prompt_token_ids=prepared.prompt_token_ids,
            # emulated engines ignore it (and so need no vLLM to unpickle it)
            sampling=prepared.sampling if self.preprocess.vllm else None,
            priority=prepared.priority,
            cache_salt=prepared.cache_salt,
        )

    async def _collected(self, run: RequestRun, first: list[TokenEvent]) -> list[TokenEvent]:
        """All of a request's tokens (one prompt's), judged for goodput once they are in."""
        tokens = list(first)
        gaps = _Gaps()
        async for ready in self._timed(run, gaps):
            tokens += ready
        self._judge(run, gaps)
        return tokens

    async def _utility(self, request: Request, answer: Callable[[Any], Awaitable[dict[str, Any]]]) -> Response:
        """A request that no engine serves (``/tokenize``, ``/detokenize``): behind the API key, in an admission
        slot (it costs this replica's CPU), its body read and answered within the input deadlines."""
        if not self.keys.allows(request.headers.get("authorization")):
            return self._unauthorized()
        slot = self.admission.try_acquire()
        if slot is None:
            self.metrics.rejected.inc(tags={"reason": "overload"})
            return self._busy()
        try:
            return JSONResponse(await self._input(request, lambda data, _: answer(data)))
        except RequestError as bad:
            self.metrics.rejected.inc(tags={"reason": "too-large" if bad.status == 413 else "bad-request"})
            return _error(bad.status, bad.message, bad.param)
        except Exception:  # not the body's fault: the details go to the log, not to the client
            request_id = next(self._ids)
            logger.exception("%s (request %s) failed", request.url.path, request_id)
            return _error(500, f"the request could not be answered (request {request_id})")
        finally:
            slot.release()

    def _busy(self) -> JSONResponse:
        retry_s = self.opts.retry_after_s
        message = f"server busy: {self.admission.in_flight} requests in flight; retry after {retry_s} s"
        return _error(429, message, headers={"Retry-After": str(retry_s)})

    async def _validated(self, request: Request, chat: bool, responses: bool) -> tuple[PreparedRequest, ...]:
        """The request's prompts, parsed, rendered and checked as vLLM's server does it; raises ``RequestError``."""
        if responses:
            return await self._input(request, self.preprocess.prepare_responses)
        return await self._input(request, lambda data, off_loop: self.preprocess.prepare(data, chat, off_loop))

    async def _input(self, request: Request, handle: Callable[[Any, bool], Awaitable[_T]]) -> _T:
        """``handle(body as JSON, off_loop)`` within ``input_timeout_s``; raises ``RequestError``. Large bodies
        are parsed off the event loop (``off_loop`` tells ``handle``)."""
        body = await self._body(request)
        off_loop = len(body) >= OFF_LOOP_BYTES
        timeout_s = self.opts.input_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                data = await asyncio.to_thread(_parse, body) if off_loop else _parse(body)
                return await handle(data, off_loop)
        except TimeoutError:
            raise RequestError(
                400, f"the request took over {timeout_s:g} s to parse and check (input_timeout_s)"
            ) from None

    async def _body(self, request: Request) -> bytes:
        """The raw body, refused with 413 as soon as it passes ``max_body_bytes``, 408 past ``body_timeout_s``."""
        limit = self.opts.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise RequestError(413, f"request body of {int(declared)} bytes exceeds the {limit}-byte limit")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.opts.body_timeout_s):  # a client that trickles its body holds a slot
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise RequestError(413, f"request body exceeds the {limit}-byte limit")
                    chunks.append(chunk)
        except TimeoutError:
            raise RequestError(408, f"request body not received within {self.opts.body_timeout_s:g} s") from None
        return b"".join(chunks)

    async def _timed(self, run: RequestRun, gaps: _Gaps) -> AsyncIterator[list[TokenEvent]]:
        """The tokens after the first ones, observing every gap (tokens that come together: a gap of 0) and
        counting in ``gaps`` those over the TBT objective."""
        tags = {"route": run.route.route.value if run.route else ""}
        last_s = time.monotonic()
        observe, tbt_s = self.metrics.tbt.observe, self.slo.tbt_s
        async for ready in run.rest():
            now = time.monotonic()
            observe(now - last_s, tags=tags)
            for _ in range(len(ready) - 1):
                observe(0.0, tags=tags)
            gaps.count += len(ready)
            gaps.over += now - last_s > tbt_s
            last_s = now
            yield ready

    def _judge(self, run: RequestRun, gaps: _Gaps) -> None:
        """Count a request that ended within its objectives (``kairos_ray.metrics``: its TTFT, and at most
        ``TBT_ALLOWED_SHARE`` of its gaps over tau), for goodput."""
        assert run.route is not None
        if run.route.ttft_s <= self.slo.ttft_s and gaps.over <= TBT_ALLOWED_SHARE * gaps.count:
            self.metrics.attained.inc(tags={"route": run.route.route.value})

    async def _sse(
        self, writers: list[ResponseWriter], runs: list[RequestRun], firsts: list[list[TokenEvent]]
    ) -> AsyncGenerator[str, None]:
        """One event per token (or group) of each prompt's choice, as they come; the tokens that come together go
        out in one write."""
        counts = [len(first) for first in firsts]
        streams = [
            self._choice_events(writer, run, first, counts)
            for writer, run, first in zip(writers, runs, firsts, strict=True)
        ]
        events = streams[0] if len(streams) == 1 else _interleaved(streams)
        writer = writers[0]
        try:
            async for event in events:
                yield event
        except StreamBroken as broken:
            request_id = runs[0].request.request_id
            logger.warning("request %s broke: %s (%s)", request_id, broken.message, broken.detail)
            yield writer.error(f"request {request_id} failed after {sum(counts)} tokens: {broken.message}")
        else:
            if writer.options.include_usage:
                yield writer.usage(sum(counts), prompt_tokens(writers), reasoning_tokens(writers))
        finally:
            await events.aclose()
        yield writer.done()

    async def _choice_events(
        self, writer: ResponseWriter, run: RequestRun, first: list[TokenEvent], counts: list[int]
    ) -> AsyncGenerator[str, None]:
        """One prompt's events, its tokens counted in ``counts[writer.index]``; raises ``StreamBroken``."""
        if events := writer.tokens(first):
            yield events
        gaps = _Gaps()
        async for ready in self._timed(run, gaps):
            counts[writer.index] += len(ready)
            if events := writer.tokens(ready):  # none while a parser holds the text back
                yield events
        self._judge(run, gaps)
