"""Decisions that do not grow with the fleet: nodes indexed by what bounds their answer.

Algorithm 1 prices every decode node (Eq. 5-6) and every prefill node (Eq. 1-2)
per request. A policy keeps instead, for the view it last decided on, each
node's request-independent quantities in sorted lists, brings them up to date
for the nodes whose view changed (a report, a ledger entry: a few per
decision, whatever the fleet's size), and prices exactly only the nodes that
can still win. The decisions are the exhaustive search's: same node, same
schedule, same estimates (``tests/core/test_index.py`` checks it on random
fleets against ``PolicyParams(prune=False)``).

Deflection (Eq. 6). A node n whose cache holds none of the prompt's l tokens
has, once its committed deflections have run, a wait W, a batch of B (cost
f = B (c_batch + c_batch_sq B)) and K resident tokens: T0 = c0 + x,
x = f + c_kv K. Every step of its LargestSafe schedule fits beta * tau
(Eq. 5), every chunk but the last is a candidate, and the chunks never grow:
``_fewest_steps`` counts at least m steps from where each candidate stops
being safe. Then sum P_i >= l (m - 1) / 2 and sum chi_i P_i =
(l^2 - sum chi_i^2) / 2, and with every coefficient non-negative Eq. 4 summed
over the schedule is at least

    LB(W, x, K) = W + m (T0 + (c_kv + c_prefix) l / 2) - (c_kv + c_prefix) l / 2 + c_chunk tiles(l)
                  + c_chunk_kv K l + (c_chunk_kv + c_chunk_prefix) l^2 / 2 + S(sum chi_i^2),

S a term in sum chi_i^2 (between l^2 / m and chi_max l), non-decreasing in W, x
and K and growing at least m times as fast as x: E(x) = LB(0, x, 0) is below
every node whose x is at least x, and E(x') >= E(x) + m (x' - x) (``Floor``).
The index keeps each model's nodes in blocks by (x, W), each block with its
least W (``SortedBlocks``). A search sweeps the node of least W (least x among
them), then reads the blocks in order of x: it stops at a block whose E(first x)
exceeds the best TTFT found, passes over one whose E(first x) + least W does,
and within a block passes over a node when W plus the line below E from its
last evaluation exceeds the best, and sweeps it otherwise (first against its
own LB when K counts beyond x): the sweep stops once past the best, so it
costs about what evaluating E there would. Nodes whose cache holds part of
the prompt are priced directly.

Prefill nodes (Eq. 1-2). A node's queue wait does not depend on the request,
so among nodes that hold none of the prompt the fastest is the one with the
least wait: the list sorted by it answers at its head.

Hand-off target. Without admission the ranking key (``core.policy``) is the
tokens the node's link still has to carry, each transfer's setup counted,
plus the request's own: the first node in that order that can take the
hand-off wins. With admission, its estimate (``core.admission.handoff_ttft_s``)
is at least TTFT_pf + T_kv + T0(B + I + 1, K + I_p + l), so the nodes are read
in order of T0's node part.

A node may carry a model of its own (a mixed fleet: ``DecodeNodeView.model``):
the bounds hold per model, so the index keeps each model's nodes in lists of
their own, and a search reads each model's lists in turn, every one until its
bound passes the best found so far (in any of them). The architecture doc
(Decisions at fleet scale) derives the step count. A model with a negative
coefficient (a refit can produce one) has no such bounds: while a node has
one, every node is priced, as when ``prune`` is off.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import is_not
from typing import Generic, TypeVar

from kairos_ray.core.estimate import QueueTTFT, QueueWalks, after_committed
from kairos_ray.core.latency import StepLatency, StepLatencyModel, tiles
from kairos_ray.core.state import DecodeNodeView, PrefillNodeView

CHURN = 0.25
"""When more than this share of a pool's views changed since the last decision, it is priced node by node."""

MIN_NODES = 16
"""A pool smaller than this is priced node by node: its index would cost more to keep than it saves."""

SAFETY = 1e-9
"""Relative margin a bound gives away to rounding: it is summed in another order than the exact price."""


def bounded(model: StepLatency) -> bool:
    """Whether ``model`` admits the bounds above: the linear model (Eq. 4) with no negative coefficient."""
    return isinstance(model, StepLatencyModel) and bool((model.coefficients >= 0).all())


