"""The load generator's accounting of tokens that come several to an event."""

import numpy as np
import pytest

from kairos_ray.bench.loadgen import PROMPT_BASE, PROMPT_IDS, BenchResult, _tokens_per_event, prompt_ids, token_gaps


def test_tokens_of_one_event_share_its_arrival():
    # events at 0.0 (2 tokens), 0.1 (1 token), 0.4 (3 tokens)
    gaps = token_gaps([0.0, 0.1, 0.4], [2, 1, 3])
    assert gaps == pytest.approx([0.0, 0.1, 0.3, 0.0, 0.0])
    assert len(gaps) == 2 + 1 + 3 - 1 and gaps.max() == pytest.approx(0.3)  # the largest gap is the stall


def test_usage_counts_tokens_per_event_and_without_it_the_rest_is_spread():
    assert _tokens_per_event([2, 1, 3], 6) == [2, 1, 3]  # continuous usage: exact
    assert _tokens_per_event([1, 1, 1], None) == [1, 1, 1]  # no usage at all: one per event
    assert _tokens_per_event([1, 1, 1, 1], 11) == [3, 3, 3, 2]  # only the closing usage: 11 over 4 events


def test_a_replay_that_falls_behind_says_so():
    result = BenchResult([], [], 10.0, achieved_rps=3.95, scheduled_rps=4.0)
    assert not result.behind
    assert BenchResult([], [], 10.0, achieved_rps=3.8, scheduled_rps=4.0).behind
    assert np.isnan(BenchResult([], [], 1.0).achieved_rps)


def test_no_two_requests_prompts_begin_alike():
    """A server's prefix cache must not hit across the requests of a run: their first two ids differ."""
    heads = {tuple(prompt_ids(rid, 2)) for rid in range(3 * PROMPT_IDS)}
    assert len(heads) == 3 * PROMPT_IDS
    prompt = prompt_ids(7, 1200)
    assert len(prompt) == 1200 and all(PROMPT_BASE <= t < PROMPT_BASE + PROMPT_IDS for t in prompt)
    assert prompt_ids(7, 1) == [PROMPT_BASE + 7]
