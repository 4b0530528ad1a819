"""The typed messages that cross process boundaries in the live app, built in one place each and read everywhere.

In the style of vLLM v1's ``EngineCoreRequest`` / ``EngineCoreOutput``: small
frozen structs, every field commented, units in the names.

| message | from -> to | built by |
|---|---|---|
| ``EngineRequest`` | ingress -> prefill or decode node | ``serve.dispatch`` |
| ``KVHandoff`` | prefill node -> (ingress) -> decode node | each engine's ``prefill`` |
| ``TokenEvent`` (streamed in lists: the tokens ready at once) | decode node -> ingress | each engine's ``generate`` |
| ``NodeState`` (with its ``StepRecord`` s) | engine node -> router | ``engines.reporting.StateReporter`` |
| ``DecisionRequest`` | ingress -> router | ``serve.dispatch`` (batched per event-loop tick) |
| ``RoutingReply`` | router -> ingress | ``serve.router.Router.decide`` (or the ingress's fallback) |

Per-request timing (a running TBT clock, the TTFT) stays with the request's
handler in the ingress, never inside a reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from kairos_ray.core import Decision, DecodeNodeView, PrefillNodeView, Route

if TYPE_CHECKING:  # vLLM's class; the emulated engines only read ``max_tokens``, which the request carries itself
    from vllm import SamplingParams


class Role(StrEnum):
    """What a node does in the disaggregated cluster."""

    PREFILL = "prefill"  # prefills prompts and hands their KV over
    DECODE = "decode"  # decodes; prefills deflected prompts in place, in chunks


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request as the ingress hands it to an engine node."""

    request_id: int  # unique in the app, assigned by the ingress
    prompt_tokens: int  # prompt length, as the router priced it
    max_tokens: int  # tokens to generate, the first included
    arrival_wall_s: float  # time.time() when the ingress accepted it
    chunk_schedule: tuple[int, ...] = ()  # deflected: prefill in these chunks, in place (Eq. 5's X*)
    prompt_token_ids: tuple[int, ...] = ()  # the tokenized prompt (vLLM engines need it; emulated ones do not)
    sampling: SamplingParams | None = None  # as vLLM's OpenAI server builds it (None: its defaults; emulated engines)
    priority: int = 0  # vLLM's request priority (lower first; a no-op under FCFS scheduling)
    cache_salt: str | None = None  # salts the prompt's prefix-cache hashes on the engines (vLLM's ``cache_salt``)
    kv_receiver: str = ""  # disaggregated: the decode node chosen to continue it ("" when the router fell back)
    attempt: int = 0  # 0 for the first try; a retry or a migration runs as a new attempt (engines key on both)
    output_offset: int = 0  # tokens generated before a migration: this attempt's first token has this index


@dataclass(frozen=True, slots=True)
class KVHandoff:
    """What a prefill node hands over for a disaggregated request: where its KV is, and how long it took."""

    kv: Any  # a transport's reference: ray.ObjectRef, kv.channel.ChannelTicket, or another connector's params
    kv_bytes: int  # bytes of KV that travel (0 when another vLLM connector moves them itself)
    node_id: str  # the prefill node that built it
    prefill_queue_s: float  # waiting on the prefill node before its first step
    prefill_exec_s: float  # first prefill step to the last
    prefill_end_wall_s: float  # time.time() when the prompt's last chunk finished
    transport: str  # how the KV travels: object_store, gloo or nccl (a channel), or a vLLM connector's name


