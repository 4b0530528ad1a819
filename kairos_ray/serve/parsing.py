"""Tool calls and reasoning in a chat's answer, split out by vLLM's own parsers, as vLLM's OpenAI server does it.

With a tool-call parser (``engine_kwargs: {enable_auto_tool_choice: true,
tool_call_parser: NAME}``, as Ray Serve LLM users set them) or a reasoning
parser (``reasoning_parser: NAME``), the ingress renders chat prompts with
that parser (``tool_choice`` checked, the request adjusted: a forced tool's
JSON schema as its structured output) and parses each choice's text with a
``vllm.parser.Parser`` of its own, which is stateful: the whole text once
(``ChatParsing.message``), or token by token as it streams
(``StreamParsing.delta``). Message fields, ``finish_reason`` ("tool_calls"
when the model called a tool on ``auto`` or ``required``), reasoning-token
usage and what a hidden reasoning suppresses follow vLLM's server
(``OpenAIServingChat``'s full and streaming generators).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.entrypoints.generate.base.protocol import ToolCall
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    ChatMessage,
)
from vllm.renderers.chat_utils import make_tool_call_id

TOOL_CALLS = "tool_calls"
"""The ``finish_reason`` of an answer that called a tool on ``tool_choice`` auto or required."""


@dataclass(frozen=True, slots=True)
class OutputParsers:
    """An app's parsers: vLLM's composed ``Parser`` class for its tool-call and reasoning parsers, and what it
    is built with."""

    parser_cls: Any  # type[vllm.parser.Parser]
    tokenizer: Any
    model_config: Any
    enable_auto_tools: bool

    @property
    def reasoning(self) -> bool:
        """A reasoning parser is set: usage counts reasoning tokens (``completion_tokens_details``)."""
        return self.parser_cls.reasoning_parser_cls is not None

    def for_request(self, request: ChatCompletionRequest, template_kwargs: Mapping[str, Any]) -> ChatParsing:
        """How ``request``'s choices are parsed (``request`` as rendered: adjusted by the parser)."""
        return ChatParsing(self, request, dict(template_kwargs))


@dataclass(frozen=True, slots=True)
class ChatParsing:
    """One chat request's parsing: a parser per choice (``message``, ``stream``)."""

    parsers: OutputParsers
    request: ChatCompletionRequest
    template_kwargs: dict[str, Any]

    @property
    def hides_reasoning(self) -> bool:
        """``include_reasoning: false``: no reasoning, and no logprobs or token ids that would show it."""
        return not self.request.include_reasoning

    @property
    def named_tool(self) -> bool:
        return isinstance(self.request.tool_choice, ChatCompletionNamedToolChoiceParam)

    def _parser(self, prompt_token_ids: Sequence[int]) -> Any:
        parsers = self.parsers
        parser = parsers.parser_cls(
            parsers.tokenizer,
            self.request.tools,
            chat_template_kwargs=self.template_kwargs,
            model_config=parsers.model_config,
        )
        parser.set_prompt_token_ids(prompt_token_ids)
        return parser

    def message(
        self, role: str, text: str, token_ids: Sequence[int], prompt_token_ids: Sequence[int], finish_reason: str
    ) -> tuple[dict[str, Any], str, int]:
        """(the choice's ``message``, its ``finish_reason``, its reasoning tokens) for the whole answer."""
        request, parsers = self.request, self.parsers
        parser = self._parser(prompt_token_ids)
        reasoning, content, calls = parser.parse(
            text, request, enable_auto_tools=parsers.enable_auto_tools, model_output_token_ids=token_ids
        )
        if self.hides_reasoning:
            reasoning = None
        required = request.tool_choice == "required"
        auto_tools = parsers.enable_auto_tools and parsers.parser_cls.tool_parser_cls is not None
        called = [ToolCall(id=c.id or make_tool_call_id(), function=c) for c in calls or []]
        tools_called = False
        if self.named_tool or required:
            message = ChatMessage(role=role, reasoning=reasoning, content=content or "", tool_calls=called)
        elif auto_tools and request.tools and request.tool_choice == "auto" and called:
            tools_called = True
            message = ChatMessage(role=role, reasoning=reasoning, content=content, tool_calls=called)
        else:
            message = ChatMessage(role=role, reasoning=reasoning, content=content)
        if request.parallel_tool_calls is False:
            message.tool_calls = message.tool_calls[:1]
        if tools_called or (required and finish_reason == "stop"):
            finish_reason = TOOL_CALLS
        return message.model_dump(), finish_reason, parser.count_reasoning_tokens(tuple(token_ids))

    def stream(self, prompt_token_ids: Sequence[int]) -> StreamParsing:
        """A choice's parsing as it streams."""
        return StreamParsing(self, self._parser(prompt_token_ids), list(prompt_token_ids))


class StreamParsing:
    """One streamed choice: each delta's message, and whether it has streamed a tool call."""

    def __init__(self, parsing: ChatParsing, parser: Any, prompt_token_ids: list[int]) -> None:
        self.parsing, self.parser, self.prompt_token_ids = parsing, parser, prompt_token_ids
        self.tools_streamed = False
        self.token_ids: list[int] = []  # generated so far (reasoning tokens counted over them)

    def delta(self, text: str, token_ids: list[int], finished: bool) -> dict[str, Any] | None:
        """The delta message of these tokens (None: nothing to show yet, e.g. a tool call's opening markup)."""
        request = self.parsing.request
        self.token_ids += token_ids
        message = self.parser.parse_delta(
            delta_text=text,
            delta_token_ids=token_ids,
            request=request,
            prompt_token_ids=self.prompt_token_ids,
            finished=finished,
        )
        if message is None:
            return None
        if message.tool_calls:
            self.tools_streamed = True
            if request.parallel_tool_calls is False:
                message.tool_calls = [call for call in message.tool_calls if call.index == 0]
        delta: dict[str, Any] = message.model_dump(exclude_unset=True)
        return delta

    def finish_reason(self, finish_reason: str) -> str:
        """The choice's ``finish_reason``: "tool_calls" once it streamed a tool call it chose itself."""
        if self.tools_streamed and not self.parsing.named_tool and finish_reason == "stop":
            return TOOL_CALLS
        return finish_reason

    def reasoning_tokens(self) -> int:
        return int(self.parser.count_reasoning_tokens(tuple(self.token_ids)))
