"""The OpenAI-compatible request shapes the ingress accepts, and its error objects.

Unknown fields are accepted and ignored, as OpenAI-compatible servers do
(clients and benchmark tools send extras such as ``ignore_eos``). Known fields
are checked: a bad value is an HTTP 400 with an OpenAI-style error object
naming the parameter.

With vLLM engines the model's tokenizer counts (``serve.tokens``); emulated
engines count one token per whitespace-separated word of a text
prompt (a prompt may also be a list of token ids); a chat request counts its
messages' words plus 4 tokens per message for the template.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False  # vLLM's extension: always generate max_tokens
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # vLLM's range: a 64-bit signed integer

    def sampling(self) -> dict[str, Any]:
        """vLLM ``SamplingParams`` fields of this request."""
        extra = {"seed": self.seed} if self.seed is not None else {}
        return {"temperature": self.temperature, "top_p": self.top_p, "ignore_eos": self.ignore_eos, **extra}

    @property
    def output_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 16

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed event (vLLM's ``continuous_usage_stats``): clients count tokens per event."""
        return self.include_usage and bool(self.stream_options and self.stream_options.get("continuous_usage_stats"))


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("one prompt per request (batches of prompts are not supported)")
            if not value[0]:
                raise ValueError("prompt must not be empty")
        return value

    def prompt_tokens(self) -> int:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return len(prompt)
        text = prompt if isinstance(prompt, str) else str(prompt[0])
        return max(1, len(text.split()))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, value: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        for part in value if isinstance(value, list) else ():
            if part.get("type", "text") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are served here, got {part.get('type')!r}")
        return value

    def words(self) -> int:
        if isinstance(self.content, str):
            return len(self.content.split())
        if isinstance(self.content, list):
            return sum(len(str(part.get("text", "")).split()) for part in self.content)
        return 0


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)

    def prompt_tokens(self) -> int:
        return sum(4 + m.words() for m in self.messages)


def error_body(
    message: str, param: str | None = None, kind: str = "invalid_request_error", code: int | None = None
) -> dict[str, Any]:
    """OpenAI's error object (``code``: the HTTP status, as vLLM's server gives it)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
