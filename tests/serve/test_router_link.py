"""``serve.router_link`` against a real ``Router`` deployment: over its TCP line, across its actor's death, and
over Ray calls where the app turns the line off."""

import asyncio
import time

import pytest
import ray
from ray import serve

from kairos_ray.bench.router_latency import node_states
from kairos_ray.config import KairosConfig
from kairos_ray.messages import DecisionRequest
from kairos_ray.serve.router import Router
from kairos_ray.serve.router_link import RouterLink
from kairos_ray.serve.types import RouterOptions
from kairos_ray.serve.wire import WireClosed
from tests import shared_ray

pytestmark = pytest.mark.ray


async def decided_once_reported(link, request_id, within_s=90.0):
    """Report the four nodes, then decide, until the router decides rather than falls back."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for state in node_states(0):
            link.report(state)
        try:
            (reply,) = await asyncio.wait_for(link.decide([DecisionRequest(request_id, 800, 64)], 10), 20)
            if not reply.fallback:
                return reply
        except Exception:  # the actor is gone or not up yet: the link fetches it again
            pass
        await asyncio.sleep(0.2)
    pytest.fail(f"no decision within {within_s} s")


def with_router(tcp_line, body):
    """(first decision, line open before it, ``body(link)``'s result) against a fresh ``Router`` deployment.

    The link is prefetched, as an ingress's is when it starts, and the first decision waits until it has the
    actor's handle: whether the line was open by then is the second element."""
    shared_ray.start()
    try:
        app = Router.bind(KairosConfig(), RouterOptions(tcp_line=tcp_line))
        link = RouterLink(serve.run(app, name="router-link", route_prefix=None))

        async def main():
            link.prefetch()
            deadline = time.monotonic() + 60
            while link._actor is None and time.monotonic() < deadline:  # no call made: the prefetch alone
                await asyncio.sleep(0.05)
            prefetched = link._wire is not None and not link._wire.closed
            first = await decided_once_reported(link, 1)
            return first, prefetched, await body(link)

        return asyncio.run(main())
    finally:
        serve.delete("router-link")


def test_decisions_and_reports_go_over_the_line_and_find_the_new_actor_after_the_old_one_dies():
    async def kill_the_actor(link):
        assert link._wire is not None and not link._wire.closed  # the line carried the first decision
        old, line = await link.actor(), link._wire
        ray.kill(old)  # the replica's health check fails; Serve replaces it with a new actor
        deadline = time.monotonic() + 30
        while not line.closed and time.monotonic() < deadline:  # the process goes: its end of the line closes
            await asyncio.sleep(0.05)
        with pytest.raises(WireClosed):  # at once, not at a deadline
            await asyncio.wait_for(link.decide([DecisionRequest(2, 800, 64)], 5), 10)
        second = await decided_once_reported(link, 3)
        assert await link.actor() is not old and link._wire is not None and not link._wire.closed
        return second

    first, prefetched, second = with_router(True, kill_the_actor)
    assert prefetched  # the line was open before the first call
    assert first.decision.prefill_node or first.decision.decode_node
    assert second.decision.prefill_node or second.decision.decode_node


def test_with_the_line_off_the_link_decides_over_ray_calls():
    async def no_line(link):
        return link._wire

    first, prefetched, line = with_router(False, no_line)
    assert not first.fallback and line is None and not prefetched