@dataclass(frozen=True, slots=True)
class TTFTBreakdown:
    """Where a request's time to first token went (seconds; the parts add up to the TTFT at the ingress)."""

    prefill_queue_s: float = 0.0  # arrival to the first prefill step (routing and RPCs included, at the ingress)
    prefill_exec_s: float = 0.0  # first prefill step to the last (on the decode node when deflected)
    kv_transfer_s: float = 0.0  # prefill end to the KV being ready on the decode node (0 when deflected)
    decode_queue_s: float = 0.0  # KV ready to the first token (0 when deflected)

    @property
    def total_s(self) -> float:
        return self.prefill_queue_s + self.prefill_exec_s + self.kv_transfer_s + self.decode_queue_s


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One entry of a generated position's logprobs, as vLLM returns it."""

    token_id: int
    token: str  # the token decoded as vLLM decodes it for logprobs
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token, streamed by the decode node."""

    token_id: int
    index: int  # position in the output, 0 for the first token
    finished: bool  # the request's last token
    node_id: str  # the decode node that streams it
    text: str = ""  # the text this token adds (may be empty: part of a character, or held back for stop strings)
    finish_reason: str | None = None  # on the last token: "length" or "stop"
    breakdown: TTFTBreakdown | None = None  # on the first token only: what the engines timed of the TTFT
    logprobs: tuple[TokenLogprob, ...] = ()  # requests with logprobs: vLLM's entries, the sampled token's first
    stop_reason: int | str | None = None  # on the last token: the stop string or token id that ended it, if any


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step as measured: Eq. 4's features and its time."""

    batch_size: int  # B: requests decoding in the step
    kv_tokens: int  # K: KV tokens resident on the node
    chunk_tokens: int  # chi: prefill tokens computed in the step
    measured_s: float  # wall time of the step
    predicted_s: float  # the node's step-latency model for the same features (0.0 without a model)
    prefix_tokens: int = 0  # P: the chunk's own prefix (its request's tokens prefilled before this step)


@dataclass(frozen=True, slots=True)
class NodeState:
    """A node's report to the router: after its steps (at most every ``report_interval_s``) and on a heartbeat."""

    view: PrefillNodeView | DecodeNodeView  # what the policy decides on (the core's snapshot of this node)
    ray_node_id: str  # the Ray node (host) the engine runs on
    wall_s: float  # time.time() when the report was built
    steps: tuple[StepRecord, ...] = ()  # steps since the previous report, oldest first (bounded)
    accepted_request_ids: tuple[
        int, ...
    ] = ()  # requests taken since the previous report: the router's ledger drops them
    num_waiting: int = 0  # decode: disaggregated requests whose KV is here, waiting for a batch slot
    pinned_kv: int = 0  # prefill: hand-offs whose KV this node still holds for a decode node
    kv_recomputes: int = 0  # decode: hand-offs whose KV was lost or late, recomputed here (cumulative)
    kv_usage: float = 0.0  # share of the node's KV cache in use, as its engine counts it
    healthy: bool = True  # False: its engine died or stopped making progress (the router drops the node at once)

    @property
    def node_id(self) -> str:
        return self.view.node_id

    @property
    def role(self) -> Role:
        return Role.PREFILL if isinstance(self.view, PrefillNodeView) else Role.DECODE

    @property
    def last_step(self) -> StepRecord | None:
        return self.steps[-1] if self.steps else None


@dataclass(frozen=True, slots=True)
class DecisionRequest:
    """What the router needs to route one request."""

    request_id: int
    prompt_tokens: int  # l_r
    output_tokens: int  # max_tokens: a deflection reserves KV for them on its node
    avoid: tuple[str, ...] = ()  # nodes that failed this request: decide without them


@dataclass(frozen=True, slots=True)
class RoutingReply:
    """The router's answer for one request."""

    decision: Decision  # Algorithm 1's output and the estimates behind it
    decision_s: float  # time the router spent deciding
    staleness_s: float  # age of the oldest engine report behind the decision
    fallback: bool = False  # the router could not decide: plain disaggregation on any nodes (counted)

    @classmethod
    def fallback_for(cls, reason: str) -> RoutingReply:
        """Plain disaggregation on whichever nodes Serve picks, when the router cannot decide."""
        decision = Decision(Route.PREFILL, None, None, (), None, None, f"fallback: {reason}")
        return cls(decision, 0.0, 0.0, fallback=True)
