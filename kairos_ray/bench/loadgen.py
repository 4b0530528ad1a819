"""``kairos bench``: replay a workload or trace against any OpenAI-compatible endpoint.

Open loop: each request is sent at its arrival time, whatever happened to the
ones before, as a streaming ``/v1/completions`` call whose prompt is a list of
``prompt_tokens`` token ids (exact lengths on any server) with ``max_tokens``
= the request's output length and ``ignore_eos``. Per request it records the
TTFT (first streamed token), every gap between streamed chunks and, from a
Kairos-Ray server, the route and TTFT breakdown of the ``x-kairos-*``
headers. It writes the same ``summary.csv``, ``requests.csv`` and plots as
``kairos sim``.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np

from kairos_ray.metrics import BREAKDOWN, RequestRecord
from kairos_ray.workloads import Request, Workload

# Prompt token ids cycle through [PROMPT_BASE, PROMPT_BASE + PROMPT_IDS): ids every
# tokenizer knows, the shipped tiny model's 610-token vocabulary included.
PROMPT_BASE, PROMPT_IDS = 100, 500

RecordOrError = RequestRecord | str


@dataclass
class BenchResult:
    records: list[RequestRecord]
    failures: list[str]  # one line per request that got no answer
    wall_s: float


def _breakdown(header: str | None) -> dict[str, float]:
    parts = dict(item.split("=", 1) for item in header.split(";") if "=" in item) if header else {}
    return {name: float(parts.get(name[:-2], math.nan)) for name in BREAKDOWN}


async def _one(client: httpx.AsyncClient, model: str, rid: int, req: Request, start: float) -> RequestRecord | str:
    body = {
        "model": model,
        "prompt": [PROMPT_BASE + i % PROMPT_IDS for i in range(req.prompt_tokens)],
        "max_tokens": req.output_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.monotonic()
    stamps: list[float] = []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:200]
                return f"request {rid}: HTTP {response.status_code}: {text}"
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):  # a token (its text may be empty: part of a character)
                    stamps.append(time.monotonic())
            headers = response.headers
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return f"request {rid}: {type(exc).__name__}: {exc}"
    if not stamps:
        return f"request {rid}: no tokens streamed"
    breakdown = _breakdown(headers.get("x-kairos-breakdown"))
    return RequestRecord(
        request_id=rid,
        arrival_s=sent - start,
        prompt_tokens=req.prompt_tokens,
        output_tokens=len(stamps),
        route=headers.get("x-kairos-route", "unknown"),
        prefill_node=headers.get("x-kairos-prefill-node", ""),
        decode_node=headers.get("x-kairos-decode-node", ""),
        ttft_s=stamps[0] - sent,
        finish_s=stamps[-1] - start,
        tbt_gaps_s=np.diff(np.array(stamps)),
        prefill_queue_s=breakdown["prefill_queue_s"],
        prefill_exec_s=breakdown["prefill_exec_s"],
        kv_transfer_s=breakdown["kv_transfer_s"],
        decode_queue_s=breakdown["decode_queue_s"],
    )


async def replay(
    url: str, model: str, workload: Workload, timeout_s: float = 600.0, progress: Callable[[int], None] | None = None
) -> BenchResult:
    """Send every request of ``workload`` at its arrival time; wait for all of them."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        start = time.monotonic()

        async def at_arrival(rid: int, req: Request) -> RecordOrError:
            await asyncio.sleep(max(0.0, start + req.arrival_s - time.monotonic()))
            result = await _one(client, model, rid, req, start)
            if progress is not None:
                progress(1)
            return result

        results = await asyncio.gather(*(at_arrival(i, r) for i, r in enumerate(workload.requests)))
        wall = time.monotonic() - start
    records = [r for r in results if isinstance(r, RequestRecord)]
    return BenchResult(records, [r for r in results if isinstance(r, str)], wall)


async def served_model(url: str) -> str:
    """The first model the endpoint lists."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        response = await client.get("/v1/models")
        response.raise_for_status()
        data = response.json().get("data") or []
        if not data:
            raise ValueError(f"{url}/v1/models lists no model")
        return str(data[0]["id"])