def batch_cost_s(model: StepLatencyModel, batch_size: int) -> float:
    """f(B) = B (c_batch + c_batch_sq B): the batch's part of T0 (Eq. 4)."""
    return batch_size * (model.c_batch + model.c_batch_sq * batch_size)


def deflection_bound_s(
    model: StepLatencyModel,
    prompt_tokens: int,
    wait_s: float,
    batch_s: float,
    kv_tokens: float,
    candidates: Sequence[int],
    budget_s: float,
) -> float:
    """LB(W, f, K) (module docstring): no LargestSafe schedule of ``prompt_tokens`` cold tokens over
    ``candidates`` (decreasing) within ``budget_s`` per step finishes sooner on a node with this wait, batch cost
    and resident KV; inf when it has none."""
    return (
        wait_s
        + _bound(model, prompt_tokens, model.c0 + batch_s + model.c_kv * kv_tokens, kv_tokens, candidates, budget_s)[0]
    )


def deflection_floor(
    model: StepLatencyModel, prompt_tokens: int, step_s: float, candidates: Sequence[int], budget_s: float
) -> tuple[float, int]:
    """(E, m): LB with W = 0, K = 0 and T0 - c0 = ``step_s``, below every node's whose T0 - c0 is at least
    that, and at least how fast it grows with T0: E(x') >= E + m (x' - x) for x' >= x (module docstring)."""
    return _bound(model, prompt_tokens, model.c0 + step_s, 0.0, candidates, budget_s)


class Floor:
    """E(x) of one request (``deflection_floor``) over ascending x, evaluated only where the line below it from
    the last point evaluated cannot decide: E grows at least m per second of x past it."""

    def __init__(self, model: StepLatencyModel, prompt_tokens: int, candidates: Sequence[int], budget_s: float) -> None:
        self._model, self._tokens, self._candidates, self._budget_s = model, prompt_tokens, candidates, budget_s
        self._at, self._value, self._slope = 0.0, 0.0, 0  # below every E until the first evaluation

    def below(self, x: float) -> float:
        """At most E(x), from the last evaluation (x at least its point)."""
        return self._value + self._slope * (x - self._at) * (1 - SAFETY)

    def at(self, x: float) -> float:
        """E(x), evaluated (x at least the last point evaluated)."""
        if x != self._at or not self._slope:
            self._value, self._slope = deflection_floor(self._model, self._tokens, x, self._candidates, self._budget_s)
            self._at = x
        return self._value


def _bound(
    model: StepLatencyModel,
    prompt_tokens: int,
    t0: float,
    kv_tokens: float,
    candidates: Sequence[int],
    budget_s: float,
) -> tuple[float, int]:
    """(LB less W, the fewest steps it counts) for a node whose decode part of a step is ``t0``; (inf, 0)
    when it has no schedule."""
    tokens = float(prompt_tokens)
    shape = _fewest_steps(model, prompt_tokens, t0, kv_tokens, candidates, budget_s)
    if shape is None:
        return math.inf, 0
    fewest, cap = shape
    square = model.c_chunk_sq
    growth = model.c_kv + model.c_prefix  # per step, per token of the request's own prefix P_i
    pair = model.c_chunk_kv + model.c_chunk_prefix  # per chi_i P_i
    # sum over steps: m t0 + growth sum P_i + square sum chi^2 + pair (l^2 - sum chi^2) / 2, with sum P_i >= l (m-1)/2
    per_step = t0 + growth * tokens / 2
    spread = square - pair / 2  # what sum chi^2 costs, net: bounded by l^2 / m from below, cap l from above
    if spread > 0:
        steps = max(float(fewest), tokens * math.sqrt(spread / per_step)) if per_step > 0 else float(fewest)
        squares_s = spread * tokens * tokens / steps
    else:
        steps, squares_s = float(fewest), spread * cap * tokens
    seconds = (
        steps * per_step
        - growth * tokens / 2
        + model.c_chunk * tiles(prompt_tokens, model.tile_tokens)
        + model.c_chunk_kv * kv_tokens * tokens
        + pair * tokens * tokens / 2
        + squares_s
    )
    return seconds * (1 - SAFETY), fewest


