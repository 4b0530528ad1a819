"""OpenAI's Responses API (``POST /v1/responses``) for text in and out, as vLLM's server serves it.

A request is parsed and checked with vLLM's ``ResponsesRequest`` and rendered
by vLLM's renderer (its ``instructions`` and ``input`` through the chat
template); its sampling parameters are vLLM's (``to_sampling_params``). It
is then routed and run as any chat (one choice). The answer is built with
vLLM's own pieces: its parser splits reasoning, text and function calls out
of the text (whole, or delta by delta when streamed), its event processor
(``SimpleStreamingEventProcessor``) turns the deltas into the stream's
events (``response.created``, ``response.in_progress``, items and content
parts opened, ``response.output_text.delta`` ..., closed,
``response.completed``, each ``event: <type>`` with a sequence number), and
``ResponsesResponse.from_request`` writes the response object.

List-valued fields are capped as on the other endpoints (``protocol.LIST_CAPS``:
the input's items, stop strings and token ids, logit biases). What the app
cannot serve is a 400 naming the field (``REFUSED``): stored
responses (``previous_response_id``; ``store`` is accepted and ignored, as
by vLLM's server unless it stores), background mode, a stored ``prompt``,
built-in tools (function tools are served), output logprobs (``include``),
the rendered messages (``enable_response_messages``), and, as on the other
endpoints, the app's own engine arguments (``kv_transfer_params``,
``ec_transfer_params``, ``vllm_xargs``).
Emulated engines have no tokenizer: there the endpoint is a 501.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from openai.types.responses import ResponseStatus
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.responses.protocol import (
    InputTokensDetails,
    OutputTokensDetails,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from vllm.entrypoints.openai.responses.streaming_events import SimpleStreamingEventProcessor, split_delta
from vllm.entrypoints.openai.responses.utils import build_response_output_items

from kairos_ray.messages import TokenEvent
from kairos_ray.serve.dispatch import RouteTaken
from kairos_ray.serve.protocol import REFUSALS, PreparedRequest, Refusal, RequestError, first_refused, over_cap
from kairos_ray.serve.responses import Exposure, ResponseWriter

REFUSED: tuple[Refusal, ...] = (
    Refusal("previous_response_id", "stored responses are not served", lambda r: r.previous_response_id is not None),
    Refusal("background", "background mode is not served (responses are not stored)", lambda r: bool(r.background)),
    Refusal("prompt", "stored prompts are not served", lambda r: r.prompt is not None),
    Refusal(
        "tools",
        "built-in tools are not served (function tools are)",
        lambda r: any(t.type != "function" for t in r.tools),
    ),
    Refusal("include", "output logprobs are not served on /v1/responses", lambda r: r.is_include_output_logprobs()),
    Refusal(
        "enable_response_messages",
        "the rendered messages are not returned",
        lambda r: r.enable_response_messages,
    ),
    *(refused for refused in REFUSALS if refused.param in ("kv_transfer_params", "ec_transfer_params", "vllm_xargs")),
)
"""What ``/v1/responses`` refuses with a 400 (``ResponsesRequest`` s)."""


def refusal(request: ResponsesRequest) -> RequestError | None:
    """The 400 for the first thing of ``request`` the app does not serve (or over a cap), or None."""
    return over_cap(request) or first_refused(REFUSED, request)


@dataclass(frozen=True, slots=True)
class ResponsesTurn:
    """What a Responses answer is built from besides its tokens: the request as vLLM's model holds it, its
    sampling parameters (the response echoes them) and its parser, if the app has one."""

    request: ResponsesRequest
    sampling: Any  # vllm.SamplingParams
    new_parser: Callable[[], Any] | None  # a fresh vllm.parser.Parser for the request (stateful when streamed)
    enable_auto_tools: bool = False


class ResponsesWriter(ResponseWriter):
    """The response of one ``/v1/responses`` request, whole or as its stream of events (vLLM's server's)."""

    def __init__(self, model_id: str, route: RouteTaken, request: PreparedRequest, exposure: Exposure) -> None:
        super().__init__(model_id, route, request, exposure)
        turn = request.options.responses
        assert isinstance(turn, ResponsesTurn)
        self.turn = turn
        self.cached_tokens = route.cached_tokens if exposure is Exposure.FULL else 0  # another tenant's, maybe
        self.parser = turn.new_parser() if turn.new_parser is not None else None
        self.prompt_ids = list(request.prompt_token_ids) if self.parser is not None else []  # the parser's, once
        self.events = SimpleStreamingEventProcessor(tools=turn.request.tools)
        self.sequence = 0  # the next event's sequence number
        self.generated: list[int] = []  # streamed: the token ids so far

    def _response(self, output: list[Any], status: ResponseStatus, generated: Sequence[int] = ()) -> dict[str, Any]:
        """The response object (``usage`` once it has finished), with the route where it is shown."""
        usage = None
        if status != "in_progress":
            reasoning = self.parser.count_reasoning_tokens(list(generated)) if self.parser is not None else 0
            usage = ResponseUsage(
                input_tokens=self.prompt_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=self.cached_tokens, cache_write_tokens=0),
                output_tokens=len(generated),
                output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
                total_tokens=self.prompt_tokens + len(generated),
            )
        turn = self.turn
        response = ResponsesResponse.from_request(
            turn.request,
            turn.sampling,
            self.model_id,
            self.created,
            output,
            status,
            usage,
        )
        return {**response.model_dump(mode="json", by_alias=True), **(self.route_field if usage else {})}

    @staticmethod
    def _status(last: TokenEvent) -> ResponseStatus:
        """``incomplete`` when the answer ran out of tokens, as vLLM's server says."""
        return "incomplete" if last.finish_reason == "length" else "completed"

    def full(self, tokens: Sequence[TokenEvent]) -> dict[str, Any]:
        text, ids = "".join(t.text for t in tokens), [t.token_id for t in tokens]
        request = self.turn.request
        reasoning, content, calls = None, text, None
        if self.parser is not None:
            reasoning, content, calls = self.parser.parse(
                text, request, enable_auto_tools=self.turn.enable_auto_tools, model_output_token_ids=ids
            )
            if not request.include_reasoning:
                reasoning = None
        output = build_response_output_items(reasoning, content, calls or [], tools=request.tools)
        return self._response(output, self._status(tokens[-1]), ids)

    def _event(self, event: Any) -> str:
        """One server-sent event, ``event: <type>``, numbered in the stream's order."""
        body = event if isinstance(event, dict) else event.model_dump(mode="json", by_alias=True)
        body["sequence_number"] = self.sequence
        self.sequence += 1
        return f"event: {body['type']}\ndata: {json.dumps(body)}\n\n"

    def tokens(self, ready: Sequence[TokenEvent]) -> str:
        """The events of tokens that came together: the response's opening ones first, its closing ones last."""
        events: list[Any] = []
        if ready[0].index == 0:
            opened = self._response([], "in_progress")
            events += [{"type": kind, "response": opened} for kind in ("response.created", "response.in_progress")]
        processor = self.events
        for token in ready:
            self.generated.append(token.token_id)
            for part in split_delta(delta) if (delta := self._delta(token)) else ():
                target, call = processor.resolve_target_state(part)
                if target.name == "NONE":
                    continue
                if processor.needs_transition(target, call):
                    events += processor.close_current() + processor.open(target, call)
                events += processor.emit_delta(part, None)  # type: ignore[arg-type]
        last = ready[-1]
        if last.finished:
            events += processor.close_current()
            output = processor.output_items
            events.append(
                {
                    "type": "response.completed",
                    "response": self._response(output, self._status(last), self.generated),
                }
            )
        return "".join(self._event(event) for event in events)

    def _delta(self, token: TokenEvent) -> DeltaMessage | None:
        if self.parser is None:
            return DeltaMessage(content=token.text)
        return self.parser.parse_delta(  # type: ignore[no-any-return]
            delta_text=token.text,
            delta_token_ids=[token.token_id],
            request=self.turn.request,
            prompt_token_ids=self.prompt_ids,
            finished=token.finished,
        )

    def usage(self, *_: Any, **__: Any) -> str:
        return ""  # in ``response.completed``

    def error(self, message: str) -> str:
        return self._event({"type": "error", "code": "server_error", "message": message, "param": None})

    @staticmethod
    def done() -> str:
        return ""  # a Responses stream ends with ``response.completed`` (or ``error``), no ``[DONE]``
