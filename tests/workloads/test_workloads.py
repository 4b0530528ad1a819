import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from kairos_ray.workloads import Request, Workload
from kairos_ray.workloads.multiturn import CONVERSATION_SHIFT, MULTITURN, multiturn
from kairos_ray.workloads.synthetic import SYNTHETIC, synthetic
from kairos_ray.workloads.traces import TraceError, load_trace

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_synthetic_workloads_hit_their_rate_and_fit_the_context(name):
    workload = synthetic(name, rps=4.0, num_requests=3000, seed=1)
    assert len(workload) == 3000
    assert workload.rate_rps == pytest.approx(4.0, rel=0.15)
    assert all(r.prompt_tokens + r.output_tokens <= 32_768 for r in workload.requests)
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in workload.requests)


def test_prompt_and_decode_lengths_follow_the_names():
    median = {n: np.median([r.prompt_tokens for r in synthetic(n, 4, 2000).requests]) for n in ("lpld", "hpld")}
    assert median["hpld"] > 4 * median["lpld"]
    outputs = {n: np.median([r.output_tokens for r in synthetic(n, 4, 2000).requests]) for n in ("lpld", "lphd")}
    assert outputs["lphd"] > 4 * outputs["lpld"]


def test_bursty_arrivals_clump_more_than_poisson():
    def gap_cv(name):
        gaps = np.diff([r.arrival_s for r in synthetic(name, 4, 4000, seed=5).requests])
        return gaps.std() / gaps.mean()

    assert gap_cv("lpld") == pytest.approx(1.0, abs=0.1)
    assert gap_cv("bursty") > 1.8


def test_synthetic_is_seeded():
    assert synthetic("bursty", 2, 50, seed=7) == synthetic("bursty", 2, 50, seed=7)
    assert synthetic("bursty", 2, 50, seed=7) != synthetic("bursty", 2, 50, seed=8)


def test_unknown_workload_and_bad_rate():
    with pytest.raises(ValueError, match="unknown workload 'spiky'; known: lpld"):
        synthetic("spiky", 1)
    with pytest.raises(ValueError, match="rate must be > 0"):
        synthetic("lpld", 0)


def test_scaling_and_clipping():
    w = Workload("w", (Request(0.0, 10, 5), Request(1.0, 40_000, 5), Request(2.0, 0, 0)))
    assert w.scaled_to_rate(2.0).requests[-1].arrival_s == pytest.approx(1.0)
    clipped = w.clipped_to_context(32_768)
    assert clipped.clipped == 2
    assert clipped.requests[1] == Request(1.0, 32_767, 1)
    assert clipped.requests[2] == Request(2.0, 1, 1)


def test_plain_csv_and_formats(tmp_path):
    plain = tmp_path / "plain.csv"
    plain.write_text("arrival_s,prompt_tokens,output_tokens\n2.5,100,10\n1.5,200,20\n")
    w = load_trace(plain)
    assert w.requests == (Request(0.0, 200, 20), Request(1.0, 100, 10))

    mooncake = tmp_path / "mc.jsonl"
    mooncake.write_text(
        "\n".join(
            json.dumps({"timestamp": t, "input_length": 300, "output_length": 7, "hash_ids": [1]}) for t in (0, 500)
        )
    )
    assert [r.arrival_s for r in load_trace(mooncake).requests] == [0.0, 0.5]

    burst = tmp_path / "burstgpt.csv"
    burst.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n7,GPT-4,1000,50,1050,API log\n"
    )
    assert load_trace(burst).requests[1] == Request(2.0, 1000, 50)


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("bad.csv", "arrival_s,prompt_tokens,output_tokens\n0,10,1\n1,ten,1\n", r"bad\.csv:3: prompt_tokens = 'ten'"),
        ("neg.csv", "arrival_s,prompt_tokens,output_tokens\n-1,10,1\n", r"neg\.csv:2: arrival_s = '-1' is negative"),
        ("short.csv", "arrival_s,prompt_tokens,output_tokens\n0,10\n", r"short\.csv:2: expected 3 fields"),
        ("what.csv", "a,b,c\n1,2,3\n", r"unrecognised header \['a', 'b', 'c'\]"),
        (
            "bad.jsonl",
            '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1}\n',
            r"bad\.jsonl:2: missing",
        ),
        ("empty.csv", "arrival_s,prompt_tokens,output_tokens\n", "no requests"),
    ],
)
def test_malformed_traces_name_file_line_and_field(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceError, match=message):
        load_trace(path)