def _fewest_steps(
    model: StepLatencyModel, prompt_tokens: int, t0: float, kv_tokens: float, candidates: Sequence[int], budget_s: float
) -> tuple[int, int] | None:
    """(m, chi_max): at least how many steps a LargestSafe schedule takes on a node whose decode part of a step
    is ``t0``, and the largest chunk it can run; None when it has no schedule.

    A step of chunk chi from the request's own prefix P costs base(chi) + slope(chi) P (Eq. 4 with K + P
    resident), so a candidate c is safe exactly while P <= p(c) = (beta tau - base(c)) / slope(c), and p
    does not grow with c. Every step but the last runs a candidate safe where it starts, so from P it
    reaches at most P + A(P), A(P) the largest candidate with p(c) >= P; the last reaches at most P + L(P),
    L the largest real chunk that fits (``_largest_chunk``). With R(Q) = max over P <= Q of P + A(P), a
    schedule's i-th step starts at or before Q_i (Q_0 = 0, Q_(i+1) = R(Q_i)), so it takes at least one step
    more than the first i at which the last one's reach from Q_i covers the prompt. Q advances by one
    candidate per step between the p's: counted in closed form, a run at a time.
    """
    most = _largest_chunk(model, t0, kv_tokens, 0.0, budget_s)
    if most < 1:
        return None
    if prompt_tokens <= most:
        return 1, prompt_tokens
    room = budget_s * (1 + SAFETY)
    growth = model.c_kv + model.c_prefix  # per token of P, per step
    pair = model.c_chunk_kv + model.c_chunk_prefix  # per chunk token per token of P
    tile, per_chunk, square = model.tile_tokens, model.c_chunk, model.c_chunk_sq
    per_kv = model.c_chunk_kv * kv_tokens
    limits = []  # (c, p(c)), c decreasing, p(c) non-decreasing
    for c in candidates:
        base = t0 + per_chunk * (-(-c // tile) * tile) + c * (per_kv + square * c)
        if base <= room:
            slope = growth + pair * c
            limits.append((c, (room - base) / slope if slope > 0 else math.inf))
    # P + L(P) never falls as P grows when dL/dP >= -1 (implicit derivative of _largest_chunk's quadratic)
    rising = per_chunk + per_kv >= pair * most + growth
    free, per_token = room - t0, per_chunk + per_kv

    def reach(start: float) -> float:
        """At least what P + L(P) is at every P up to ``start`` (L as ``_largest_chunk`` solves it)."""
        if not rising:
            return start + most
        left, linear = free - growth * start, per_token + pair * start
        if left < linear + square:
            return start
        scale = linear + math.sqrt(linear * linear + 4 * square * left)
        return start + (2 * left / scale if scale > 0 else math.inf)

    def doubled(start: float) -> float:
        """R2(Q) = max over P <= Q of P + 2 A(P): what a step and the last, no larger, reach from before Q."""
        most_s = -math.inf
        for c, p in limits:
            if p >= start:
                return max(most_s, start + 2 * c)
            most_s = max(most_s, p + 2 * c)
        return most_s

    start, before, steps, jump, j = 0.0, 0.0, 0, -math.inf, 0  # jump: the most a candidate left behind reaches
    while reach(start) < prompt_tokens:
        while j < len(limits) and limits[j][1] < start:
            jump = max(jump, limits[j][1] + limits[j][0])
            j += 1
        if j == len(limits) or jump >= start + limits[j][0]:
            if jump <= start:
                return None  # no schedule gets past `start`
            before, start, steps = start, jump, steps + 1
            continue
        chunk, last = limits[j]
        last = min(last, start + prompt_tokens)  # safe all the way (p infinite): past the prompt is as far
        leave = math.floor((last - start) / chunk) + 1  # steps until past p(c)
        k, tries = max(1, math.ceil((prompt_tokens - reach(start)) / chunk)), 0  # L only shrinks as P grows
        while k < leave and tries < 3 and (short := prompt_tokens - reach(start + k * chunk)) > 0:
            k, tries = k + max(1, math.ceil(short / chunk)), tries + 1  # L at k bounds it beyond
        if k < leave:
            before, start, steps = start + (k - 1) * chunk, start + k * chunk, steps + k
            break
        before, start, steps = start + (leave - 1) * chunk, start + leave * chunk, steps + leave
    # the last step reaches from Q_steps; the one before it, no smaller, from Q_(steps - 1)
    fewest = steps + (1 if doubled(before) >= prompt_tokens else 2)
    if fewest <= 3:  # few steps: the first starts at 0 exactly, and each chunk is at most the one before it
        firsts = [c for c, p in limits if p >= 0]
        if fewest == 2 and max(c + min(c, reach(c) - c) for c in firsts) < prompt_tokens:
            fewest = 3
        if fewest == 3:
            seconds = [next((c for c, p in limits if c <= first and p >= first), 0) for first in firsts]
            if max(a + b + min(b, reach(a) - a) for a, b in zip(firsts, seconds, strict=True)) < prompt_tokens:
                fewest = 4
    return fewest, math.floor(most)


def _largest_chunk(model: StepLatencyModel, t0: float, kv_tokens: float, prefix: float, budget_s: float) -> float:
    """The largest chunk a step with this decode part and the request's own prefix P can hold (module docstring
    of ``_fewest_steps``; the root of the quadratic in its stable form), below 1 when none can."""
    room = budget_s * (1 + SAFETY) - t0 - (model.c_kv + model.c_prefix) * prefix
    per_token = model.c_chunk + model.c_chunk_kv * (kv_tokens + prefix) + model.c_chunk_prefix * prefix
    square = model.c_chunk_sq
    if room < per_token + square:
        return 0.0
    scale = per_token + math.sqrt(per_token * per_token + 4 * square * room)
    return 2 * room / scale if scale > 0 else math.inf


def link_tokens(node: DecodeNodeView, setup_tokens: int) -> int:
    """Tokens ``node``'s link has still to carry before a new hand-off's: what it lacks of the prompts in transfer
    to it, and each transfer's setup (``setup_tokens``, in tokens' worth of the link)."""
    return node.incoming_transfer_tokens + setup_tokens * node.incoming_transfers


def planned_beside(
    model: StepLatency, node: DecodeNodeView, protect: bool, walks: QueueWalks | None
) -> tuple[float, int, int]:
    """(W, B, K) a deflection onto ``node`` is planned with: once its committed deflections have run (Eq. 6
    behind them), and under decode-side protection (``core.admission``) with the hand-offs bound there joined."""
    wait_s, batch_size, kv_tokens = after_committed(model, node, walks)
    if protect:
        batch_size, kv_tokens = batch_size + node.incoming_requests, kv_tokens + node.incoming_prompt_tokens
    return wait_s, batch_size, kv_tokens


K = TypeVar("K")


class SortedPairs(Generic[K]):
    """(key, id) pairs in ascending order, kept sorted as they come and go: ``pairs[d]`` is the d-th smallest
    (ids are positions or twin groups)."""

    def __init__(self, pairs: list[tuple[K, int]]) -> None:
        pairs.sort()
        self.pairs = pairs

    def add(self, key: K, id_: int) -> None:
        insort(self.pairs, (key, id_))

    def remove(self, key: K, id_: int) -> None:
        del self.pairs[bisect_left(self.pairs, (key, id_))]

    def __len__(self) -> int:
        return len(self.pairs)


BLOCK = 32
"""A deflection list's blocks hold between this many and twice as many nodes (``SortedBlocks``)."""

Pair = tuple[tuple[float, float], int]


class SortedBlocks:
    """((x, W), id) pairs in ascending order, in consecutive blocks of at most 2 ``BLOCK``, each with the least W
    it holds (``lows``): a search passes over a block whose first x and least W rule out every node in it."""

    def __init__(self) -> None:
        self.blocks: list[list[Pair]] = []
        self.lows: list[float] = []
        self._at_low: list[int] = []  # how many pairs of each block have its least W
        self._firsts: list[Pair] = []

    def _block(self, pair: Pair) -> int:
        return max(0, bisect_right(self._firsts, pair) - 1)

    def _settle(self, at: int) -> None:
        """Recount block ``at``'s least W."""
        waits = [key[1] for key, _ in self.blocks[at]]
        self.lows[at] = low = min(waits)
        self._at_low[at] = waits.count(low)

    def add(self, key: tuple[float, float], id_: int) -> None:
        pair = (key, id_)
        if not self.blocks:
            self.blocks, self.lows, self._at_low, self._firsts = [[pair]], [key[1]], [1], [pair]
            return
        at = self._block(pair)
        block = self.blocks[at]
        insort(block, pair)
        self._firsts[at] = block[0]
        if key[1] < self.lows[at]:
            self.lows[at], self._at_low[at] = key[1], 1
        elif key[1] == self.lows[at]:
            self._at_low[at] += 1
        if len(block) > 2 * BLOCK:
            half = block[BLOCK:]
            del block[BLOCK:]
            self.blocks.insert(at + 1, half)
            self._firsts.insert(at + 1, half[0])
            self.lows.insert(at + 1, 0.0)
            self._at_low.insert(at + 1, 0)
            self._settle(at)
            self._settle(at + 1)

    def least_waits(self) -> Iterator[int]:
        """The ids of the pairs of least W, in ascending x."""
        low = min(self.lows, default=0.0)
        for block, block_low in zip(self.blocks, self.lows, strict=True):
            if block_low == low:
                yield from (id_ for (_, wait_s), id_ in block if wait_s == low)

    def remove(self, key: tuple[float, float], id_: int) -> None:
        pair = (key, id_)
        at = self._block(pair)
        block = self.blocks[at]
        del block[bisect_left(block, pair)]
        if not block:
            del self.blocks[at], self.lows[at], self._at_low[at], self._firsts[at]
            return
        self._firsts[at] = block[0]
        if key[1] == self.lows[at]:
            self._at_low[at] -= 1
            if not self._at_low[at]:
                self._settle(at)


@dataclass(slots=True)
class DecodeEntry:
    """What a decode node's answers depend on besides the request (module docstring)."""

    node: DecodeNodeView
    model: StepLatencyModel  # the node's: its own, else the pool's
    wait_s: float  # W: its committed deflections' remaining time (Eq. 6 behind them)
    batch_size: int  # B a deflection is planned beside (the bound hand-offs joined under protection)
    kv_tokens: int  # K likewise
    batch_s: float  # f(B)
    first_step_s: float  # a hand-off's first step, less c0 and c_kv l: f(B + I + 1) + c_kv (K + I_p)
    link: tuple[int, int, int]  # the hand-off ranking less the request: (link tokens, hand-offs, -headroom)
    plan_key: tuple[float, float]  # (x, W), x = T0 - c0 = f(B) + c_kv K: where its deflection bound starts
    twin: tuple[object, ...]  # ``twin_key``
    twin_keys: tuple[SortKey, SortKey]  # its twins' keys for hand-offs: ((first step,), link)


def twin_key(node: DecodeNodeView) -> tuple[object, ...]:
    """A decode node's view without its id: equal for nodes that every hand-off estimate prices alike."""
    return (
        node.batch_size,
        node.kv_tokens,
        node.free_kv_tokens,
        node.committed,
        node.head_prefilled_tokens,
        node.committed_cached_tokens,
        node.incoming_requests,
        node.incoming_kv_tokens,
        node.incoming_prompt_tokens,
        node.incoming_transfers,
        node.incoming_transfer_tokens,
        node.finished_per_s,
    )


SortKey = tuple[float, ...] | tuple[int, ...]


class Groups:
    """Nodes grouped by what an estimate reads of them, each group once in sorted lists (by a key per list).

    Nodes of one group are priced alike, so a search prices a group once and, as pricing every node in view
    order would, gives it to its first position that qualifies (``first_of``): idle nodes, most often, are one
    group however many there are.
    """

    def __init__(self, count: int) -> None:
        self.lists: tuple[SortedPairs[SortKey], ...] = tuple(SortedPairs([]) for _ in range(count))
        self.positions: dict[int, list[int]] = {}  # group id -> its positions, ascending
        self._ids: dict[Hashable, int] = {}
        self._of: dict[int, int] = {}  # position -> group id
        self._next = 0

    def join(self, position: int, key: Hashable, sort_keys: tuple[SortKey, ...]) -> None:
        group = self._ids.get(key)
        if group is None:
            group, self._next = self._next, self._next + 1
            self._ids[key], self.positions[group] = group, [position]
            for pairs, sort_key in zip(self.lists, sort_keys, strict=True):
                pairs.add(sort_key, group)
        else:
            insort(self.positions[group], position)
        self._of[position] = group

    def leave(self, position: int, key: Hashable, sort_keys: tuple[SortKey, ...]) -> None:
        group = self._of.pop(position)
        members = self.positions[group]
        members.remove(position)
        if not members:
            del self.positions[group], self._ids[key]
            for pairs, sort_key in zip(self.lists, sort_keys, strict=True):
                pairs.remove(sort_key, group)

    def first_of(self, group: int, skip: Mapping[int, int], accept: Callable[[int], bool] | None = None) -> int | None:
        """The first position of ``group`` not in ``skip`` (the nodes holding part of the prompt) and, given
        ``accept``, accepted by it."""
        for position in self.positions[group]:
            if position not in skip and (accept is None or accept(position)):
                return position
        return None


class _Index:
    """The node views last indexed, by position, and where each node id sits."""

    def __init__(self, model: StepLatency) -> None:
        self.model = model  # the pool's: what the index prices with
        self.nodes: tuple[PrefillNodeView, ...] | tuple[DecodeNodeView, ...] | None = None
        self.ready = False  # built for ``nodes``
        self.positions: dict[str, int] = {}
        self.foreign = 0  # indexed nodes whose model the index cannot bound: while any are, it cannot answer

    def _foreign(self, node: PrefillNodeView | DecodeNodeView) -> int:
        """1 if the index cannot answer for ``node``'s model, else 0."""
        return 0

    def _plan(self, nodes: tuple[PrefillNodeView, ...] | tuple[DecodeNodeView, ...]) -> tuple[bool, list[int] | None]:
        """(whether the index can answer for ``nodes``, the positions to update: None to build it whole).

        A fleet seen for the first time, or one most of whose views are new objects (a simulator that
        builds its views afresh, a fleet changing size), is priced node by node: the index is built once
        the views hold still between decisions.
        """
        views: Sequence[PrefillNodeView | DecodeNodeView] = nodes
        before = self.nodes
        if nodes is before:  # asked again for the same decision's view
            return self.ready, []
        self.nodes = nodes
        if before is None or len(before) != len(views):
            self.ready = False
            return False, None
        changed = list(compress(range(len(views)), map(is_not, views, before)))
        if len(changed) > len(views) * CHURN:
            self.ready = False
            return False, None
        if not self.ready:
            self.positions = {node.node_id: i for i, node in enumerate(views)}
            self.foreign = sum(map(self._foreign, views))
            self.ready = True
            return True, None
        for i in changed:
            old, new = before[i], views[i]
            self.foreign += self._foreign(new) - self._foreign(old)
            if old.node_id != new.node_id:
                if self.positions.get(old.node_id) == i:
                    del self.positions[old.node_id]
                self.positions[new.node_id] = i
        return True, changed

    def held(self, hits: Mapping[str, int] | None) -> dict[int, int]:
        """Position -> prompt tokens held there, for the indexed nodes whose cache holds any of the prompt."""
        if not hits:
            return {}
        found = {}
        for node_id, tokens in hits.items():
            if tokens > 0 and (position := self.positions.get(node_id)) is not None:
                found[position] = tokens
        return found


class ModelGroups:
    """The decode nodes of one model: for deflections in blocks by (T0 - c0, W); for hand-offs grouped as twins
    and sorted by a hand-off's first step and by its link ranking."""

    def __init__(self, model: StepLatencyModel) -> None:
        self.model = model
        self.plans = SortedBlocks()
        self.twins = Groups(2)

    def join(self, position: int, entry: DecodeEntry) -> None:
        self.plans.add(entry.plan_key, position)
        self.twins.join(position, entry.twin, entry.twin_keys)

    def leave(self, position: int, entry: DecodeEntry) -> None:
        self.plans.remove(entry.plan_key, position)
        self.twins.leave(position, entry.twin, entry.twin_keys)

    @property
    def empty(self) -> bool:
        return not self.twins.positions


class DecodeIndex(_Index):
    """A policy's decode nodes, in groups per model (``ModelGroups``)."""

    def __init__(self, model: StepLatencyModel, protect: bool, setup_tokens: int, walks: QueueWalks) -> None:
        super().__init__(model)
        self.model: StepLatencyModel = model
        self.protect, self.setup_tokens, self.walks = protect, setup_tokens, walks
        self.entries: list[DecodeEntry] = []
        self.groups: dict[StepLatencyModel, ModelGroups] = {}  # by model, each holding nodes

    def _foreign(self, node: PrefillNodeView | DecodeNodeView) -> int:
        return int(node.model is not None and not bounded(node.model))

    def entry(self, node: DecodeNodeView) -> DecodeEntry:
        """The node's entry, priced with its model (one the index cannot bound: the pool's, never searched)."""
        own = node.model
        model = own if isinstance(own, StepLatencyModel) and bounded(own) else self.model
        wait_s, batch_size, kv_tokens = planned_beside(model, node, self.protect, self.walks)
        bound_batch, bound_kv = node.with_bound
        first_step_s = batch_cost_s(model, bound_batch + 1) + model.c_kv * bound_kv
        link = (link_tokens(node, self.setup_tokens), node.incoming_requests, -node.headroom_kv_tokens)
        batch_s = batch_cost_s(model, batch_size)
        step_s = batch_s + model.c_kv * kv_tokens
        return DecodeEntry(
            node,
            model,
            wait_s,
            batch_size,
            kv_tokens,
            batch_s,
            first_step_s,
            link,
            (step_s, wait_s),
            twin_key(node),
            ((first_step_s,), link),
        )

    def _join(self, position: int, entry: DecodeEntry) -> None:
        groups = self.groups.get(entry.model)
        if groups is None:
            groups = self.groups[entry.model] = ModelGroups(entry.model)
        groups.join(position, entry)

    def _leave(self, position: int, entry: DecodeEntry) -> None:
        groups = self.groups[entry.model]
        groups.leave(position, entry)
        if groups.empty:
            del self.groups[entry.model]

    def sync(self, nodes: tuple[DecodeNodeView, ...]) -> bool:
        """Bring the index to ``nodes`` (O(changed nodes x log of the fleet)); False: price them node by node
        (``_plan``, or a node whose model the index cannot bound)."""
        usable, changed = self._plan(nodes)
        if not usable:
            return False
        if changed is None:
            self.entries = [self.entry(node) for node in nodes]
            self.groups = {}
            for i, entry in enumerate(self.entries):
                self._join(i, entry)
            return not self.foreign
        for i in changed:
            old, new = self.entries[i], self.entry(nodes[i])
            self.entries[i] = new
            self._leave(i, old)
            self._join(i, new)
        return not self.foreign


class PrefillIndex(_Index):
    """A policy's prefill nodes sorted by their queue wait (Eq. 2 or the walked FIFO), in a list per model."""

    def __init__(self, model: StepLatency, queue_wait: QueueTTFT, chunk_tokens: int, walks: QueueWalks) -> None:
        super().__init__(model)
        self.queue_wait, self.chunk_tokens, self.walks = queue_wait, chunk_tokens, walks
        self.waits: list[float] = []
        self.models: list[StepLatency] = []  # per position, the node's model (its own, else the pool's)
        self.by_wait: dict[StepLatency, SortedPairs[float]] = {}  # per model, its nodes by wait

    def sync(self, nodes: tuple[PrefillNodeView, ...]) -> bool:
        """As ``DecodeIndex.sync``."""
        usable, changed = self._plan(nodes)
        if not usable:
            return False
        if changed is None:
            self.waits, self.models, self.by_wait = [0.0] * len(nodes), [self.model] * len(nodes), {}
            for i, node in enumerate(nodes):
                self._add(i, node)
            return True
        for i in changed:
            pairs = self.by_wait[self.models[i]]
            pairs.remove(self.waits[i], i)
            if not len(pairs):
                del self.by_wait[self.models[i]]
            self._add(i, nodes[i])
        return True

    def _add(self, position: int, node: PrefillNodeView) -> None:
        model = node.model or self.model  # as ``Policy.model_of`` prices it
        wait_s = self.queue_wait(model, node, self.chunk_tokens, self.walks)
        self.waits[position], self.models[position] = wait_s, model
        pairs = self.by_wait.get(model)
        if pairs is None:
            pairs = self.by_wait[model] = SortedPairs([])
        pairs.add(wait_s, position)
