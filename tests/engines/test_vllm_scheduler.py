"""Real vLLM CPU engines with the tiny model: a deflected request is prefilled exactly in its schedule's chunks."""

from importlib import resources

import pytest

from kairos_ray.engines.vllm_scheduler import next_chunk

MODEL = str(resources.files("kairos_ray") / "models" / "tiny-llama")
PROMPTS = [
    [3 + (i * 7) % 500 for i in range(n)] for n in (37, 300, 695, 1500)
]  # not block multiples; 1500 > the budget


def test_next_chunk_walks_the_schedule():
    assert next_chunk((256, 128, 64), 0) == 256
    assert next_chunk((256, 128, 64), 300) == 84
    assert next_chunk((256, 128, 64), 447) == 1
    assert next_chunk((256, 128, 64), 448) is None


def engine(**kwargs):
    from vllm import LLM

    return LLM(
        model=MODEL,
        load_format="dummy",
        seed=0,
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        max_num_batched_tokens=512,
        kv_cache_memory_bytes=256 << 20,
        enable_prefix_caching=False,  # every prompt token is prefilled, as the router's schedule assumes
        **kwargs,
    )


def schedule_for(prompt_tokens: int) -> list[int]:
    """A shrinking schedule, as LargestSafe makes them: 256s, then 128s, then 64s, the rest last."""
    schedule, left = [], prompt_tokens
    for chunk in (256, 128, 64):
        while left > chunk and (chunk != 256 or len(schedule) < 2) and (chunk != 128 or len(schedule) < 4):
            schedule.append(chunk)
            left -= chunk
    return [*schedule, left]


@pytest.fixture(scope="module")
def runs():
    """Greedy tokens and chunk records: deflected with schedules next to running decodes, then a plain engine."""
    from vllm import SamplingParams

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the scheduler in this process, to read its record
        llm = engine(scheduler_cls="kairos_ray.engines.vllm_scheduler.ChunkScheduleScheduler")
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        greedy = {"temperature": 0.0, "ignore_eos": True}
        deflected = []
        for prompt in PROMPTS:
            # a request already decoding, then the deflected one: its chunks share steps with the decode
            decoder = {"prompt_token_ids": list(range(50, 60))}
            outs = llm.generate(
                [decoder, {"prompt_token_ids": prompt}],
                [
                    SamplingParams(max_tokens=64, **greedy),
                    SamplingParams(max_tokens=8, extra_args={"chunk_schedule": schedule_for(len(prompt))}, **greedy),
                ],
                use_tqdm=False,
            )
            # the engine core keys requests by the front end's id plus a suffix
            (record,) = [log for rid, log in scheduler.chunk_log.items() if rid.split("-")[0] == outs[1].request_id]
            deflected.append((list(outs[1].outputs[0].token_ids), record))
        del llm
        plain = engine()
        reference = [
            list(o.outputs[0].token_ids)
            for o in plain.generate(
                [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=8, **greedy), use_tqdm=False
            )
        ]
    return deflected, reference


def test_deflected_prefill_follows_its_schedule_interleaved_with_decodes(runs):
    deflected, _ = runs
    for prompt, (_, record) in zip(PROMPTS, deflected, strict=True):
        assert [tokens for tokens, _ in record] == schedule_for(len(prompt))
        if len(record) > 1:
            assert any(decoding for _, decoding in record[1:])  # later chunks ran beside the decoding request


def test_deflected_tokens_equal_a_plain_engines(runs):
    deflected, reference = runs
    assert [tokens for tokens, _ in deflected] == reference
