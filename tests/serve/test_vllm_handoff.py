"""A partly cached prompt's hand-off on real vLLM CPU engines (the vLLM CPU app of ``tests/serve/conftest.py``,
deciding with ``pd``).

When a disaggregated request's decode node already holds the start of its
prompt (a conversation's history), the prefill node's connector stages only
the blocks after it: only those travel, and the decode node loads them after
its own prefix-cache hit. The tokens must be those of a hand-off that carries
the whole prompt.
"""

import pytest

from tests.serve.conftest import use_policy
from tests.serve.test_vllm_prefix import completion, next_turn

pytestmark = [pytest.mark.ray, pytest.mark.vllm]


@pytest.fixture(scope="module")
def pd_app(cpu_app):
    """The vLLM CPU app with every request disaggregated (prefix-aware ``pd``): (base URL, metrics URL)."""
    use_policy("pd")
    return cpu_app


def test_a_hand_off_to_the_decode_node_holding_the_history_carries_only_the_rest(pd_app):
    url, _ = pd_app
    holder, turn, _ = next_turn(url, seed=17)
    partial = completion(url, turn, max_tokens=16)
    kairos = partial.json()["kairos"]
    assert (kairos["route"], kairos["decode_node"]) == ("prefill", holder), kairos["reason"]
    # salted, no cache holds any of it: the whole prompt's KV travels
    whole = completion(url, turn, max_tokens=16, cache_salt="cold")
    assert whole.json()["kairos"]["route"] == "prefill"
    tokens = [r.json()["choices"][0]["token_ids"] for r in (partial, whole)]
    assert tokens[0] == tokens[1]  # the held blocks and the sent ones make the same KV
    # 1 of the prompt's 7 blocks travelled (the 6 the holder has were left out), against all 7
    sent, carried = kairos["kv_bytes"], whole.json()["kairos"]["kv_bytes"]
    assert 0 < sent * 4 < carried, (sent, carried)
