"""Prompt tokens as the engines will see them, counted before routing.

The router decides on the prompt's length, so the ingress tokenizes first.
With vLLM engines it uses the model's own tokenizer (and chat template) and
hands the token ids to the engines; with emulated engines a prompt counts one
token per word (``serve.protocol``) and carries no ids.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from kairos_ray.serve.protocol import ChatCompletionRequest, CompletionRequest


class PromptTokenizer:
    """``source``: the model's tokenizer location (vLLM engines), or None (emulated engines)."""

    def __init__(self, source: str | None) -> None:
        self.tokenizer: Any = None
        if source is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(source)

    def __call__(self, request: CompletionRequest | ChatCompletionRequest) -> tuple[int, tuple[int, ...]]:
        """(prompt tokens, their ids: empty for emulated engines)."""
        if self.tokenizer is None:
            return request.prompt_tokens(), ()
        if isinstance(request, ChatCompletionRequest):
            messages = [m.model_dump(exclude_none=True) for m in request.messages]
            try:
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            except (TemplateError, TypeError, KeyError, IndexError) as exc:  # the template refused these messages
                raise ValueError(f"the chat template cannot render these messages: {exc}") from None
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers return an encoding
                ids = ids["input_ids"]
        elif isinstance(request.prompt, list) and isinstance(request.prompt[0], int):
            ids = request.prompt
            vocab = len(self.tokenizer)
            if any(not 0 <= int(t) < vocab for t in ids):
                raise ValueError(f"prompt token ids must lie in [0, {vocab}) for this model")
        else:
            text = request.prompt if isinstance(request.prompt, str) else str(request.prompt[0])
            ids = self.tokenizer.encode(text)
        return len(ids), tuple(int(t) for t in ids)
