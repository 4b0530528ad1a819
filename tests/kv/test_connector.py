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
