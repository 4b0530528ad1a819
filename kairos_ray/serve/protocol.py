"""The OpenAI requests the ingress serves: vLLM's own protocol models, what the app refuses, and its error objects.

A body is parsed and validated by vLLM's OpenAI server models
(``vllm.entrypoints.openai.completion.protocol.CompletionRequest``,
``chat_completion.protocol.ChatCompletionRequest``), so every field vLLM's
server knows is checked as it checks it. Unknown fields are accepted and
ignored, as vLLM's server and OpenAI do. What the app cannot serve is a 400
naming the field (``REFUSALS``), never silently ignored:

| field | why it is refused |
|---|---|
| ``use_beam_search``, ``length_penalty`` | no beam search |
| ``prompt_embeds``; over 64 prompts or choices | token prompts only; ``MAX_CHOICES`` (``n`` x prompts) |
| ``kv_transfer_params``, ``ec_transfer_params``, | the app's own hand-off and extra arguments (chunk |
| ``vllm_xargs`` | schedules) travel there |
| non-text content parts | the served models read text |

List-valued fields are capped (``LIST_CAPS``, ``MAX_ITEM_CHARS``; vLLM's
models cap the number of stop strings only): each entry costs the engines
work at every generated token (stop strings, bad words), or the ingress's
and the engines' memory for the request's life.

``serve.tokens`` renders the prompt and builds ``SamplingParams`` the way
vLLM's server does; ``ResponseOptions`` is what the response needs to know.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

if TYPE_CHECKING:
    from vllm import SamplingParams

    from kairos_ray.serve.parsing import ChatParsing
    from kairos_ray.serve.responses_api import ResponsesTurn

OpenAIRequest = CompletionRequest | ChatCompletionRequest


class RequestError(Exception):
    """A request the ingress refuses: ``status`` and an OpenAI error's message and ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass(frozen=True, slots=True)
class Refusal:
    """A field (or use of it) the app does not serve."""

    param: str  # the field, as the 400 names it
    reason: str
    applies: Callable[[Any], bool]  # of a request (vLLM's model of the endpoint's body)


def first_refused(refusals: tuple[Refusal, ...], request: Any) -> RequestError | None:
    """The 400 for the first of ``refusals`` that applies to ``request``, or None."""
    for refused in refusals:
        if refused.applies(request):
            return RequestError(400, f"{refused.param}: {refused.reason}", refused.param)
    return None


MAX_CHOICES = 64
"""The most choices one request may ask for: ``n`` times the prompts it lists (each is routed and run on its own,
in an admission place of its own)."""


def _prompt_batch(request: OpenAIRequest) -> bool:
    prompt = request.prompt if isinstance(request, CompletionRequest) else None
    return isinstance(prompt, list) and len(prompt) > MAX_CHOICES and not isinstance(prompt[0], int)


def _completion(check: Callable[[CompletionRequest], bool]) -> Callable[[OpenAIRequest], bool]:
    """A check of a completions-only field (false for chat requests)."""
    return lambda r: isinstance(r, CompletionRequest) and check(r)


REFUSALS: tuple[Refusal, ...] = (
    Refusal("use_beam_search", "beam search is not served", lambda r: r.use_beam_search),
    Refusal("length_penalty", "it applies to beam search, which is not served", lambda r: r.length_penalty != 1.0),
    Refusal("prompt", f"at most {MAX_CHOICES} prompts per request", _prompt_batch),
    Refusal("prompt_embeds", "prompt embeddings are not served", _completion(lambda r: r.prompt_embeds is not None)),
    Refusal(
        "kv_transfer_params",
        "the app hands KV over between its own nodes",
        lambda r: r.kv_transfer_params is not None,
    ),
    Refusal(
        "ec_transfer_params",
        "encoder-cache hand-off is not served",
        lambda r: r.ec_transfer_params is not None,
    ),
    Refusal(
        "vllm_xargs",
        "the app passes its own extra arguments (chunk schedules) to the engines",
        lambda r: r.vllm_xargs is not None,
    ),
)


LIST_CAPS: dict[str, int] = {
    "messages": 4096,
    "input": 4096,  # ``/v1/responses``: its input's items
    "stop_token_ids": 1024,
    "bad_words": 256,
    "logit_bias": 1024,
    "allowed_token_ids": 16_384,
    "logprob_token_ids": 1024,
}
"""Field -> the most entries a request may give it."""
MAX_ITEM_CHARS = 1024  # the longest stop string or bad word


def over_cap(request: Any) -> RequestError | None:
    """The 400 for a list-valued field of ``request`` past its cap (``LIST_CAPS``, ``MAX_ITEM_CHARS``), or None."""
    for name, cap in LIST_CAPS.items():
        value = getattr(request, name, None)
        if isinstance(value, list | dict) and len(value) > cap:
            return RequestError(400, f"{name}: at most {cap} entries, got {len(value)}", name)
    for name in ("stop", "bad_words"):
        value = getattr(request, name, None)
        for item in [value] if isinstance(value, str) else value or ():
            if isinstance(item, str) and len(item) > MAX_ITEM_CHARS:
                return RequestError(400, f"{name}: entries of at most {MAX_ITEM_CHARS} characters", name)
    return None


