"""Requests as vLLM's OpenAI server reads them, before routing: parsed, rendered, their sampling parameters built.

The router decides on the prompt's length, so the ingress renders the prompt
first. With vLLM engines it does what vLLM's server does, with vLLM's own
code: its protocol models parse the body (``serve.protocol``), its
``OnlineRenderer`` applies the chat template (tools, documents and template
arguments passed to it, text content parts joined as the template expects)
and tokenizes, ``get_max_tokens`` resolves ``max_tokens`` (up to the context
when the request leaves it out), the request model's ``to_sampling_params``
builds the ``SamplingParams``, and vLLM's ``InputProcessor`` checks them
against the model (vocabulary, logprob limits, structured-output grammars).
A request vLLM's server refuses is a 400 here too, never a failure on an
engine. The engines take the token ids and the ``SamplingParams`` as they are.
``/tokenize`` and ``/detokenize`` are vLLM's own ``ServingTokenization`` on
the same renderer: the ids it gives are those the engines get.

Emulated engines have no model: a text prompt counts one token per
whitespace-separated word (a prompt may also be token ids), a chat request
its messages' words plus 4 tokens per message for the template. The body is
parsed, refused and its ``SamplingParams`` built as for vLLM engines; nothing
is checked against a model, and fields that shape the prompt (templating,
truncation, special tokens) change nothing.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import warnings
from collections.abc import Awaitable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.serve import create_error_response
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.tokenize.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
from vllm.exceptions import VLLMValidationError

from kairos_ray.engines import without_prompt_logprobs
from kairos_ray.serve.parsing import OutputParsers
from kairos_ray.serve.protocol import (
    MAX_CHOICES,
    OpenAIRequest,
    PreparedRequest,
    RequestError,
    ResponseOptions,
    refusal,
)
from kairos_ray.serve.responses_api import ResponsesTurn
from kairos_ray.serve.responses_api import refusal as responses_refusal

_Request = TypeVar("_Request", bound=BaseModel)
TEMPLATE_TOKENS_PER_MESSAGE = 4  # emulated engines: what a chat template adds per message
# Structured-output grammars are compiled to be checked on threads of their own: a hostile one that compiles for
# long holds one of these (the ingress answers it at its deadline), never the event loop or the default executor.
_CHECKS = ThreadPoolExecutor(4, thread_name_prefix="kairos-input-check")


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    value = repr(err.get("input"))
    value = value if len(value) <= 80 else value[:77] + "..."
    return f"{param}: {err['msg'].removeprefix('Value error, ')} (got {value})" if param else err["msg"], param


def parse(data: Any, chat: bool) -> OpenAIRequest:
    """The body as vLLM's server parses it; raises ``RequestError``."""
    if chat:
        return _validated(ChatCompletionRequest, data)
    return _validated(CompletionRequest, data)


def _validated(kind: type[_Request], data: Any) -> _Request:
    """``data`` as one of vLLM's request models, as its server's body parsing makes it; raises ``RequestError``."""
    if not isinstance(data, dict):
        raise RequestError(400, "request body must be a JSON object")
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        raise RequestError(400, *_validation_message(exc)) from None
    except VLLMValidationError as exc:
        raise RequestError(400, str(exc.args[0]) if exc.args else str(exc), exc.parameter) from None
    except Exception as exc:  # vLLM's validators run on whatever the body holds: what they trip on is the body's fault
        raise RequestError(400, f"invalid request: {type(exc).__name__}: {exc}") from None


def _client_error(exc: Exception, param: str | None = None) -> RequestError:
    """The 4xx vLLM's server answers for ``exc``; re-raises what it would answer with a 5xx."""
    error = create_error_response(exc).error
    if error.code >= 500:
        raise exc
    return RequestError(error.code, error.message, error.param or param)


