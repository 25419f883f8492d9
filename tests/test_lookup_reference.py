"""mlx-dspark's lookup rule as a replay reference (hf2q_py/tools/lookup_reference.py)."""

from hf2q_py.tools.lookup_reference import BASE, LONG, LookupReference
from hf2q_py.tools.replay import REFERENCE_LABEL, CostModel, Stream, reference

COST = CostModel({1: 0.1, 2: 0.11, 9: 0.18, 33: 0.3})


def proposer_over(tokens):
    p = LookupReference()
    p.start(None, tokens, {}, None)
    return p


def test_the_longest_ngram_wins_and_its_latest_earlier_occurrence_is_copied():
    # "1 2 3" occurs twice before the end (continued by 7, then by 8); "0 1 2 3" only once (continued by 9)
    tokens = [0, 1, 2, 3, 9, 5, 1, 2, 3, 7, 6, 1, 2, 3, 8, 6, 0, 1, 2, 3]
    assert proposer_over(tokens).propose(tokens, 32).tokens[0] == 9
    tokens = [5, 1, 2, 3, 7, 6, 4, 1, 2, 3, 8, 6, 4, 4, 1, 2, 3]  # no 4-gram: the latest 3-gram
    assert proposer_over(tokens).propose(tokens, 32).tokens[:2] == [8, 6]


def test_no_match_drafts_nothing():
    tokens = list(range(20))
    assert not proposer_over(tokens).propose(tokens, 32).tokens


def test_drafts_are_six_tokens_unless_the_match_runs_back_eight_or_more():
    body = list(range(100, 140))
    short = [1, 2, 3, 4, *body, 9, 9, 9, 1, 2, 3, 4]  # a 4-token match
    assert len(proposer_over(short).propose(short, 64).tokens) == BASE
    long = [*range(50, 60), *body, 9, *range(50, 60)]  # a 10-token match: 2 * 10 drafts
    assert len(proposer_over(long).propose(long, 64).tokens) == 20
    deep = [*body, 9, *body[:30]]  # a 30-token match: capped at 32
    assert len(proposer_over(deep).propose(deep, 64).tokens) == LONG
    assert len(proposer_over(deep).propose(deep, 5).tokens) == 5  # and never more than K


def test_two_failed_long_drafts_stop_long_drafts_until_eight_base_rounds_pass():
    body = list(range(100, 140))
    deep = [*body, 9, *body[:30]]
    p = proposer_over(deep)
    p.update(deep, LONG, 3, {})
    p.update(deep, LONG, 3, {})  # two long drafts accepting under half
    assert len(p.propose(deep, 64).tokens) == BASE
    for _ in range(8):
        p.update(deep, BASE, BASE, {})
    assert len(p.propose(deep, 64).tokens) == LONG  # a long probe again


def test_the_reference_replays_in_the_same_loop_and_keeps_every_token():
    out = [5, 6, 7, 8, 9] * 8
    stream = Stream("loop", "code", [1, 2, 5, 6, 7, 8, 9, 3], out)
    (row,) = reference([stream], COST)
    assert row.method == REFERENCE_LABEL
    assert row.accepted + row.rounds == len(out)
    assert row.speedup > 1.5