def refusal(request: OpenAIRequest) -> RequestError | None:
    """The 400 for the first thing of ``request`` the app does not serve (or over a cap), or None."""
    refused = over_cap(request) or first_refused(REFUSALS, request)
    if refused is not None:
        return refused
    for i, message in enumerate(request.messages if isinstance(request, ChatCompletionRequest) else ()):
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                param = f"messages.{i}.content"
                return RequestError(400, f"{param}: only text content parts are served, got {kind!r}", param)
    return None


@dataclass(frozen=True, slots=True)
class ResponseOptions:
    """What the response of a request depends on besides its tokens (vLLM's server's rules)."""

    chat: bool
    stream: bool
    include_usage: bool  # streamed: a closing usage event (``stream_options.include_usage``)
    continuous_usage: bool  # streamed: usage in every event (``stream_options.continuous_usage_stats``)
    top_logprobs: int | None  # None: no logprobs; else top entries per token (completions: n+1 kept; -1: all)
    all_logprobs: bool = False  # ``logprob_token_ids``: every entry the engine returned
    tokens_as_ids: bool = False  # ``return_tokens_as_token_ids``: "token_id:<id>" for logprob tokens
    return_token_ids: bool = False  # ``return_token_ids``: token ids in the choice
    echo: bool = False  # completions: the prompt's text (and logprobs, with logprobs) before the answer's
    echo_only: bool = False  # completions: ``echo`` with max_tokens 0, the prompt alone (one token generated, unshown)
    echo_message: str = ""  # chat ``echo``: the last message's content, before the answer (when their roles match)
    response_id: str | None = None  # the client's ``request_id``: the response's id
    role: str = "assistant"  # chat: the answer's role (the last message's when no generation prompt is added)
    return_prompt_text: bool = False  # chat: the rendered prompt in the response
    grouped: bool = False  # ``stream_interval``: one event per group of tokens the engine sends, not per token
    parsing: ChatParsing | None = None  # chat: tool calls and reasoning split out of the text (``serve.parsing``)
    responses: ResponsesTurn | None = None  # ``/v1/responses``: what its answer is built from (``serve.responses_api``)

    @classmethod
    def of(cls, request: OpenAIRequest, response_id: str | None) -> ResponseOptions:
        """The options of ``request``; ``response_id``: the client's id for the response, if it gave one."""
        stream_options = request.stream_options
        include_usage = bool(request.stream and stream_options and stream_options.include_usage)
        chat = isinstance(request, ChatCompletionRequest)
        echo_message = ""
        if isinstance(request, ChatCompletionRequest):
            top = request.top_logprobs if request.logprobs else None
            last = request.messages[-1] if request.messages else {}
            role = "assistant" if request.add_generation_prompt else str(last.get("role", "assistant"))
            if request.echo and last.get("role") == role:
                echo_message = _text_of(last.get("content"))
        else:
            top, role = request.logprobs, "assistant"
        return cls(
            chat=chat,
            stream=bool(request.stream),
            include_usage=include_usage,
            continuous_usage=include_usage and bool(stream_options and stream_options.continuous_usage_stats),
            top_logprobs=top,
            all_logprobs=bool(request.logprob_token_ids),
            tokens_as_ids=bool(request.return_tokens_as_token_ids),
            return_token_ids=bool(request.return_token_ids),
            echo=isinstance(request, CompletionRequest) and bool(request.echo),
            echo_only=isinstance(request, CompletionRequest) and bool(request.echo) and request.max_tokens == 0,
            echo_message=echo_message,
            response_id=response_id,
            role=role,
            return_prompt_text=isinstance(request, ChatCompletionRequest) and bool(request.return_prompt_text),
            grouped=request.stream_interval is not None,
        )


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A valid request: its prompt as the engines will see it, its sampling parameters, its response's options."""

    prompt_token_ids: tuple[int, ...]  # empty with emulated engines unless the prompt is token ids
    prompt_tokens: int  # what the router prices
    prompt_text: str  # the prompt's text (echo, return_prompt_text; "" when unknown)
    max_tokens: int  # as vLLM's server resolves it (up to the context when the request leaves it out)
    sampling: SamplingParams  # as vLLM's server builds it
    options: ResponseOptions
    priority: int = 0
    cache_salt: str | None = None
    sample: int = 0  # which of the prompt's ``n`` samples (its usage counts the prompt at sample 0 only)
    first_token: str = ""  # echo with logprobs: the prompt's first token decoded (it has no logprob to name it)


def _text_of(content: Any) -> str:
    """A message's content as text (its text parts joined by newlines, as vLLM's server echoes them)."""
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content or "")


def error_body(
    message: str, param: str | None = None, kind: str = "invalid_request_error", code: int | None = None
) -> dict[str, Any]:
    """OpenAI's error object (``code``: the HTTP status, as vLLM's server gives it)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
