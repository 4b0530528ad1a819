"""OpenAI response bodies and server-sent events for a served request, plus Kairos's route report.

Bodies follow vLLM's OpenAI server: the same text, finish and stop reasons,
usage and logprobs (completions: ``tokens``, ``token_logprobs``,
``top_logprobs`` with the sampled token's entry plus ``logprobs`` more,
``text_offset``; chat: ``content`` entries with their bytes and
``top_logprobs`` best ones), ``token_ids`` with ``return_token_ids``, echo.
A stream sends an event per token (per group of tokens with
``stream_interval``); its events concatenate to the body of the same request
unstreamed.

A response may carry the route in ``x-kairos-*`` headers and in a
``kairos`` field of the body (the first chunk of a stream), which OpenAI
clients ignore; how much of it is the ingress's choice per request
(``Exposure``: ``serving.expose_routing``, admin keys).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from enum import Enum
from typing import Any

from kairos_ray.messages import PromptLogprobs, TokenEvent, TokenLogprob
from kairos_ray.serve.dispatch import RouteTaken
from kairos_ray.serve.protocol import PreparedRequest, error_body

MIN_LOGPROB = -9999.0  # what -inf becomes in JSON, as in OpenAI's and vLLM's responses


class Exposure(Enum):
    """What of its route a response shows."""

    NONE = "none"  # nothing: the nodes and the router's reasoning are the operator's business
    ROUTE = "route"  # route, nodes, chunk schedule, transport, TTFT breakdown, the router's reason
    FULL = "full"  # and the prompt tokens the prefilling node's cache held (another tenant's prompt may be why)


def route_headers(route: RouteTaken, exposure: Exposure) -> dict[str, str]:
    """The ``x-kairos-*`` headers ``exposure`` allows."""
    if exposure is Exposure.NONE:
        return {}
    headers = {
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
    if exposure is Exposure.FULL:
        headers["x-kairos-cached-tokens"] = str(route.cached_tokens)  # prompt tokens the prefilling node held
    return headers


def route_field(route: RouteTaken, exposure: Exposure) -> dict[str, Any]:
    """The body's ``kairos`` field, as ``exposure`` allows it (empty: no field)."""
    if exposure is Exposure.NONE:
        return {}
    b = route.breakdown
    field = {
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
        "kv_bytes": route.kv_bytes,
    }
    if exposure is Exposure.FULL:
        field["cached_tokens"] = route.cached_tokens
    return {"kairos": field}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseWriter:
    """Bodies of one request's response, non-streamed or as server-sent events."""

    def __init__(
        self,
        model_id: str,
        route: RouteTaken,
        request: PreparedRequest,
        exposure: Exposure,
        index: int = 0,
        named_after: int | None = None,
    ) -> None:
        """``index``: the choice's, in a request of several prompts; ``named_after``: the request id the response is
        named after (the first prompt's; this one's by default)."""
        self.model_id, self.route, self.request = model_id, route, request
        self.route_field = route_field(route, exposure)  # the body's (or first event's) ``kairos`` field, if any
        self.options = options = request.options
        self.chat = options.chat
        self.index = index
        self.prompt_tokens = request.prompt_tokens
        prefix = "chatcmpl" if options.chat else "cmpl"
        self.id = f"{prefix}-{options.response_id or (route.request_id if named_after is None else named_after)}"
        self.created = int(time.time())
        self._text_offset = 0  # streamed completions' logprobs: where the next token's text starts
        parsing = options.parsing
        # a streamed chat's parser, if the app parses tool calls or reasoning (``serve.parsing``)
        self.parsed = parsing.stream(request.prompt_token_ids) if parsing is not None and options.stream else None

    # ---- logprobs, as vLLM's server writes them -------------------------------------------------

    def _shown(self, entry: TokenLogprob) -> str:
        return f"token_id:{entry.token_id}" if self.options.tokens_as_ids else entry.token

    def _kept(self, entries: tuple[TokenLogprob, ...], extra: int) -> list[TokenLogprob]:
        """The entries shown as top logprobs: the first ``top_logprobs + extra`` (all for -1 or logprob_token_ids)."""
        top = self.options.top_logprobs
        if self.options.all_logprobs or top == -1 or top is None:
            return list(entries)
        return list(entries[: top + extra])

    @staticmethod
    def _sampled(event: TokenEvent) -> TokenLogprob:
        return _entry_of(event.logprobs, event.token_id, event.text)

    def _rows(self, tokens: Sequence[TokenEvent], prompt: PromptLogprobs) -> list[tuple[str, float | None, Any]]:
        """A completion's logprobs rows (token as shown, its logprob, the top ones), the prompt's first (echo): its
        first token has no logprob, as in vLLM's server."""
        rows: list[tuple[str, float | None, Any]] = []
        for entries, token_id in zip(prompt, self.request.prompt_token_ids, strict=False):
            if not entries:  # the first position: vLLM's server decodes the token itself
                rows.append(
                    (f"token_id:{token_id}" if self.options.tokens_as_ids else self.request.first_token, None, None)
                )
                continue
            own = _entry_of(entries, token_id, "")
            rows.append((self._shown(own), own.logprob, self._tops(entries)))
        for event in tokens:
            sampled = self._sampled(event)
            rows.append((self._shown(sampled), sampled.logprob, self._tops(event.logprobs)))
        return rows

    def _tops(self, entries: tuple[TokenLogprob, ...]) -> dict[str, float]:
        return {self._shown(e): max(e.logprob, MIN_LOGPROB) for e in self._kept(entries, 1)}

    def _completion_logprobs(
        self, tokens: Sequence[TokenEvent], offset: int, prompt: PromptLogprobs = ()
    ) -> tuple[dict[str, Any] | None, int]:
        """(the ``logprobs`` of ``tokens``, the text offset after them), their text starting at ``offset``;
        ``prompt``: the prompt's logprobs, shown before the tokens' (``echo``)."""
        if self.options.top_logprobs is None:
            return None, offset
        offsets, values, shown, tops = [], [], [], []
        for token, logprob, top in self._rows(tokens, prompt):
            offsets.append(offset)
            values.append(None if logprob is None else max(logprob, MIN_LOGPROB))
            shown.append(token)
            tops.append(top)
            offset += len(token)
        return {"text_offset": offsets, "token_logprobs": values, "tokens": shown, "top_logprobs": tops}, offset

    def _echoed_logprobs(self, tokens: Sequence[TokenEvent]) -> tuple[PromptLogprobs, Sequence[TokenEvent]]:
        """(the prompt's logprobs a completion with ``echo`` shows before its tokens', the tokens whose logprobs it
        shows: none when it echoes the prompt alone); ``tokens``: its first ones."""
        if not self.options.echo or not tokens:
            return (), tokens
        return tokens[0].prompt_logprobs, () if self.options.echo_only else tokens

    def _chat_logprobs(self, tokens: Sequence[TokenEvent]) -> dict[str, Any] | None:
        if self.options.top_logprobs is None:
            return None
        content = []
        for event in tokens:
            sampled = self._sampled(event)
            top = [
                {"token": (shown := self._shown(e)), "logprob": max(e.logprob, MIN_LOGPROB), "bytes": _bytes(shown)}
                for e in self._kept(event.logprobs, 0)
            ]
            content.append(
                {
                    "token": self._shown(sampled),
                    "logprob": max(sampled.logprob, MIN_LOGPROB),
                    "bytes": _bytes(sampled.token),
                    "top_logprobs": top,
                }
            )
        return {"content": content}

    # ---- bodies ----------------------------------------------------------------------------------

    def _echo(self) -> str:
        """Completions with ``echo``: the prompt's text before the answer (none when token ids are returned)."""
        return self.request.prompt_text if self.options.echo and not self.options.return_token_ids else ""

    def _answer_text(self, text: str) -> str:
        """A completion's text: the prompt's (``echo``), then the answer's (none with ``echo`` and max_tokens 0)."""
        return self._echo() + ("" if self.options.echo_only else text)

    def full(self, tokens: Sequence[TokenEvent]) -> dict[str, Any]:
        """The whole response body of a request that was not streamed."""
        text = "".join(t.text for t in tokens)
        last = tokens[-1]
        choice: dict[str, Any] = {"index": self.index}
        extra: dict[str, Any] = {}
        finish_reason = last.finish_reason or "length"
        hidden = False  # a hidden reasoning's logprobs and token ids are not shown either
        details: dict[str, Any] = {}
        if self.chat:
            parsing = self.options.parsing
            if parsing is None:
                choice["message"] = {"role": self.options.role, "content": text}
            else:
                ids, prompt = [t.token_id for t in tokens], self.request.prompt_token_ids
                choice["message"], finish_reason, thought = parsing.message(
                    self.options.role, text, ids, prompt, finish_reason
                )
                hidden = parsing.hides_reasoning
                if parsing.parsers.reasoning:
                    details["completion_tokens_details"] = {"reasoning_tokens": thought}
            if self.options.echo_message:
                choice["message"]["content"] = self.options.echo_message + (choice["message"]["content"] or "")
            choice["logprobs"] = None if hidden else self._chat_logprobs(tokens)
            if self.options.return_token_ids:
                extra["prompt_token_ids"] = list(self.request.prompt_token_ids)
            if self.options.return_prompt_text:
                extra["prompt_text"] = self.request.prompt_text
        else:
            choice["text"] = self._answer_text(text)
            echoed, shown = self._echoed_logprobs(tokens)
            choice["logprobs"] = self._completion_logprobs(shown, 0, echoed)[0]
            if self.options.return_token_ids:
                choice["prompt_token_ids"] = list(self.request.prompt_token_ids)
            if tokens[0].prompt_logprobs:
                choice["prompt_logprobs"] = prompt_logprobs(tokens[0].prompt_logprobs)
        if self.chat and tokens[0].prompt_logprobs:
            extra["prompt_logprobs"] = prompt_logprobs(tokens[0].prompt_logprobs)
        choice["finish_reason"] = finish_reason
        choice["stop_reason"] = last.stop_reason
        if self.options.return_token_ids and not hidden:
            choice["token_ids"] = [t.token_id for t in tokens]
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model_id,
            "choices": [choice],
            "usage": {**usage(self.prompt_tokens, len(tokens)), **details},
            **extra,
            **self.route_field,
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

    def tokens(self, ready: Sequence[TokenEvent]) -> str:
        """The events of tokens that came together: one per token (one for all with ``stream_interval``)."""
        if self.options.grouped:
            return self._tokens_event(ready)
        return "".join(self._tokens_event((event,)) for event in ready)

    def _tokens_event(self, tokens: Sequence[TokenEvent]) -> str:
        """One streamed event for ``tokens``; the first event carries the ``kairos`` field."""
        first, last = tokens[0].index == 0, tokens[-1]
        text = "".join(t.text for t in tokens)
        choice: dict[str, Any] = {"index": self.index}
        extra: dict[str, Any] = dict(self.route_field) if first else {}
        hidden = False
        if self.chat:
            if self.parsed is None:
                delta: dict[str, Any] | None = {"content": text}
                choice["logprobs"] = self._chat_logprobs(tokens)
            else:
                delta = self.parsed.delta(text, [t.token_id for t in tokens], last.finished)
                hidden = self.parsed.parsing.hides_reasoning
                choice["logprobs"] = None if hidden else self._chat_logprobs(tokens)
                shows_tokens = choice["logprobs"] is not None or (self.options.return_token_ids and not hidden)
                if delta is None and not (first or last.finished or shows_tokens):
                    return ""  # nothing to show yet (a tool call's opening markup, say): no event, as vLLM's server
            if first and self.options.echo_message:  # the last message's content, then the answer's
                delta = {**(delta or {}), "content": self.options.echo_message + ((delta or {}).get("content") or "")}
            choice["delta"] = {"role": self.options.role, **(delta or {})} if first else (delta or {})
            if first and self.options.return_token_ids:
                extra["prompt_token_ids"] = list(self.request.prompt_token_ids)
            if first and self.options.return_prompt_text:
                extra["prompt_text"] = self.request.prompt_text
        else:
            prompt, shown = self._echoed_logprobs(tokens) if first else ((), tokens)
            choice["text"] = self._answer_text(text) if first else text
            choice["logprobs"], self._text_offset = self._completion_logprobs(shown, self._text_offset, prompt)
            if first and (self.options.return_token_ids or self.options.echo):  # as vLLM's server streams them
                choice["prompt_token_ids"] = list(self.request.prompt_token_ids)
        finish_reason = last.finish_reason or "length"
        if self.parsed is not None:
            finish_reason = self.parsed.finish_reason(finish_reason)
        choice["finish_reason"] = finish_reason if last.finished else None
        choice["stop_reason"] = last.stop_reason if last.finished else None
        if self.options.return_token_ids and not hidden:
            choice["token_ids"] = [t.token_id for t in tokens]
        if self.options.continuous_usage:
            extra["usage"] = usage(self.prompt_tokens, last.index + 1)
        return self._event(self._chunk([choice], **extra))

    def usage(
        self, completion_tokens: int, prompt_tokens: int | None = None, reasoning_tokens: int | None = None
    ) -> str:
        """The closing usage event (``stream_options.include_usage``); ``prompt_tokens``: all prompts' (this
        one's by default); ``reasoning_tokens``: all choices' (``responses.reasoning_tokens``), if counted."""
        prompts = self.prompt_tokens if prompt_tokens is None else prompt_tokens
        counted: dict[str, Any] = {**usage(prompts, completion_tokens)}
        if reasoning_tokens is not None:
            counted["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return self._event(self._chunk([], usage=counted))

    def error(self, message: str) -> str:
        """An OpenAI error object as a stream event: the stream cannot go on (``[DONE]`` follows)."""
        return self._event(error_body(message, None, "server_error", 503))

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"


def prompt_tokens(writers: Sequence[ResponseWriter]) -> int:
    """The prompt tokens of a request of several choices as vLLM's server counts them: each prompt once, not
    once per sample."""
    return sum(writer.prompt_tokens for writer in writers if writer.request.sample == 0)


def reasoning_tokens(writers: Sequence[ResponseWriter]) -> int | None:
    """The reasoning tokens of a streamed chat's choices, where a reasoning parser counts them (else None)."""
    parsed = [writer.parsed for writer in writers if writer.parsed is not None]
    if not parsed or not parsed[0].parsing.parsers.reasoning:
        return None
    return sum(p.reasoning_tokens() for p in parsed)


def batch_body(bodies: Sequence[dict[str, Any]], prompt_tokens: int) -> dict[str, Any]:
    """The body of a request of several choices (prompts, samples) from each choice's own
    (``ResponseWriter.full``): the choices in order, usage summed (``prompt_tokens``: see ``prompt_tokens``;
    reasoning tokens where counted); each choice carries its own route (``kairos``), if shown."""
    choices = []
    for body in bodies:
        (choice,) = body["choices"]
        choices.append({**choice, **({"kairos": body["kairos"]} if "kairos" in body else {})})
    completion_tokens = sum(body["usage"]["completion_tokens"] for body in bodies)
    first = {key: value for key, value in bodies[0].items() if key != "kairos"}
    summed: dict[str, Any] = {**usage(prompt_tokens, completion_tokens)}
    if "completion_tokens_details" in bodies[0]["usage"]:  # reasoning counted (``serve.parsing``)
        thought = sum(body["usage"]["completion_tokens_details"]["reasoning_tokens"] for body in bodies)
        summed["completion_tokens_details"] = {"reasoning_tokens": thought}
    return {**first, "choices": choices, "usage": summed}


def prompt_logprobs(prompt: PromptLogprobs) -> list[dict[int, dict[str, Any]] | None]:
    """A body's ``prompt_logprobs``, as vLLM's server writes them: per prompt position (None at the first), each
    entry's logprob, rank and decoded token by token id."""
    return [
        {
            e.token_id: {"logprob": max(e.logprob, MIN_LOGPROB), "rank": e.rank, "decoded_token": e.token}
            for e in entries
        }
        if entries
        else None
        for entries in prompt
    ]


def _entry_of(entries: tuple[TokenLogprob, ...], token_id: int, text: str) -> TokenLogprob:
    """The entry of ``token_id`` among a position's (one at the lowest logprob, shown as ``text``, if missing)."""
    for entry in entries:
        if entry.token_id == token_id:
            return entry
    return TokenLogprob(token_id, text, MIN_LOGPROB)


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))
