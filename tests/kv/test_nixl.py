"""vLLM's own NixlConnector as the KV transport, selected by configuration (pip install nixl).

The prefill node's ``kv_transfer_params`` are the hand-off; the decode node's
NixlConnector pulls the blocks. Greedy tokens must equal a plain run's.
"""

import pytest

from kairos_ray.bench.local import free_port
from tests.engines.test_vllm_engine import OUTPUT, joined_under_a_tight_guard, plain_tokens, request, tokens
from tests.engines.tiny import PROMPTS, TINY_KWARGS, node_pair

pytestmark = pytest.mark.vllm

pytest.importorskip("nixl", reason="the NixlConnector needs the nixl package")

NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


@pytest.fixture(scope="module")
def nixl_nodes():
    def per_role(role):  # each engine its own side-channel port, as each replica picks one
        # The watchdog at a minute: once on a 2-core CI machine the prefill node's first NIXL step went 10 s
        # (the default) without a step or an answer, and this test is about the tokens, not the watchdog.
        return {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}, {"stall_timeout_s": 60.0}

    with node_pair({**TINY_KWARGS, "kv_transfer_config": NIXL}, per_role) as nodes:
        yield nodes


def test_nixl_hand_off_matches_a_plain_run(nixl_nodes):
    run, prefill, decode = nixl_nodes
    for i, prompt in enumerate(PROMPTS):
        req = request(500 + i, prompt)
        handoff = run(prefill.prefill(req))
        assert isinstance(handoff.kv, dict) and handoff.kv.get("remote_block_ids")  # NIXL's own parameters
        got = run(tokens(decode, req, handoff))
        assert len(got) == OUTPUT and got == run(plain_tokens(decode, i, prompt))


def test_a_nixl_hand_off_joins_the_decode_batch_only_once_its_step_fits_the_budget(nixl_nodes):
    """A hand-off vLLM loads asynchronously is held before its load starts (its KV waits on the prefill node)
    until the decoding request has finished; its tokens are a plain run's."""
    run, prefill, decode = nixl_nodes
    joined, decoded, order = joined_under_a_tight_guard(run, prefill, decode, 600)
    assert len(decoded) == 256 and joined == run(plain_tokens(decode, 1, PROMPTS[1]))
    assert order.index("joiner") == len(decoded)  # every token of the decoder came first