def _sample(sampling: Any, index: int) -> Any:
    """The ``SamplingParams`` of one of a request's ``n`` samples, as vLLM's engine makes them for each: one
    sequence, and a seed of its own (the request's + ``index``) where the request has one; the prompt's logprobs
    computed by the first sample only (the others show its, ``serve.ingress``)."""
    if sampling.n == 1:
        return sampling
    child: Any = copy.copy(sampling if index == 0 else without_prompt_logprobs(sampling))
    child.n = 1
    if sampling.seed is not None:
        child.seed = sampling.seed + index
    return child


async def _answer(call: Awaitable[Any]) -> dict[str, Any]:
    """The body of a response vLLM's serving code returns (a ``RequestError`` for its client errors)."""
    try:
        answer = await call
    except Exception as exc:
        raise _client_error(exc) from None
    if isinstance(answer, ErrorResponse):
        if answer.error.code >= 500:
            raise RuntimeError(answer.error.message)
        raise RequestError(answer.error.code, answer.error.message, answer.error.param)
    body: dict[str, Any] = answer.model_dump()
    return body


def _words(text: str) -> int:
    return len(text.split())


Prompt = tuple[int, str, tuple[int, ...]]
"""A prompt as the router and responses see it: (its tokens, its text, its token ids)."""


def _prompt_of(engine_input: Any) -> Prompt:
    """A vLLM engine input's prompt."""
    ids = tuple(engine_input["prompt_token_ids"])
    return len(ids), str(engine_input.get("prompt") or ""), ids


def _emulated_prompts(request: OpenAIRequest) -> list[Prompt]:
    """Each prompt of ``request`` as emulated engines count it; ids only for a token-id prompt (its prefix
    identity: ``serve.dispatch``)."""
    if isinstance(request, ChatCompletionRequest):
        count = 0
        for message in request.messages:
            content = message.get("content")
            if isinstance(content, str):
                count += _words(content)
            elif isinstance(content, list):
                count += sum(_words(str(part.get("text", ""))) for part in content if isinstance(part, dict))
            count += TEMPLATE_TOKENS_PER_MESSAGE
        return [(count, "", ())]
    prompt = request.prompt
    if isinstance(prompt, str):
        return [(_words(prompt), prompt, ())]
    if not prompt:
        return [(0, "", ())]
    if isinstance(prompt[0], int):
        return [(len(prompt), "", tuple(prompt))]
    return [(len(p), "", tuple(p)) if isinstance(p, list) else (_words(str(p)), str(p), ()) for p in prompt]


def _requested_max_tokens(request: OpenAIRequest) -> int | None:
    """The request's output limit as vLLM's server reads it (chat: ``max_completion_tokens``, else ``max_tokens``)."""
    if isinstance(request, ChatCompletionRequest):
        if request.max_completion_tokens is not None:
            return request.max_completion_tokens
        with warnings.catch_warnings():  # chat's deprecated max_tokens still counts, as in vLLM's server
            warnings.simplefilter("ignore", DeprecationWarning)
            return request.max_tokens
    return request.max_tokens


