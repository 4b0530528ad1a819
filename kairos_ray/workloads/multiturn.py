"""A synthetic multi-turn chat workload with prefix identity: conversations that share a system prompt.

Every conversation is one token stream, rendered as a chat template renders
it: the shared system prompt first, then user message, answer, user
message, answer... Turn k's prompt is the stream up to and including the
k-th user message (so it holds every earlier answer), and its answer is
appended before the next message. Lengths (tokens; template markers are
counted in the messages) and times, all drawn from ``MultiTurnSpec``:

| what                         | distribution                                   |
|------------------------------|------------------------------------------------|
| system prompt                | 1,024 tokens, the same for every conversation  |
| turns per conversation       | geometric, mean 4 (ends early at the context)  |
| first user message           | log-normal, median 512, sigma 1.0              |
| later user messages          | log-normal, median 128, sigma 1.0              |
| answers                      | log-normal, median 256, sigma 0.8              |
| think time (arrival to next) | log-normal, median 20 s, sigma 0.8             |
| conversation starts          | Poisson, rate ``rps`` / mean turns             |

Requests arrive open loop: a turn's successor arrives its think time after
it, however slow its answer (a turn whose predecessor has not finished finds
no answer cached). Conversations start from well before the first request
kept (three mean conversation lengths), so the rate is ``rps`` from the
first request on; the first requests are later turns of conversations whose
earlier turns fell before it, which find a cold cache.

Prefix identity: block i of conversation c (``block_tokens`` tokens) is named
i while it lies wholly inside the system prompt and (c + 1) << 20 | i after,
which is what chained hashes give an append-only stream (``core.prefix``):
conversations share the system prompt's full blocks, and turn k + 1 shares
every full block of turn k's prompt and answer. A request carries the hashes
of its prompt's and its answer's full blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kairos_ray.workloads import Request, Workload
from kairos_ray.workloads.synthetic import CONTEXT_TOKENS, LogNormal

CONVERSATION_SHIFT = 20  # block index bits: 2**20 blocks of 16 tokens hold far more than any context


@dataclass(frozen=True)
class MultiTurnSpec:
    system_prompt_tokens: int  # shared by every conversation, rendered first
    mean_turns: float  # of the geometric number of turns per conversation
    first_message: LogNormal  # tokens of a conversation's first user message
    next_message: LogNormal  # tokens of every later user message
    answer: LogNormal  # tokens of each answer
    think_median_s: float  # log-normal time from a turn's arrival to the next's
    think_sigma: float
    block_tokens: int  # tokens per block of the prefix identity

    @property
    def mean_think_s(self) -> float:
        return self.think_median_s * float(np.exp(self.think_sigma**2 / 2))


MULTITURN = MultiTurnSpec(
    system_prompt_tokens=1024,
    mean_turns=4.0,
    first_message=LogNormal(512, 1.0),
    next_message=LogNormal(128, 1.0),
    answer=LogNormal(256, 0.8),
    think_median_s=20.0,
    think_sigma=0.8,
    block_tokens=16,  # vLLM's default block on GPUs
)


def _conversation(
    rng: np.random.Generator, spec: MultiTurnSpec, index: int, start_s: float, context_tokens: int
) -> list[Request]:
    """The turns of conversation ``index`` starting at ``start_s``, while they fit the context."""
    turns = int(rng.geometric(1.0 / spec.mean_turns))
    messages = spec.next_message.draw(rng, turns)
    messages[0] = spec.first_message.draw(rng, 1)[0]
    answers = spec.answer.draw(rng, turns)
    thinks = spec.think_median_s * np.exp(spec.think_sigma * rng.standard_normal(turns))
    block = spec.block_tokens
    shared_blocks = spec.system_prompt_tokens // block
    own = (index + 1) << CONVERSATION_SHIFT
    hashes = tuple(i if i < shared_blocks else own | i for i in range(context_tokens // block))
    requests = []
    position, arrival = spec.system_prompt_tokens, start_s
    for message, answer, think in zip(messages.tolist(), answers.tolist(), thinks.tolist(), strict=True):
        prompt = position + message
        if prompt + answer > context_tokens:
            break
        requests.append(Request(arrival, prompt, answer, hashes[: (prompt + answer) // block]))
        position = prompt + answer
        arrival += think
    return requests


def multiturn(
    rps: float,
    num_requests: int = 2000,
    seed: int = 0,
    context_tokens: int = CONTEXT_TOKENS,
    spec: MultiTurnSpec = MULTITURN,
) -> Workload:
    """``num_requests`` turns of multi-turn conversations arriving at a mean of ``rps`` per second."""
    if rps <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rps}")
    if num_requests < 1:
        raise ValueError(f"need at least 1 request, got {num_requests}")
    rng = np.random.default_rng(seed)
    conversation_gap_s = spec.mean_turns / rps
    start = -3 * spec.mean_turns * spec.mean_think_s
    kept: list[Request] = []
    index = 0
    # Conversations start in time order, so every turn before the latest start is drawn already.
    while sum(1 for r in kept if r.arrival_s <= start) < num_requests:
        for _ in range(64):
            start += rng.exponential(conversation_gap_s)
            kept += [r for r in _conversation(rng, spec, index, start, context_tokens) if r.arrival_s >= 0]
            index += 1
    kept.sort(key=lambda r: r.arrival_s)
    first = kept[0].arrival_s
    requests = tuple(
        Request(r.arrival_s - first, r.prompt_tokens, r.output_tokens, r.block_hashes) for r in kept[:num_requests]
    )
    return Workload("multiturn", requests, block_tokens=spec.block_tokens)
