"""Offline replay: proposers judged against a recorded greedy stream."""

import pytest
from models import random_prompt, tiny_target

import hf2q_py
from hf2q_py.errors import Hf2qError
from hf2q_py.tools.replay import (
    BOUND_LABEL,
    KEY_ORACLE_LABEL,
    CostModel,
    Stream,
    bound,
    key_oracle,
    key_survival,
    main,
    markdown,
    replay,
)


COST = CostModel({1: 0.1, 2: 0.11, 9: 0.18, 33: 0.3})


def test_the_cost_model_interpolates_and_extrapolates():
    assert COST(1) == 0.1
    assert COST(5) == pytest.approx(0.11 + 3 / 7 * 0.07)
    assert COST(41) == pytest.approx(0.3 + 8 * 0.12 / 24)


def test_a_cost_growth_scales_each_widths_extra_cost_over_a_decode():
    assert COST.with_growth(1.0).seconds == COST.seconds
    assert set(COST.with_growth(0.0).seconds.values()) == {0.1}
    assert COST.with_growth(0.5)(9) == pytest.approx(0.14)
    with pytest.raises(Hf2qError, match="cost growth must be >= 0"):
        COST.with_growth(-1.0)


def test_replay_accounts_for_every_token():
    out = [5, 6, 7, 8, 9] * 8
    stream = Stream("loop", "code", [1, 2, 5, 6, 7, 8, 9, 3], out)
    (row,) = replay([stream], "suffix", {"method": "ngram", "k": 8, "adaptive": False}, COST)
    assert row.accepted + row.rounds == len(out)
    assert row.mean_accepted_length > 4
    assert row.speedup > 2
    assert row.baseline_seconds == pytest.approx(0.1 * len(out))
    assert "| loop | suffix | 40 |" in markdown([row])


def test_a_session_shares_its_memory_and_other_streams_do_not():
    answer = random_prompt(40, 9)
    prompt = random_prompt(10, 8)
    alone = [Stream("a", "code", prompt, answer), Stream("b", "code", prompt, answer)]
    session = [Stream("a", "code", prompt, answer, "s"), Stream("b", "code", prompt, answer, "s")]
    opts = {"method": "ngram", "k": 16}
    a1, b1 = replay(alone, "x", opts, COST)
    a2, b2 = replay(session, "x", opts, COST)
    assert b1.accepted == a1.accepted == a2.accepted
    assert b2.accepted > b1.accepted  # the retry drafts the first answer
    assert b2.mean_accepted_length > 5


def test_replayed_acceptance_of_a_real_greedy_stream():
    target = tiny_target("llama")
    prompt = (random_prompt(6, 3) * 8)[:40]
    out = hf2q_py.generate(target, prompt, max_tokens=60, method="baseline").tokens
    (row,) = replay(
        [Stream("t", "code", prompt, out)], "s", {"method": "ngram", "k": 4, "adaptive": False}, COST
    )
    assert row.accepted + row.rounds == len(out)


def test_a_pipeline_restart_after_a_verify_is_charged():
    """The first plain decode after a verify round costs ``restart`` extra,
    as in the engine (plain decodes are pipelined, verifies are not)."""
    out = [5, 6, 7, 8, 9] * 4 + list(range(100, 120))
    stream = Stream("copy then fresh", "code", [1, 2, 5, 6, 7, 8, 9, 3], out)
    opts = {"method": "ngram", "k": 8, "adaptive": False}
    (free,) = replay([stream], "x", opts, COST)
    (charged,) = replay([stream], "x", opts, CostModel(COST.seconds, restart=0.1))
    assert charged.accepted == free.accepted
    assert charged.seconds > free.seconds + 0.1 - 1e-9


def test_the_bound_drafts_only_what_is_accepted_and_beats_the_policy():
    """The bound knows how many drafts the target accepts: it never drafts a
    rejected token, decodes plainly where nothing would be accepted, and no
    policy over the same drafts models faster."""
    out = [5, 6, 7, 8, 9] * 4 + list(range(100, 120)) + [5, 6, 7, 8, 9, 3]
    stream = Stream("copy, fresh, copy", "code", [1, 2, 5, 6, 7, 8, 9, 3], out)
    (b,) = bound([stream], COST)
    # 19 drafts, not 20: as in the engine, the last copy is drafted during a
    # plain decode, which confirms its first token (a decode round, not a draft)
    assert b.method == BOUND_LABEL and b.drafted == b.accepted >= 19
    assert b.accepted + b.rounds == len(out)
    for opts in ({"method": "ngram"}, {"method": "ngram", "k": 8, "adaptive": False}):
        (row,) = replay([stream], "x", opts, COST)
        assert b.seconds <= row.seconds


BLOCK = list(range(200, 230))
#: A 30-token block copied, a fresh stretch, and the block's start again.
BLOCK_STREAM = Stream("block", "code", [*BLOCK, 1], [*BLOCK, *range(100, 120), *BLOCK[:10]])