class Preprocessor:
    """Turns request bodies into ``PreparedRequest`` s for one model.

    ``model_source``/``engine_kwargs``: the decode pool's vLLM model and engine
    arguments (the prompt is rendered and checked as its engines will see it),
    or None for emulated engines; ``parsing_kwargs``: its tool-call parsing
    arguments (``serve.args.OUTPUT_PARSING``; ``serve.parsing``).
    ``context_tokens``: prompt + output must fit.
    """

    def __init__(
        self,
        model_id: str,
        context_tokens: int,
        model_source: str | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        parsing_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.model_id = model_id
        self.context_tokens = context_tokens
        self.defaults: dict[str, Any] = {}  # the model's generation config, as vLLM's server reads it
        self.override_max_tokens: int | None = None
        self.renderer: Any = None  # vllm.renderers.online_renderer.OnlineRenderer
        self.processor: Any = None  # vllm.v1.engine.input_processor.InputProcessor
        self.tokenization: Any = None  # vllm.entrypoints.serve.tokenize.serving.ServingTokenization
        self.parsers: OutputParsers | None = None  # tool-call and reasoning parsers of chat answers, if set
        self.tokenizer: Any = None  # the renderer's tokenizer
        if model_source is not None:
            self._load(model_source, engine_kwargs or {}, parsing_kwargs or {})

    def _load(self, model_source: str, engine_kwargs: Mapping[str, Any], parsing: Mapping[str, Any]) -> None:
        """vLLM's render server's set-up: a model config and a renderer, no engine."""
        from vllm import AsyncEngineArgs
        from vllm.config import VllmConfig
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
        from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
        from vllm.renderers import renderer_from_config
        from vllm.renderers.online_renderer import OnlineRenderer
        from vllm.v1.engine.input_processor import InputProcessor

        args = AsyncEngineArgs(model=model_source, **engine_kwargs)
        model_config = args.create_model_config()
        model_config.quantization = None  # the ingress runs no kernels
        structured = args.create_structured_outputs_config()
        config = VllmConfig(model_config=model_config, structured_outputs_config=structured)
        renderer = renderer_from_config(config)
        self.tokenizer = renderer.tokenizer
        auto_tools = bool(parsing.get("enable_auto_tool_choice", False))
        self.renderer = OnlineRenderer(
            model_config,
            renderer,
            request_logger=None,
            chat_template=None,
            chat_template_content_format="auto",
            enable_auto_tools=auto_tools,
            exclude_tools_when_tool_choice_none=bool(parsing.get("exclude_tools_when_tool_choice_none", False)),
            tool_parser=parsing.get("tool_call_parser"),
            reasoning_parser=engine_kwargs.get("reasoning_parser") or None,
            tool_strict_level=parsing.get("tool_strict_level", "auto"),
        )
        if self.renderer.parser is not None:
            self.parsers = OutputParsers(self.renderer.parser, renderer.tokenizer, model_config, auto_tools)
        self.processor = InputProcessor(config, renderer)
        registry = OpenAIModelRegistry(model_config, [BaseModelPath(self.model_id, model_source)])
        self.tokenization = ServingTokenization(
            registry, self.renderer, chat_template=None, chat_template_content_format="auto"
        )
        self.defaults = model_config.get_diff_sampling_param()
        if model_config.generation_config not in ("auto", "vllm"):
            self.override_max_tokens = self.defaults.get("max_tokens")
        else:
            self.override_max_tokens = (model_config.override_generation_config or {}).get("max_new_tokens")
        self.context_tokens = min(self.context_tokens, model_config.max_model_len)

    @property
    def vllm(self) -> bool:
        """Requests go to vLLM engines (else emulated ones)."""
        return self.renderer is not None

    async def prepare(self, data: Any, chat: bool, off_loop: bool = False) -> tuple[PreparedRequest, ...]:
        """The request in ``data`` (a parsed JSON body), one ``PreparedRequest`` per choice: per prompt (a
        completion's ``prompt`` may be a list of them), ``n`` samples each, in the order of their choices' indices;
        each is routed on its own. Raises ``RequestError``.

        ``off_loop``: parse (and count an emulated prompt) in a thread, for large bodies.
        """
        request = await asyncio.to_thread(parse, data, chat) if off_loop else parse(data, chat)
        self._check_model(request.model)
        refused = refusal(request)
        if refused is not None:
            raise refused
        if self.renderer is None:
            count = _emulated_prompts
            prompts = await asyncio.to_thread(count, request) if off_loop else count(request)
            inputs: list[Any] = [None] * len(prompts)
        else:
            inputs = await self._render(request)
            prompts = [_prompt_of(engine_input) for engine_input in inputs]
        # the client's request_id names the response, as in vLLM's server (Serve sets X-Request-Id on every request)
        response_id = request.request_id if "request_id" in request.model_fields_set else None
        options = ResponseOptions.of(request, response_id)
        if self.parsers is not None and isinstance(request, ChatCompletionRequest):
            template_kwargs = self.renderer.effective_chat_template_kwargs(request)
            options = dataclasses.replace(options, parsing=self.parsers.for_request(request, template_kwargs))
        samples = 1 if request.n is None else request.n
        if samples < 1:
            raise RequestError(400, f"n: must be at least 1, got {samples}", "n")
        if len(prompts) * samples > MAX_CHOICES:
            param = "n" if samples > 1 else "prompt"
            raise RequestError(400, f"{param}: at most {MAX_CHOICES} choices per request (n x prompts)", param)
        prepared = []
        for (prompt_tokens, prompt_text, prompt_ids), engine_input in zip(prompts, inputs, strict=True):
            max_tokens, sampling = await self._sampling(request, prompt_tokens, engine_input, off_loop)
            echoed = options.echo and options.top_logprobs is not None and prompt_ids and self.tokenizer is not None
            first_token = self.tokenizer.decode(prompt_ids[0]) if echoed else ""
            for sample in range(samples):
                prepared.append(
                    PreparedRequest(
                        prompt_token_ids=prompt_ids,
                        prompt_tokens=prompt_tokens,
                        prompt_text=prompt_text,
                        max_tokens=max_tokens,
                        sampling=_sample(sampling, sample),
                        options=options,
                        priority=request.priority,
                        cache_salt=request.cache_salt,
                        sample=sample,
                        first_token=first_token,
                    )
                )
        return tuple(prepared)

    async def _sampling(
        self, request: OpenAIRequest | ResponsesRequest, prompt_tokens: int, engine_input: Any, off_loop: bool
    ) -> tuple[int, Any]:
        """(max_tokens, ``SamplingParams``) of one prompt of ``request``, as vLLM's server resolves them, checked
        as its engine front end checks them; raises ``RequestError``."""
        chat = isinstance(request, ChatCompletionRequest)
        param = "input" if isinstance(request, ResponsesRequest) else "messages" if chat else "prompt"
        if prompt_tokens < 1:
            raise RequestError(400, f"{param} is empty: it has no tokens", param)
        if isinstance(request, ResponsesRequest):  # a max_output_tokens past the context is cut to it
            requested, truncate = request.max_output_tokens, -1 if request.truncation != "disabled" else None
            if prompt_tokens >= self.context_tokens:
                raise RequestError(
                    400, f"input ({prompt_tokens} tokens) fills the {self.context_tokens}-token context", param
                )
        else:
            requested, truncate = _requested_max_tokens(request), request.truncate_prompt_tokens
            if requested is not None and prompt_tokens + requested > self.context_tokens:
                raise RequestError(
                    400,
                    f"prompt ({prompt_tokens} tokens) plus max_tokens ({requested}) exceeds the "
                    f"{self.context_tokens}-token context",
                    param,
                )
        try:
            max_tokens = get_max_tokens(
                self.context_tokens,
                requested,
                prompt_tokens,
                self.defaults,
                self.override_max_tokens,
                truncate_prompt_tokens=truncate,
            )
            sampling = request.to_sampling_params(max_tokens, self.defaults)
            if self.processor is not None:  # what vLLM's engine front end checks before it takes a request
                check = functools.partial(
                    self.processor.process_inputs, "check", engine_input, sampling, ("generate",),
                    priority=request.priority,
                )  # fmt: skip
                if off_loop or sampling.structured_outputs is not None:  # a grammar compiles: not on the loop
                    await asyncio.get_running_loop().run_in_executor(_CHECKS, check)
                else:
                    check()
        except Exception as exc:
            raise _client_error(exc, param) from None
        # echo with max_tokens 0 (the prompt alone): one token is generated and left out, as in vLLM's server
        return max(max_tokens, sampling.max_tokens or 0), sampling

    def _check_model(self, model: str | None) -> None:
        """A request naming another model is a 404, as vLLM's server and OpenAI answer it."""
        if model is not None and model != self.model_id:
            raise RequestError(404, f"model {model!r} is not served here; available: {self.model_id!r}", "model")

    async def prepare_responses(self, data: Any, off_loop: bool = False) -> tuple[PreparedRequest, ...]:
        """A ``/v1/responses`` request in ``data``, as one ``PreparedRequest`` (``serve.responses_api``): parsed,
        rendered and its sampling built as vLLM's server does it; raises ``RequestError``."""
        if self.renderer is None:
            raise RequestError(501, "emulated engines have no tokenizer: /v1/responses needs vLLM engines")
        request = (
            await asyncio.to_thread(_validated, ResponsesRequest, data)
            if off_loop
            else _validated(ResponsesRequest, data)
        )
        self._check_model(request.model)
        refused = responses_refusal(request)
        if refused is not None:
            raise refused
        try:
            rendered = await self.renderer.render_responses(request)
        except Exception as exc:
            raise _client_error(exc, "input") from None
        if isinstance(rendered, ErrorResponse):
            error = rendered.error
            raise RequestError(error.code, error.message, error.param or "input")
        engine_input = rendered.engine_input
        prompt_tokens, prompt_text, prompt_ids = _prompt_of(engine_input)
        max_tokens, sampling = await self._sampling(request, prompt_tokens, engine_input, off_loop)
        parsers, new_parser = self.parsers, None
        if parsers is not None:
            template_kwargs = request.build_chat_params(None, "auto").chat_template_kwargs
            new_parser = functools.partial(
                parsers.parser_cls, parsers.tokenizer, request.tools,
                chat_template_kwargs=template_kwargs, model_config=parsers.model_config,
            )  # fmt: skip
        auto_tools = parsers is not None and parsers.enable_auto_tools
        options = ResponseOptions(
            chat=True,
            stream=bool(request.stream),
            include_usage=False,
            continuous_usage=False,
            top_logprobs=None,
            responses=ResponsesTurn(request, sampling, new_parser, auto_tools),
        )
        prepared = PreparedRequest(
            prompt_ids, prompt_tokens, prompt_text, max_tokens, sampling, options, request.priority, request.cache_salt
        )
        return (prepared,)

    async def tokenize(self, data: Any) -> dict[str, Any]:
        """``POST /tokenize``: the prompt's token ids (a chat's as its template renders them), as vLLM's server
        answers, by its own tokenization code; raises ``RequestError``."""
        kind = TokenizeChatRequest if isinstance(data, dict) and "messages" in data else TokenizeCompletionRequest
        tokenization = self._tokenization()
        return await _answer(tokenization.create_tokenize(_validated(kind, data), None))

    async def detokenize(self, data: Any) -> dict[str, Any]:
        """``POST /detokenize``: the text of token ids, as vLLM's server answers; raises ``RequestError``."""
        tokenization = self._tokenization()
        return await _answer(tokenization.create_detokenize(_validated(DetokenizeRequest, data), None))

    def _tokenization(self) -> Any:
        if self.tokenization is None:
            raise RequestError(501, "emulated engines have no tokenizer: /tokenize and /detokenize need vLLM engines")
        return self.tokenization

    async def _render(self, request: OpenAIRequest) -> list[Any]:
        """vLLM's engine inputs for ``request``, one per prompt: its token ids (and text)."""
        try:
            if isinstance(request, ChatCompletionRequest):
                rendered = await self.renderer.render_chat(request)
                if not isinstance(rendered, ErrorResponse):
                    rendered = rendered[1]
            else:
                rendered = await self.renderer.render_completion(request)
        except Exception as exc:
            raise _client_error(exc) from None
        if isinstance(rendered, ErrorResponse):
            raise RequestError(rendered.error.code, rendered.error.message, rendered.error.param)
        return list(rendered)
