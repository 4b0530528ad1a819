"""``kairos bench``: replay a workload or trace against any OpenAI-compatible endpoint.

Open loop: each request is sent at its arrival time, whatever happened to the
ones before, as a streaming ``/v1/completions`` call whose prompt is a list of
``prompt_tokens`` token ids (exact lengths on any server) with ``max_tokens``
= the request's output length and ``ignore_eos``. Per request it records the
TTFT (first streamed token), the gap before every token and, from a
Kairos-Ray server, the route and TTFT breakdown of the ``x-kairos-*``
headers. It writes the same ``summary.csv``, ``requests.csv`` and plots as
``kairos sim``.

Servers may send several tokens in one event (vLLM's and Ray Serve LLM's
servers batch them). The tokens of an event come from its usage: every
request asks for ``stream_options: {include_usage, continuous_usage_stats}``,
and a server that sends usage with every event (vLLM, Kairos-Ray) tells how
many tokens each one brought. Without it, each event counts as one token
until the final usage, and the tokens it did not account for are spread
evenly over the events. The first token of an event gets the gap since the
previous event, the others a gap of 0 (they reached the client together),
so a request's largest gap (``max_tbt_s``) and the P99 gap describe stalls
whatever the event size.

A workload with prefix identity (``multiturn``: requests carry their blocks'
hashes) is sent as conversations: blocks with equal hashes get equal tokens,
and a block that an earlier request's prompt or answer filled gets that
request's tokens, its answer as the server generated it (``Conversations``).
So a turn's prompt is the last turn's prompt, its real answer and a new
message, and a prefix cache holding the last turn holds this one's history.
A turn that arrives before its predecessor's answer is back gets made-up
tokens for the answer's blocks (the open loop does not wait), as in the
simulator, where such a turn finds no answer cached. The cached prompt
tokens the server reports (``x-kairos-cached-tokens``) go in each record.

A request a Kairos-Ray server shed (429 naming its reason in
``x-kairos-shed``: admission, ``core.admission``) is recorded as shed, apart
from failures; with ``retries`` it is sent again after its ``Retry-After``,
its TTFT still counted from its first send.

The replay reports how well it kept to the schedule: the rate it achieved
and its send lag (how late each request went out), and warns when it fell
behind by more than 2 %.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
import httpx
import numpy as np
import numpy.typing as npt

from kairos_ray.core import BlockHash
from kairos_ray.messages import SHED_HEADER
from kairos_ray.metrics import BREAKDOWN, RequestRecord
from kairos_ray.workloads import Request, Workload

# Prompt token ids cycle through [PROMPT_BASE, PROMPT_BASE + PROMPT_IDS): ids every
# tokenizer knows, the shipped tiny model's 610-token vocabulary included.
PROMPT_BASE, PROMPT_IDS = 100, 500


def prompt_ids(request_id: int, tokens: int) -> list[int]:
    """Request ``request_id``'s prompt of ``tokens`` ids: the cycle from an offset its id sets, its second id
    the id's next digit, so that no two requests of a run (up to 250,000) begin alike and a server's prefix
    cache finds nothing of one request's prompt in another's (the workloads carry no prefix identity)."""
    ids = [PROMPT_BASE + (request_id + i) % PROMPT_IDS for i in range(tokens)]
    if tokens > 1:
        ids[1] = PROMPT_BASE + (request_id // PROMPT_IDS) % PROMPT_IDS
    return ids


class Conversations:
    """Prompts of a workload with prefix identity: tokens per block hash, as the requests' answers filled them."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.known: dict[BlockHash, list[int]] = {}  # block hash -> its tokens, from the first request that filled it

    @staticmethod
    def _made_up(seed: BlockHash | str, tokens: int) -> list[int]:
        """Tokens no server sent: a function of ``seed`` (a block's hash: equal blocks, equal tokens)."""
        return random.Random(seed).choices(range(PROMPT_BASE, PROMPT_BASE + PROMPT_IDS), k=tokens)

    def prompt(self, request_id: int, request: Request) -> list[int]:
        """The prompt's tokens: each block's known tokens, or made up from its hash (or, past its hashes, its id)."""
        b, ids = self.block_tokens, []
        for i in range(math.ceil(request.prompt_tokens / b)):
            h = request.block_hashes[i] if i < len(request.block_hashes) else None
            block = self._made_up(f"{request_id}.{i}", b) if h is None else self.known.get(h) or self._made_up(h, b)
            ids += block
        return ids[: request.prompt_tokens]

    def answered(self, request: Request, stream: list[int]) -> None:
        """A request's prompt and answer tokens: every full block of them is known from now on."""
        b = self.block_tokens
        for i, h in enumerate(request.block_hashes[: len(stream) // b]):
            self.known.setdefault(h, stream[i * b : (i + 1) * b])


RecordOrError = RequestRecord | str


LAG_WARNING_SHARE = 0.02  # warn when the achieved rate falls this far below the schedule's


@dataclass
class BenchResult:
    records: list[RequestRecord]
    failures: list[str]  # one line per request that got no answer
    wall_s: float
    achieved_rps: float = math.nan  # requests sent per second, first send to last
    scheduled_rps: float = math.nan  # the workload's rate over the same requests
    p50_send_lag_s: float = math.nan  # how late requests went out against their arrival times
    max_send_lag_s: float = math.nan

    @property
    def behind(self) -> bool:
        """Whether the generator kept more than 2 % below the schedule's rate."""
        return self.achieved_rps < (1 - LAG_WARNING_SHARE) * self.scheduled_rps


def _breakdown(header: str | None) -> dict[str, float]:
    parts = dict(item.split("=", 1) for item in header.split(";") if "=" in item) if header else {}
    return {name: float(parts.get(name[:-2], math.nan)) for name in BREAKDOWN}


def token_gaps(stamps: list[float], tokens: list[int]) -> npt.NDArray[np.float64]:
    """The gap before every token after the first: an event's first token waited since the previous event,
    the others of the same event came with it (gap 0)."""
    gaps = [0.0] * (tokens[0] - 1)
    for previous, stamp, count in zip(stamps, stamps[1:], tokens[1:], strict=False):
        gaps += [stamp - previous] + [0.0] * (count - 1)
    return np.array(gaps)


def _tokens_per_event(counted: list[int], total: int | None) -> list[int]:
    """Tokens each event brought: from continuous usage where the server sent it, else spread evenly."""
    if total is None or sum(counted) == total:
        return counted
    extra, events = total - len(counted), len(counted)
    return [1 + extra // events + (i < extra % events) for i in range(events)]


async def sse_lines(body: aiohttp.StreamReader) -> AsyncIterator[str]:
    """A streamed body's lines as they arrive, of any length (aiohttp's own line reading refuses a line longer than
    twice its read buffer, which the ``prompt_token_ids`` of a long enough prompt can be)."""
    rest = b""
    async for chunk in body.iter_any():
        if b"\n" not in chunk:
            rest += chunk
            continue
        *lines, tail = (rest + chunk).split(b"\n")
        rest = tail
        for line in lines:
            yield line.rstrip(b"\r").decode()
    if rest:
        yield rest.decode()


def _shed_retry_s(response: aiohttp.ClientResponse) -> float | None:
    """Seconds a shed request's answer says to wait before coming back (its ``Retry-After``); None when the
    answer is not a shed request's, or says nothing of when."""
    if response.status != 429 or SHED_HEADER not in response.headers:
        return None
    try:
        return max(0.0, float(response.headers.get("retry-after", "")))
    except ValueError:
        return None


async def _one(
    client: aiohttp.ClientSession,
    url: str,
    model: str,
    rid: int,
    req: Request,
    start: float,
    talks: Conversations | None,
    retries: int = 0,
) -> RequestRecord | str:
    """One request's record, or the line saying why it got no answer; a request the server shed (429 with
    ``x-kairos-shed``) is sent again after its ``Retry-After`` up to ``retries`` times, then recorded as shed."""

    prompt = talks.prompt(rid, req) if talks is not None else prompt_ids(rid, req.prompt_tokens)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": req.output_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        **({"return_token_ids": True} if talks is not None else {}),  # the answer's ids make the next turn
        **({"priority": req.priority} if req.priority else {}),
    }
    sent = tried = time.monotonic()
    stamps: list[float] = []
    counted: list[int] = []  # tokens per event, by the server's running usage where it sends one (else 1)
    generated, total = 0, None
    answer: list[int] = []
    try:
        response = await client.post(f"{url}/v1/completions", json=body)
        for _ in range(retries):  # shed, and told when to come back: its TTFT still counts from its first send
            retry_s = _shed_retry_s(response)
            if retry_s is None:
                break
            response.release()
            await asyncio.sleep(retry_s)
            tried = time.monotonic()
            response = await client.post(f"{url}/v1/completions", json=body)
        async with response:
            shed = response.headers.get(SHED_HEADER) if response.status == 429 else None
            if shed is not None:  # counted apart from failures
                answer_s = time.monotonic() - tried  # its last try's
                return RequestRecord.of_shed(
                    rid, sent - start, req.prompt_tokens, req.output_tokens, req.priority, shed, answer_s
                )
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")[:200]
                return f"request {rid}: HTTP {response.status}: {text}"
            async for line in sse_lines(response.content):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or {}
                so_far = usage.get("completion_tokens")
                if chunk.get("choices"):  # tokens (their text may be empty: part of a character)
                    answer += chunk["choices"][0].get("token_ids") or []
                    stamps.append(time.monotonic())
                    counted.append(so_far - generated if so_far is not None else 1)
                    generated = so_far if so_far is not None else generated + 1
                elif so_far is not None:  # the closing usage
                    total = so_far
            headers = response.headers
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        return f"request {rid}: {type(exc).__name__}: {exc}"
    if not stamps:
        return f"request {rid}: no tokens streamed"
    if talks is not None:
        talks.answered(req, prompt + answer)
    tokens = _tokens_per_event([max(1, c) for c in counted], total)
    breakdown = _breakdown(headers.get("x-kairos-breakdown"))
    cached = headers.get("x-kairos-cached-tokens")
    return RequestRecord(
        request_id=rid,
        arrival_s=sent - start,
        prompt_tokens=req.prompt_tokens,
        output_tokens=sum(tokens),
        route=headers.get("x-kairos-route", "unknown"),
        prefill_node=headers.get("x-kairos-prefill-node", ""),
        decode_node=headers.get("x-kairos-decode-node", ""),
        ttft_s=stamps[0] - sent,
        finish_s=stamps[-1] - start,
        tbt_gaps_s=token_gaps(stamps, tokens),
        prefill_queue_s=breakdown["prefill_queue_s"],
        prefill_exec_s=breakdown["prefill_exec_s"],
        kv_transfer_s=breakdown["kv_transfer_s"],
        decode_queue_s=breakdown["decode_queue_s"],
        cached_tokens=int(cached) if cached is not None else None,
    )


async def replay(
    url: str,
    model: str,
    workload: Workload,
    timeout_s: float = 600.0,
    progress: Callable[[int], None] | None = None,
    retries: int = 0,
) -> BenchResult:
    """Send every request of ``workload`` at its arrival time; wait for all of them. A request the server shed
    is a shed record (not a failure), after up to ``retries`` more tries each after its ``Retry-After``.

    ``timeout_s`` bounds connecting and each wait for more of an answer, not a whole stream. The client is
    aiohttp's, whose HTTP parser is compiled, so the load generator takes little of the CPU that the server under
    test shares where both run on one machine (``docs/live-path-performance.md``).
    """
    has_identity = any(r.block_hashes for r in workload.requests)
    talks = Conversations(workload.block_tokens) if has_identity else None
    url = url.rstrip("/")
    connector = aiohttp.TCPConnector(limit=0)  # a connection per request in flight, as an open loop needs
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        start = time.monotonic()
        lags = [0.0] * len(workload.requests)
        sends = [0.0] * len(workload.requests)

        async def at_arrival(rid: int, req: Request) -> RecordOrError:
            await asyncio.sleep(max(0.0, start + req.arrival_s - time.monotonic()))
            sends[rid] = time.monotonic()
            lags[rid] = sends[rid] - start - req.arrival_s
            result = await _one(client, url, model, rid, req, start, talks, retries)
            if progress is not None:
                progress(1)
            return result

        results = await asyncio.gather(*(at_arrival(i, r) for i, r in enumerate(workload.requests)))
        wall = time.monotonic() - start
    records = [r for r in results if isinstance(r, RequestRecord)]
    failures = [r for r in results if isinstance(r, str)]
    arrivals = [r.arrival_s for r in workload.requests]
    result = BenchResult(records, failures, wall)
    if len(arrivals) > 1 and arrivals[-1] > arrivals[0]:
        result.achieved_rps = (len(sends) - 1) / (max(sends) - min(sends))
        result.scheduled_rps = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
        result.p50_send_lag_s = float(np.median(lags))
        result.max_send_lag_s = max(lags)
    return result


async def served_model(url: str) -> str:
    """The first model the endpoint lists."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        response = await client.get("/v1/models")
        response.raise_for_status()
        data = response.json().get("data") or []
        if not data:
            raise ValueError(f"{url}/v1/models lists no model")
        return str(data[0]["id"])


def wait_until_routed(url: str, model: str, within_s: float) -> None:
    """Until a Kairos-Ray app has every engine reporting: a warm-up request that its router decided."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            body = {"model": model, "prompt": "warm up", "max_tokens": 1}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            if r.status_code == 200 and r.headers["x-kairos-fallback"] == "0":
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the app at {url} did not come up within {within_s:g} s")
