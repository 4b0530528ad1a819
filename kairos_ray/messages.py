"""The typed messages that cross process boundaries in the live app, built in one place each and read everywhere.

In the style of vLLM v1's ``EngineCoreRequest`` / ``EngineCoreOutput``: small
frozen structs, every field commented, units in the names.

| message | from -> to | built by |
|---|---|---|
| ``EngineRequest`` | ingress -> prefill or decode node | ``serve.dispatch`` |
| ``KVHandoff`` | prefill node -> (ingress) -> decode node | each engine's ``prefill`` |
| ``TokenEvent`` (in lists: the tokens ready at once) | decode engine -> its server | each engine's ``generate`` |
| ``TokenBatch`` | decode node -> ingress replica (one subscription each) | ``serve.mux.Outbox`` |
| ``NodeState`` (``StepRecord`` s, ``PrefixDelta``) | engine node -> router | ``engines.reporting.StateReporter`` |
| ``DecisionRequest`` | ingress -> router | ``serve.dispatch`` (batched per event-loop tick) |
| ``RoutingReply`` | router -> ingress | ``serve.router.RouterActor.decide_many`` (or the ingress's fallback) |
| ``WireAddress`` | router -> ingress and engines (over Ray, once per connection) | ``serve.wire.WireServer`` |
| ``RouterLive`` (a ``NodeLive`` per node) | router -> ingress | ``serve.live.RouterWindow`` |
| ``LiveState`` (with a ``ServiceLive``) | ingress -> ``kairos top`` (JSON) | ``serve.live`` |
| ``Residue`` | ingress, router, engine node -> tests and tools | each deployment's ``residue`` |

Per-request timing (a running TBT clock, the TTFT) stays with the request's
handler in the ingress, never inside a reply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from kairos_ray.core import CacheDelta, Decision, DecodeNodeView, PrefillNodeView, Route, StepLatencyModel

if TYPE_CHECKING:  # vLLM's class; the emulated engines only read ``max_tokens``, which the request carries itself
    from vllm import SamplingParams


class Role(StrEnum):
    """What a node does in the disaggregated cluster."""

    PREFILL = "prefill"  # prefills prompts and hands their KV over
    DECODE = "decode"  # decodes; prefills deflected prompts in place, in chunks


SHED_HEADER = "x-kairos-shed"
"""The header of a 429 that admission shed (``core.admission``), naming its reason: clients and ``kairos bench`` tell
it from other refusals by it."""


@dataclass(frozen=True, slots=True)
class NodeId:
    """A node's id, ``<group>-<Serve replica unique id>``: built and read here alone (it travels as its string).

    The group is its pool's role, followed by the group's index from the second node group of a role on
    (``decode``, ``decode-1``: ``AppArgs.decode_config`` as a list); it names the node group, not its deployment
    (a group may name its deployment otherwise: ``deployment_config.name``). The replica id is what Serve
    routes a call to (``serve.delivery``).
    """

    role: Role
    replica: str  # Serve's unique id of the node's replica (letters and digits)
    group: int = 0  # the index of the node's group among its role's (0: the first, or the only one)

    @property
    def group_name(self) -> str:
        """``decode`` for a role's first group, ``decode-1`` for its second, ..."""
        return self.role.value if self.group == 0 else f"{self.role.value}-{self.group}"

    def __str__(self) -> str:
        return f"{self.group_name}-{self.replica}"

    @classmethod
    def parse(cls, node_id: str) -> NodeId:
        """The id a string names; ``ValueError`` for a string that is no node id."""
        role, _, rest = node_id.partition("-")
        group, sep, replica = rest.rpartition("-")
        ok = role in Role.__members__.values() and replica.isalnum() and (not sep or group.isdecimal())
        if not ok or group[:1] == "0":
            raise ValueError(f"{node_id!r} is no node id (<role>[-<group>]-<replica id>)")
        return cls(Role(role), replica, int(group or 0))


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request as the ingress hands it to an engine node."""

    request_id: int  # unique in the app, assigned by the ingress
    prompt_tokens: int  # prompt length, as the router priced it
    max_tokens: int  # tokens to generate, the first included
    arrival_wall_s: float  # time.time() when the ingress accepted it
    chunk_schedule: tuple[int, ...] = ()  # deflected: prefill in these chunks, in place (Eq. 5's X*)
    prompt_token_ids: tuple[int, ...] = ()  # the tokenized prompt (vLLM engines need it; emulated ones hash it)
    sampling: SamplingParams | None = None  # as vLLM's OpenAI server builds it (None: its defaults; emulated engines)
    priority: int = 0  # vLLM's request priority (lower first; a no-op under FCFS scheduling)
    cache_salt: str | None = None  # salts the prompt's prefix-cache hashes on the engines (vLLM's ``cache_salt``)
    kv_receiver: str = ""  # disaggregated: the decode node chosen to continue it ("" when the router fell back)
    kv_receiver_cached_tokens: int = 0  # disaggregated: leading prompt tokens kv_receiver's cache holds (not sent)
    attempt: int = 0  # 0 for the first try; a retry or a migration runs as a new attempt (engines key on both)
    output_offset: int = 0  # tokens generated before a migration: this attempt's first token has this index
    # the model the router priced its decode node with (RoutingReply.decode_model): that node's run-time chunk and
    # join guards check with it (None: the node's configured profile)
    decode_model: StepLatencyModel | None = None


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
    cached_tokens: int = 0  # prompt tokens the prefill node's prefix cache held (not computed there)
    skipped_tokens: int = 0  # leading prompt tokens whose KV did not travel: the receiver's cache holds them
    prompt_logprobs: PromptLogprobs = ()  # the prompt's logprobs, where the request asked for them


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
    rank: int = 0  # the token's rank in its position's distribution (1: the likeliest); shown for prompt tokens


PromptLogprobs = tuple[tuple[TokenLogprob, ...], ...]
"""A prompt's logprobs as vLLM computes them (``prompt_logprobs``): per prompt position, the prompt's token's entry
first, then the likeliest ones; the first position has none (``()``, vLLM's None). Empty: none were asked for."""


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
    cached_tokens: int = 0  # on the first token, deflected: prompt tokens this node's prefix cache held
    # on the first token, where the request asked for them: its prompt's logprobs, computed where the prompt was
    # prefilled (this node when deflected, else the prefill node, whose hand-off carried them)
    prompt_logprobs: PromptLogprobs = ()


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """What a decode node streams to one ingress replica in one item: every token ready since the last item."""

    tokens: dict[tuple[int, int], list[TokenEvent]]  # (request id, attempt) -> its new tokens, in order
    failed: dict[tuple[int, int], str]  # (request id, attempt) -> why its run on the node failed


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step as measured: Eq. 4's features and its time."""

    batch_size: int  # B: requests decoding in the step
    kv_tokens: int  # K: KV tokens resident on the node
    chunk_tokens: int  # chi: prefill tokens computed in the step
    measured_s: float  # wall time of the step
    predicted_s: float  # a step-latency model's time for the same features: the node's, then the router's
    prefix_tokens: int = 0  # P: the chunk's own prefix (its request's tokens prefilled before this step)


@dataclass(frozen=True, slots=True)
class PrefixDelta:
    """A node's prefix-cache changes since its previous report (the router mirrors the cache from them)."""

    block_tokens: int  # the node's KV block size: the router matches a prompt's hashes of this block size
    seq: int  # 0, 1, 2... per node: a gap means a lost report, and the mirror waits for a full delta
    delta: CacheDelta  # blocks stored and removed (vLLM's KV events, folded), or the whole cache when ``full``


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
    prefix: PrefixDelta | None = None  # its prefix cache's changes since the previous report (None: none)

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
    # block size -> the prompt's chained block hashes as vLLM's KV events name them (``core.prefix.block_ids``),
    # for the block sizes the router asked for (``RoutingReply.block_tokens``); empty: no prefix identity
    block_ids: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    priority: int = 0  # vLLM's request priority (lower is more important): admission sheds the least important first
    sheddable: bool = True  # False for a retry or a migration of an admitted request: routed, never shed
    # a decode node known to hold the prompt's KV (another sample of the prompt has its first token there): its hit
    # is every block a hit may count, whether or not its prefix-cache report has come in ("": none known)
    held_on: str = ""
    # router shards (``serving.router_shards``): the shards the asker deems live; the shard asked decides on the
    # decode nodes it owns among them (``core.shards.assign``), taking over a dead shard's. (): one router, or all live
    shards: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class RoutingReply:
    """The router's answer for one request."""

    decision: Decision  # Algorithm 1's output and the estimates behind it
    decision_s: float  # time the router spent deciding
    staleness_s: float  # age of the oldest engine report behind the decision
    fallback: bool = False  # the router could not decide: plain disaggregation on any nodes (counted)
    block_tokens: tuple[int, ...] = ()  # the nodes' prefix-cache block sizes: the ingress hashes prompts with them
    # the step-latency model the decision priced its decode node with (the pool's, refit online, times the node's
    # calibration): the node checks its chunks and joins at run time with the model its plan was made with
    decode_model: StepLatencyModel | None = None

    @classmethod
    def fallback_for(cls, reason: str) -> RoutingReply:
        """Plain disaggregation on whichever nodes Serve picks, when the router cannot decide."""
        decision = Decision(Route.PREFILL, None, None, (), None, None, f"fallback: {reason}")
        return cls(decision, 0.0, 0.0, fallback=True)


@dataclass(frozen=True, slots=True)
class WireAddress:
    """Where the router's actor takes calls over TCP (``serve.wire``), learned through its Ray handle."""

    host: str  # the IP of the actor's node
    port: int
    # both ends prove they hold it when a connection opens; it never crosses the line, nor shows in a repr
    secret: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class NodeLive:
    """A node in the live view (``GET /kairos/state``, ``kairos top``): its last report, the router's last minute."""

    node_id: str
    role: Role
    ray_node_id: str  # the Ray node (host) the engine runs on
    report_age_s: float  # since its last report reached the router
    queued_requests: int  # prefill: prompts in its FIFO; decode: hand-offs waiting for a batch slot
    queued_prompt_tokens: int  # prefill: prompt tokens still to prefill in its FIFO (0 on a decode node)
    batch_size: int  # decode: requests decoding (B)
    kv_tokens: int  # decode: resident KV tokens (K)
    free_kv_tokens: int  # decode: KV capacity not yet used, in tokens
    kv_usage: float  # share of the KV cache in use, as the engine counts it
    committed_deflections: int  # decode: deflections routed here, not prefilled yet
    num_steps: int  # steps the node reported in the window
    step_measured_s: float  # their mean measured time (0.0 without steps)
    step_predicted_s: float  # the router's step-latency model for this node: its mean for the same steps
    step_error: float  # that model's mean absolute percentage error on them, a share (0.0 without steps)
    num_routed: int  # requests the router sent here in the window (decode: deflected or handed off)
    num_deflected: int  # decode: of those, deflected here (0 on a prefill node)


@dataclass(frozen=True, slots=True)
class RouterLive:
    """The router's part of the live view."""

    policy: str  # the policy spec deciding (kairos, pd, sl:<tokens>, ...)
    window_s: float  # the window behind the per-node counts and means
    nodes: tuple[NodeLive, ...]  # every live node, by id


@dataclass(frozen=True, slots=True)
class ServiceLive:
    """The ingress's part of the live view: its requests of the last ``window_s``."""

    window_s: float
    num_requests: int  # requests whose first token came in the window
    num_deflected: int  # of those, deflected
    p95_ttft_s: float | None  # over those requests (None without any)
    p95_tbt_s: float | None  # over every gap between streamed tokens in the window (None without any)
    num_fallbacks: int  # requests the router could not decide (plain disaggregation)
    rejections: Mapping[str, int]  # refused requests by reason (overload, bad-request, ...)
    # the router's decisions as this ingress waited for them, from asking to the reply (None without any)
    p50_router_call_s: float | None = None
    p99_router_call_s: float | None = None
    shed: Mapping[str, int] = field(default_factory=dict)  # requests admission shed (429) by reason
    shed_by_priority: Mapping[str, int] = field(default_factory=dict)  # the same by priority class
    goodput_rps: float = 0.0  # requests that ended within their TTFT and TBT objectives, per second of the window


@dataclass(frozen=True, slots=True)
class LiveState:
    """What ``GET /kairos/state`` answers (as JSON) and ``kairos top`` shows."""

    wall_s: float  # time.time() at the ingress
    router: RouterLive
    service: ServiceLive

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LiveState:
        """The state back from its JSON (``dataclasses.asdict``) form."""
        router, service = data["router"], data["service"]
        nodes = tuple(NodeLive(**{**node, "role": Role(node["role"])}) for node in router["nodes"])
        return cls(
            wall_s=data["wall_s"],
            router=RouterLive(router["policy"], router["window_s"], nodes),
            service=ServiceLive(**service),
        )


@dataclass(frozen=True, slots=True)
class Residue:
    """What a process still keeps per request: every count is 0 once it is idle (state never grows with requests).

    Read by the idle-state test and ``kairos soak``; each structure that a
    request adds to is named here with its size.
    """

    process: str  # "ingress", "router" or a node id
    counts: Mapping[str, int]  # structure -> entries it holds (requests, runs, queues, held KV, staged files)

    @property
    def idle(self) -> bool:
        return not any(self.counts.values())

    def __str__(self) -> str:
        held = ", ".join(f"{name} {n}" for name, n in self.counts.items() if n)
        return f"{self.process}: {held or 'nothing held'}"
