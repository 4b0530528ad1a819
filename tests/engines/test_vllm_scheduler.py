"""Real vLLM CPU engines with the tiny model: a deflected request is prefilled exactly in its schedule's chunks."""

from collections import OrderedDict

import pytest

from kairos_ray.core import StepLatencyModel
from kairos_ray.engines.vllm_args import GUARD_KEY, JOIN_KEY, guard_spec, join_spec
from kairos_ray.engines.vllm_scheduler import CHUNK_LOG_REQUESTS, ChunkScheduleScheduler, next_chunk
from tests.engines.tiny import GREEDY, PROMPTS, engine

pytestmark = pytest.mark.vllm

# 10 ms a step plus 0.1 ms a prefill token, against a 16.5 ms budget: beside a decode batch at most 64-token chunks
TIGHT_GUARD = guard_spec(StepLatencyModel(0.01, 0, 0, 1e-4, 0, 0), (256, 128, 64), 0.0165)
# Each prefill token also costs 0.1 us per token of its request's prefix, against 36.5 ms: 256 fits a first chunk
# (35.6 ms), but from a prefix of 256 on only 128 does (42.2 ms against 26.1 ms)
PREFIX_GUARD = guard_spec(StepLatencyModel(0.01, 0, 0, 1e-4, 0, 0, c_chunk_prefix=1e-7), (256, 128, 64), 0.0365)
# 10 ms a step plus 1 ms a decoding request: a request joining one that decodes makes a 12 ms step, over 11.5 ms
JOIN_MODEL = StepLatencyModel(0.01, 0.001, 0, 0, 0, 0)
TIGHT_JOIN, LOOSE_JOIN = join_spec(JOIN_MODEL, 0.0115), join_spec(JOIN_MODEL, 0.05)


def test_next_chunk_walks_the_schedule():
    assert next_chunk((256, 128, 64), 0) == 256
    assert next_chunk((256, 128, 64), 300) == 84
    assert next_chunk((256, 128, 64), 447) == 1
    assert next_chunk((256, 128, 64), 448) is None


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
        greedy = GREEDY
        deflected, guarded, by_prefix = [], [], []
        for prompt in PROMPTS:
            for extra, out in (
                ({}, deflected),
                ({GUARD_KEY: TIGHT_GUARD}, guarded),
                ({GUARD_KEY: PREFIX_GUARD}, by_prefix),
            ):
                # a request already decoding, then the deflected one: its chunks share steps with the decode
                decoder = {"prompt_token_ids": list(range(50, 60))}
                extra = {"chunk_schedule": schedule_for(len(prompt)), **extra}
                outs = llm.generate(
                    [decoder, {"prompt_token_ids": prompt}],
                    [SamplingParams(max_tokens=64, **greedy), SamplingParams(max_tokens=8, extra_args=extra, **greedy)],
                    use_tqdm=False,
                )
                # the engine core keys requests by the front end's id plus a suffix
                (record,) = [log for rid, log in scheduler.chunk_log.items() if rid.split("-")[0] == outs[1].request_id]
                out.append((list(outs[1].outputs[0].token_ids), record))
        joins = {name: joined(llm, scheduler, spec) for name, spec in (("tight", TIGHT_JOIN), ("loose", LOOSE_JOIN))}
        del llm
        plain = engine()
        reference = [
            list(o.outputs[0].token_ids)
            for o in plain.generate(
                [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=8, **greedy), use_tqdm=False
            )
        ]
    return deflected, reference, guarded, by_prefix, joins