def test_key_survival_is_each_keys_measured_acceptance_to_each_depth():
    survival = key_survival([BLOCK_STREAM], k_max=8)
    for curve in survival.values():
        assert all(1.0 >= a >= b >= 0.0 for a, b in zip(curve, curve[1:]))
    assert survival[(16, False, False)][0] >= 0.9  # deep in the copy the next token is right
    assert survival[(16, False, False)][-1] < survival[(16, False, False)][0]  # until the copy ends


def test_the_key_oracle_drafts_what_each_keys_acceptance_pays_and_beats_a_fixed_k():
    """Knowing every key's acceptance, it drafts the copy long, decodes the
    fresh stretch plainly, and beats drafting a fixed K everywhere."""
    (kb,) = key_oracle([BLOCK_STREAM], COST)
    (fixed,) = replay([BLOCK_STREAM], "x", {"method": "ngram", "k": 8, "adaptive": False}, COST)
    assert kb.method == KEY_ORACLE_LABEL
    assert kb.accepted + kb.rounds == len(BLOCK_STREAM.output)
    assert kb.accepted >= 30 and kb.seconds < fixed.seconds


def test_replay_cuts_answers_to_max_tokens(tmp_path, capsys):
    from hf2q_py.tools.replay import save

    path = str(tmp_path / "s.json")
    save(path, [Stream("loop", "code", [1, 2, 5, 6, 7, 8, 9, 3], [5, 6, 7, 8, 9] * 8)], COST, "test")
    assert main(["--streams", path, "--methods", "ngram", "--max-tokens", "12", "--bound"]) == 0
    table = capsys.readouterr().out
    assert "| loop | ngram | 12 |" in table and f"| loop | {BOUND_LABEL} | 12 |" in table
    assert main(["--streams", path, "--max-tokens", "0"]) == 2
    assert "--max-tokens must be >= 1" in capsys.readouterr().out
    assert main(["--streams", path, "--cost-growth", "nan"]) == 2
    assert "cost growth must be >= 0, got nan" in capsys.readouterr().out


def test_only_model_free_methods_replay():
    with pytest.raises(Hf2qError, match="model-free"):
        replay([Stream("t", "code", [1], [2])], "d", {"method": "layerskip"}, COST)


def test_a_session_workload_feeds_each_answer_to_the_next_request_and_retries():
    from hf2q_py.tools.workloads import Workload, default_workloads

    w = Workload("s", "agent", "edit A", then=(("next", "edit B of:\n{answer}"), ("retry", None)))
    assert w.requests([]) == [("s", "edit A")]
    assert [p for _, p in w.requests(["ANSWER1", "ANSWER2"])] == [
        "edit A",
        "edit B of:\nANSWER1",
        "edit B of:\nANSWER1",
    ]
    kinds = {x.kind for x in default_workloads()}
    assert {"code", "agent", "fresh", "prose", "doc"} <= kinds


def test_a_cold_replay_starts_each_stream_on_a_fresh_target():
    """Warm, the second of two alike streams starts from the costs the first
    measured; cold, it starts from nothing measured, as the first did."""
    out = [5, 6, 7, 8, 9] * 4 + list(range(100, 120)) + [5, 6, 7, 8, 9, 3]
    streams = [Stream(n, "code", [1, 2, 5, 6, 7, 8, 9, 3], out) for n in ("a", "b")]
    cold_a, cold_b = replay(streams, "x", {"method": "ngram"}, COST, cold=True)
    warm_a, _ = replay(streams, "x", {"method": "ngram"}, COST)
    assert (
        (cold_b.rounds, cold_b.seconds) == (cold_a.rounds, cold_a.seconds) == (warm_a.rounds, warm_a.seconds)
    )


def test_a_replayed_prefill_takes_a_forward_of_its_width_and_teaches_the_slope():
    """The recorded clock charges the prompt's prefill a forward of its width,
    so adaptive K learns the slope of wide verifies from it as in a live run."""
    from hf2q_py.draft_length import AdaptiveK
    from hf2q_py.generation import generate_tokens
    from hf2q_py.proposers.suffix import SuffixProposer
    from hf2q_py.tools.recorded import RecordedTarget

    prompt = random_prompt(100, 8)
    target = RecordedTarget(prompt, prompt[:20], COST)
    policy = AdaptiveK(16, SuffixProposer.profile)
    for _ in generate_tokens(target, prompt, max_tokens=20, proposer=SuffixProposer(), policy=policy):
        pass
    per_token = COST(len(prompt) - 1) / (len(prompt) - 1)
    assert policy.cost_model.slope() == pytest.approx(per_token / policy.cost_model.decode_time())


def test_a_recorded_streams_line_breaks_key_its_replayed_drafts(tmp_path):
    from hf2q_py.methods import SpecConfig, build_proposer
    from hf2q_py.tools.replay import _Replayer, load, save

    path = tmp_path / "streams.json"
    save(str(path), [Stream("s", "code", [1, 9, 3], [1, 9], line_breaks=[9])], COST, "test")
    (stream,), _ = load(str(path))
    proposer, _ = build_proposer(_Replayer(COST).target(stream), SpecConfig(method="ngram"))
    assert proposer.draft_key([1, 9, 3, 1, 9]) == (2, False, True)