def test_missing_file_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError, match=r"nothere\.csv"):
        load_trace(tmp_path / "nothere.csv")


@pytest.mark.skipif(not TRACES.is_dir(), reason="the shared Azure traces are not beside this checkout")
def test_azure_conversation_trace():
    w = load_trace(TRACES / "azure_llm_2023_conv.csv")
    assert len(w) == 19_366
    assert w.requests[0] == Request(0.0, 374, 44)
    assert w.requests[1].arrival_s == pytest.approx(4.3145790, abs=1e-6)
    assert 3000 < w.duration_s < 3600


# ---- prefix identity --------------------------------------------------------------------------


def test_multiturn_hits_its_rate_and_is_seeded():
    workload = synthetic("multiturn", rps=4.0, num_requests=3000, seed=1)
    assert len(workload) == 3000 and workload.block_tokens == 16
    assert workload.rate_rps == pytest.approx(4.0, rel=0.15)
    assert all(r.prompt_tokens + r.output_tokens <= 32_768 for r in workload.requests)
    assert workload == synthetic("multiturn", 4.0, 3000, seed=1) != synthetic("multiturn", 4.0, 3000, seed=2)


def test_a_turns_prompt_holds_the_last_turns_prompt_and_answer():
    workload = multiturn(rps=2.0, num_requests=400, seed=3)
    by_conversation: dict[int, list[Request]] = {}
    for r in workload.requests:
        by_conversation.setdefault(r.block_hashes[-1] >> CONVERSATION_SHIFT, []).append(r)
    turns = max(by_conversation.values(), key=len)
    assert len(turns) >= 3
    for last, turn in itertools.pairwise(turns):
        assert turn.arrival_s > last.arrival_s
        assert turn.prompt_tokens > last.prompt_tokens + last.output_tokens  # its answer and a new message
        held = (last.prompt_tokens + last.output_tokens) // 16  # every full block of the last prompt and answer
        assert turn.block_hashes[:held] == last.block_hashes[:held]
        assert len(turn.block_hashes) == (turn.prompt_tokens + turn.output_tokens) // 16


def test_conversations_share_the_system_prompt_and_nothing_else():
    first, second = (min(rs, key=lambda r: r.prompt_tokens) for rs in _two_conversations())
    shared = MULTITURN.system_prompt_tokens // 16
    assert first.block_hashes[:shared] == second.block_hashes[:shared] == tuple(range(shared))
    assert first.block_hashes[shared] != second.block_hashes[shared]


def _two_conversations() -> list[list[Request]]:
    groups: dict[int, list[Request]] = {}
    for r in multiturn(rps=2.0, num_requests=200, seed=4).requests:
        groups.setdefault(r.block_hashes[-1] >> CONVERSATION_SHIFT, []).append(r)
    return list(groups.values())[:2]


def test_clipping_keeps_the_blocks_that_still_exist():
    w = Workload("w", (Request(0.0, 40, 20, (1, 2, 3)), Request(1.0, 100, 1, (4, 5, 6, 7, 8, 9))), block_tokens=16)
    clipped = w.clipped_to_context(50)
    assert clipped.requests[0].block_hashes == (1, 2, 3)  # 40 + 10 tokens: three whole blocks
    assert clipped.requests[1].block_hashes == (4, 5, 6)  # the prompt was cut to 49 tokens: its first 3 blocks


def test_traces_keep_prefix_identity_where_they_have_it(tmp_path):
    mooncake = tmp_path / "mc.jsonl"
    mooncake.write_text(
        json.dumps({"timestamp": 0, "input_length": 1100, "output_length": 7, "hash_ids": [4, 5, 6]}) + "\n"
    )
    w = load_trace(mooncake)
    assert w.block_tokens == 512 and w.requests[0].block_hashes == (4, 5)  # the partial third block is not cached
    plain = tmp_path / "plain.csv"
    plain.write_text("arrival_s,prompt_tokens,output_tokens,hash_ids\n0,1024,10,7 8\n1,100,10,\n")
    assert [r.block_hashes for r in load_trace(plain).requests] == [(7, 8), ()]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": 3}) + "\n")
    with pytest.raises(TraceError, match=r"bad\.jsonl:1: hash_ids = 3 is not a list"):
        load_trace(bad)
