"""Prompt lookup semantics (hf2q/vLLM) and its incremental index."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf2q_py.errors import Hf2qError
from hf2q_py.proposers.ngram import (
    MAX_NGRAM,
    NgramIndex,
    NgramProposer,
    lookup_by_rescan,
    propose_ngram,
    validate_ngram,
)


@pytest.mark.parametrize(
    "tokens, min_n, max_n, k, drafts",
    [
        ([10, 20, 30, 99, 88, 10, 20, 30], 1, 3, 3, [99, 88, 10]),
        ([10, 20, 100, 10, 20, 200, 10, 20], 1, 3, 3, [100, 10, 20]),
        ([1, 2, 3, 4, 5, 99, 1, 2, 3, 4, 5], 2, 2, 3, [99, 1, 2]),
        ([1, 2, 3], 1, 3, 4, []),  # nothing repeats
        ([7], 1, 3, 4, []),
        ([5, 6, 5], 2, 3, 4, []),  # only a 1-gram repeats, below min_n
        ([5, 6, 5], 1, 3, 4, [6, 5]),  # drafts stop at the end of the context
    ],
)
def test_published_vectors(tokens, min_n, max_n, k, drafts):
    assert propose_ngram(tokens, min_n, max_n, k) == drafts


def brute_force(tokens, min_n, max_n, k):
    return lookup_by_rescan(tokens, min_n, max_n, k)


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 5), min_size=1, max_size=60),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(1, 8),
)
def test_matches_brute_force(tokens, min_n, extra, k):
    assert propose_ngram(tokens, min_n, min_n + extra, k) == brute_force(tokens, min_n, min_n + extra, k)


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=2, max_size=80),
    cuts=st.lists(st.integers(1, 10), min_size=1, max_size=10),
)
def test_incremental_index_equals_a_fresh_lookup(tokens, cuts):
    """Growing the context round by round gives the same drafts as rebuilding."""
    proposer = NgramProposer(1, 3)
    proposer.start(None, tokens[:1], {}, None)
    end = 1
    for c in cuts:
        end = min(len(tokens), end + c)
        assert proposer.propose(tokens[:end], 4).tokens == brute_force(tokens[:end], 1, 3, 4)


def test_a_rewritten_history_is_reindexed():
    proposer = NgramProposer(1, 2)
    proposer.start(None, [1, 2, 1], {}, None)
    assert proposer.propose([1, 2, 1], 2).tokens == [2, 1]
    assert proposer.propose([3, 4, 3], 2).tokens == [4, 3]


@pytest.mark.parametrize("min_n, max_n", [(0, 3), (3, 2), (-1, 1)])
def test_bad_ngram_sizes_are_refused(min_n, max_n):
    with pytest.raises(Hf2qError):
        NgramProposer(min_n, max_n)


def test_ngram_size_has_a_documented_maximum():
    validate_ngram(1, MAX_NGRAM)
    with pytest.raises(Hf2qError, match=f"ngram-max must be in \\[1, {MAX_NGRAM}\\]"):
        validate_ngram(1, 100_000)
    with pytest.raises(Hf2qError, match="ngram-min"):
        validate_ngram(MAX_NGRAM + 1, MAX_NGRAM + 1)


@pytest.mark.parametrize(
    "tokens, drafts, depth",
    [
        ([7, 1, 2, 3, 9, 8, 1, 2, 3], [9, 8], 3),  # the 3-gram matches, the token before it does not
        ([5, 1, 2, 3, 9, 5, 1, 2, 3], [9, 5], 4),  # one more token agrees, up to the context's start
        ([4, 6, 1, 9, 1], [9, 1], 1),  # a lone 1-gram
        ([1, 2, 3], [], 0),  # no match
    ],
)
def test_match_depth_counts_the_agreeing_tokens_before_the_drafts(tokens, drafts, depth):
    index = NgramIndex(1, 3)
    index.extend(tokens)
    assert index.match(2) == (drafts, depth)


def match_by_definition(tokens, min_n, max_n, k, cap):
    """The earliest occurrence of the longest suffix (as in lookup_by_rescan),
    then the largest d <= cap with tokens[end-d:end] == tokens[-d:]."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        for start in range(0, size - n):
            if tokens[start : start + n] == tokens[size - n :]:
                end = start + n
                depth = max(
                    d for d in range(0, min(cap, end) + 1) if tokens[end - d : end] == tokens[size - d :]
                )
                return tokens[end : end + k], depth
    return [], 0


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=2, max_size=60), cap=st.integers(3, 40))
def test_match_depth_matches_its_definition(tokens, cap):
    index = NgramIndex(1, 3)
    index.extend(tokens)
    assert index.match(4, max_depth=cap) == match_by_definition(tokens, 1, 3, 4, cap)


def test_draft_key_classes_the_match_depth():
    proposer = NgramProposer(1, 3)
    copied = list(range(100, 140))
    assert proposer.draft_key([1, 2, 3]) == 0
    assert proposer.draft_key([4, 6, 1, 9, 1]) == 1
    assert proposer.draft_key([5, 1, 2, 3, 9, 5, 1, 2, 3]) == 4
    assert proposer.draft_key(copied + [0] + copied[:10]) == 8
    assert proposer.draft_key(copied + [0] + copied[:30]) == 16