def joined(llm, scheduler, spec) -> tuple[bool, list[int]]:
    """A request carrying the join guard ``spec`` (as a hand-off does) sent while another decodes: whether it
    started beside that one, and its greedy tokens."""
    from vllm import SamplingParams

    core = llm.llm_engine
    core.add_request("decoder", {"prompt_token_ids": list(range(50, 60))}, SamplingParams(max_tokens=16, **GREEDY))
    core.step()  # prefilled: decoding from here on
    params = SamplingParams(max_tokens=8, extra_args={JOIN_KEY: spec}, **GREEDY)
    core.add_request("joiner", {"prompt_token_ids": PROMPTS[1]}, params)
    decoding, beside, tokens = True, False, []
    while core.has_unfinished_requests():
        for output in core.step():
            if output.request_id == "decoder" and output.finished:
                decoding = False
            if output.request_id == "joiner" and output.finished:
                tokens = list(output.outputs[0].token_ids)
        started = [r for rid, r in scheduler.requests.items() if rid.startswith("joiner") and r.num_computed_tokens]
        beside |= bool(started) and decoding
    return beside, tokens


def test_deflected_prefill_follows_its_schedule_interleaved_with_decodes(runs):
    deflected, *_ = runs
    for prompt, (_, record) in zip(PROMPTS, deflected, strict=True):
        assert [tokens for tokens, _ in record] == schedule_for(len(prompt))
        if len(record) > 1:
            assert any(decoding for _, decoding in record[1:])  # later chunks ran beside the decoding request


def test_deflected_tokens_equal_a_plain_engines(runs):
    deflected, reference, guarded, by_prefix, _ = runs
    assert [tokens for tokens, _ in deflected] == reference
    assert [tokens for tokens, _ in guarded] == reference
    assert [tokens for tokens, _ in by_prefix] == reference


def test_the_run_time_guard_shrinks_chunks_that_no_longer_fit_beside_the_batch(runs):
    """Beside a decoding request only 64-token chunks fit TIGHT_GUARD's budget; alone, the plan runs as is."""
    _, _, guarded, *_ = runs
    for prompt, (_, record) in zip(PROMPTS, guarded, strict=True):
        assert sum(tokens for tokens, _ in record) == len(prompt)
        assert all(tokens <= 64 for tokens, decoding in record if decoding)
    assert max(tokens for tokens, _ in guarded[-1][1]) > 64  # chunks ran unshrunk where no decode ran beside


def test_the_run_time_guard_counts_the_requests_own_prefix(runs):
    """Beside a decoding request, the first 256-token chunk fits PREFIX_GUARD; once 256 tokens are in, only 128."""
    _, _, _, by_prefix, _ = runs
    for prompt, (_, record) in zip(PROMPTS, by_prefix, strict=True):
        assert sum(tokens for tokens, _ in record) == len(prompt)
        prefix = 0
        for tokens, decoding in record:
            if decoding and prefix >= 256:
                assert tokens <= 128
            prefix += tokens
    assert any(tokens == 256 for tokens, _ in by_prefix[-1][1])  # the unshrunk first chunk


def test_a_handoff_whose_joining_step_would_overrun_waits_until_the_batch_shrinks(runs):
    """Decode-side protection: beside a decoding request the joined step takes 12 ms, over TIGHT_JOIN's 11.5 ms,
    so the request waits until that one has finished; within LOOSE_JOIN's it joins at once. Its tokens are the
    same either way, a plain engine's."""
    _, reference, _, _, joins = runs
    (tight_beside, tight_tokens), (loose_beside, loose_tokens) = joins["tight"], joins["loose"]
    assert not tight_beside and loose_beside
    assert tight_tokens == loose_tokens == reference[1]


def test_the_chunk_log_keeps_the_latest_requests_only():
    scheduler = ChunkScheduleScheduler.__new__(ChunkScheduleScheduler)  # its log alone: no engine behind it
    scheduler.chunk_log = OrderedDict()
    for i in range(CHUNK_LOG_REQUESTS + 10):
        scheduler._log(f"r{i}", 100, 1)
        scheduler._log(f"r{i}", 50, 1)
    assert len(scheduler.chunk_log) == CHUNK_LOG_REQUESTS
    assert next(iter(scheduler.chunk_log)) == "r10" and scheduler.chunk_log["r73"] == [(100, 1), (50, 1)]
