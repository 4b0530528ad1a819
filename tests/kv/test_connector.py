"""The Kairos KV connector between two real vLLM CPU engines, and what happens when a transfer goes wrong.

A producer engine prefills (chunked where the prompt exceeds its step budget)
and stages the KV; a consumer engine loads it and decodes. Greedy tokens must
equal a plain engine's: random-weight models turn any wrong KV into other
tokens (the last test checks that they do).
"""

import os

import pytest
import torch

from kairos_ray.kv.staging import rank_path
from tests.engines.tiny import GREEDY, PROMPTS, engine, kv_config

pytestmark = pytest.mark.vllm

OUTPUT = 16


def scheduler_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def generate(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Everything the tests read: one producer, one consumer and one plain engine, one after another."""
    from vllm import SamplingParams

    staging = str(tmp_path_factory.mktemp("staging"))
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the tests read the schedulers
        producer = engine(kv_transfer_config=kv_config("kv_producer", staging))
        remote = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}, **GREEDY)
        # four hand-offs per prompt: good, unreadable, lost, and good but with noise for values
        prefilled = generate(producer, PROMPTS * 4, remote)
        out["producer_kv_usage"] = scheduler_of(producer).kv_cache_manager.usage
        del producer
        params = [o.kv_transfer_params for o in prefilled]
        out["params"] = params
        out["staged"] = [os.path.exists(rank_path(p["kairos_kv"], 0)) for p in params]
        n = len(PROMPTS)
        for p in params[n : 2 * n]:  # corrupt: a file that is no KV at all
            with open(rank_path(p["kairos_kv"], 0), "wb") as f:
                f.write(b"not a tensor file")
        for p in params[2 * n : 3 * n]:  # lost: the file never arrived
            os.unlink(rank_path(p["kairos_kv"], 0))
        for p in params[3 * n :]:  # the right shapes, the wrong values
            path = rank_path(p["kairos_kv"], 0)
            layers = torch.load(path, weights_only=True)
            torch.save({name: torch.randn_like(t) for name, t in layers.items()}, path)

        consumer = engine(kv_transfer_config=kv_config("kv_consumer", staging))
        decoded = generate(
            consumer,
            PROMPTS * 4,
            [SamplingParams(max_tokens=OUTPUT, extra_args={"kv_transfer_params": p}, **GREEDY) for p in params],
        )
        out["decoded"] = [list(o.outputs[0].token_ids) for o in decoded]
        out["cached"] = [o.num_cached_tokens for o in decoded]
        out["left_staged"] = [os.path.exists(rank_path(p["kairos_kv"], 0)) for p in params]

        del consumer

        plain = engine()
        out["reference"] = [
            list(o.outputs[0].token_ids) for o in generate(plain, PROMPTS, SamplingParams(max_tokens=OUTPUT, **GREEDY))
        ]
    return out


def test_producer_stages_every_prompt_and_frees_its_blocks(runs):
    assert all(runs["staged"])
    assert [p["num_tokens"] for p in runs["params"][: len(PROMPTS)]] == [len(p) for p in PROMPTS]
    assert runs["producer_kv_usage"] == 0.0  # blocks freed once staged, chunked prompts included


def test_disaggregated_tokens_equal_a_plain_engines(runs):
    n = len(PROMPTS)
    assert runs["decoded"][:n] == runs["reference"]
    # the consumer computed only the last prompt token: the rest came over
    assert runs["cached"][:n] == [len(p) - 1 for p in PROMPTS]
    assert not any(runs["left_staged"])  # the consumer deletes what it loaded


def test_unreadable_transfer_is_recomputed_not_failed(runs):
    n = len(PROMPTS)
    assert runs["decoded"][n : 2 * n] == runs["reference"]


def test_lost_transfer_is_recomputed_not_failed(runs):
    n = len(PROMPTS)
    assert runs["decoded"][2 * n : 3 * n] == runs["reference"]
    assert runs["cached"][2 * n : 3 * n] == [0] * n  # nothing claimed: the whole prompt ran here


def test_wrong_kv_changes_the_tokens(runs):
    """The comparisons above can fail: a consumer fed noise instead of the KV decodes otherwise."""
    n = len(PROMPTS)
    assert runs["decoded"][3 * n :] != runs["reference"]


HELD = 300  # leading prompt tokens the consumer has cached already: two whole 128-token blocks and part of one


def _kv_blocks(worker, block_ids):
    """Every attention layer's KV at ``block_ids`` (blocks lead on the CPU), on the worker."""
    index = torch.tensor(block_ids, dtype=torch.long)
    layers = worker.model_runner.vllm_config.compilation_config.static_forward_context
    return {
        name: layer.kv_cache.index_select(0, index).clone()
        for name, layer in layers.items()
        if isinstance(getattr(layer, "kv_cache", None), torch.Tensor) and layer.kv_cache.numel()
    }


@pytest.fixture(scope="module")
def cached_runs(tmp_path_factory):
    """A consumer with prefix caching on that holds the leading blocks of the prompts it is handed off.

    Random weights this small barely notice blocks left unloaded (their KV is
    near zero either way), so besides the tokens the fixture keeps what was
    staged and what the consumer's blocks hold after the load.
    """
    from vllm import SamplingParams

    from kairos_ray.kv.connector import KairosKVConnector

    staging = str(tmp_path_factory.mktemp("staging-cached"))
    prompts = PROMPTS[2:]  # longer than the held part
    allocated = {}  # prompt tokens -> (every block of the request, in order; tokens loaded from outside)
    out = {"prompts": prompts}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        producer = engine(kv_transfer_config=kv_config("kv_producer", staging), enable_prefix_caching=True)
        remote = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}, **GREEDY)
        params = [o.kv_transfer_params for o in generate(producer, prompts, remote)]
        del producer
        out["staged"] = [torch.load(rank_path(p["kairos_kv"], 0), weights_only=True) for p in params]

        original = KairosKVConnector.update_state_after_alloc

        def spy(self, request, blocks, num_external_tokens):
            allocated[request.num_prompt_tokens] = (list(blocks.get_block_ids()[0]), num_external_tokens)
            return original(self, request, blocks, num_external_tokens)

        mp.setattr(KairosKVConnector, "update_state_after_alloc", spy)
        consumer = engine(kv_transfer_config=kv_config("kv_consumer", staging), enable_prefix_caching=True)
        generate(consumer, [p[:HELD] for p in prompts], SamplingParams(max_tokens=1, **GREEDY))
        allocated.clear()
        decoded = generate(
            consumer,
            prompts,
            [SamplingParams(max_tokens=OUTPUT, extra_args={"kv_transfer_params": p}, **GREEDY) for p in params],
        )
        out["decoded"] = [list(o.outputs[0].token_ids) for o in decoded]
        out["cached"] = [o.num_cached_tokens for o in decoded]
        out["blocks"] = [allocated[len(p)] for p in prompts]
        out["held"] = [consumer.collective_rpc(_kv_blocks, args=(ids,))[0] for ids, _ in out["blocks"]]
        del consumer
    return out


def test_a_consumer_holding_a_prefix_loads_the_rest_behind_it(runs, cached_runs):
    """The staged blocks past the consumer's own prefix hit land in the request's blocks past it."""
    block = 128
    assert cached_runs["decoded"] == runs["reference"][2:]
    assert cached_runs["cached"] == [len(p) - 1 for p in cached_runs["prompts"]]
    for prompt, staged, (_, external), held in zip(
        cached_runs["prompts"], cached_runs["staged"], cached_runs["blocks"], cached_runs["held"], strict=True
    ):
        hit_blocks = (len(prompt) - 1 - external) // block
        assert hit_blocks >= HELD // block  # the consumer's own cache served the held part
        whole = (len(prompt) - 1) // block  # the last block's tail is recomputed and decoded into
        assert whole > hit_blocks
        for name, layer in staged.items():
            for j in range(hit_blocks, whole):
                assert torch.equal(held[name][j], layer[j]), (len(prompt), name, j)
