"""The suffix proposer: automaton facts against brute force, draft sizing,
the Target's memory of earlier generations, and losslessness end to end."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf2q_py.errors import Hf2qError
from hf2q_py.memory import DraftMemory
from hf2q_py.automaton import SuffixAutomaton
from hf2q_py.proposers.suffix import SuffixOptions, SuffixProposer, depth_class


def occurrences(tokens, w):
    n = len(w)
    return sum(1 for i in range(len(tokens) - n + 1) if tokens[i : i + n] == w)


def longest_earlier_suffix(tokens):
    """The longest suffix that also ends somewhere before the last token."""
    best = 0
    for n in range(1, len(tokens)):
        w = tokens[-n:]
        if any(tokens[j : j + n] == w for j in range(len(tokens) - n)):
            best = n
    return best


def state_of(sam, w):
    v = 0
    for c in w:
        v = sam.nxt[v][c]
    return v


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=50))
def test_the_automaton_finds_the_longest_earlier_suffix_and_counts_occurrences(tokens):
    sam = SuffixAutomaton()
    for i, t in enumerate(tokens):
        sam.extend([t])
        match = sam.link[sam.last]
        assert (sam.length[match] if match > 0 else 0) == longest_earlier_suffix(tokens[: i + 1])
    for n in range(1, 5):
        for start in range(len(tokens) - n + 1):
            w = tokens[start : start + n]
            assert sam.count[state_of(sam, w)] == occurrences(tokens, w)


@settings(max_examples=100, deadline=None)
@given(
    text=st.lists(st.integers(0, 3), min_size=1, max_size=40), query=st.lists(st.integers(0, 4), max_size=30)
)
def test_streaming_match_is_the_longest_suffix_that_occurs(text, query):
    sam = SuffixAutomaton()
    sam.extend(text)
    state, matched = 0, 0
    for i, c in enumerate(query):
        state, matched = sam.step(state, matched, c)
        seen = query[: i + 1]
        want = max((n for n in range(1, len(seen) + 1) if occurrences(text, seen[-n:])), default=0)
        assert matched == want


def test_drafts_follow_the_most_frequent_continuation_until_it_is_unlikely():
    sam = SuffixAutomaton()
    # after 7: "8 9" three times, "8 5" once; after "7 8": 9 with probability 3/4
    sam.extend([7, 8, 9, 1, 7, 8, 9, 2, 7, 8, 9, 3, 7, 8, 5, 4, 7])
    state = sam.link[sam.last]
    drafts, expected, _ = sam.draft(state, 10, min_prob=0.5)
    assert drafts[:2] == [8, 9]
    # after "7 8 9" the three continuations 1, 2, 3 tie at 1/3: below 0.5, stop
    assert drafts == [8, 9]
    assert expected == pytest.approx(1.0 + 0.75)
    assert sam.draft(state, 10, min_prob=0.0)[0][:3] == [8, 9, 3]  # ties: the latest


def test_a_draft_is_sized_by_its_match_length():
    p = SuffixProposer(SuffixOptions(min_prob=0.0, factor=1.0, offset=2))
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1]
    p.start(None, ctx, {}, None)
    assert p.draft_key(ctx) == (depth_class(1), False, False)
    assert p.propose(ctx, 32).tokens == [2, 3, 4]  # match of 1: at most 1 * 1 + 2 drafts
    ctx2 = ctx + [2, 3, 4]
    assert p.draft_key(ctx2) == (4, False, False)
    assert p.propose(ctx2, 32).tokens == [5, 6, 7, 8, 9, 10]  # match of 4: 6 drafts
    assert p.propose(ctx2, 3).tokens == [5, 6, 7]  # and never more than k


def test_the_draft_key_says_whether_earlier_continuations_split():
    """The key is (match-depth class, split): whether the earlier occurrences
    of the match continued with different tokens (a first draft token that
    is often wrong, whatever the depth)."""
    p = SuffixProposer()
    once = [5, 6, 7, 1, 5, 6]
    agree = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6]
    split = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    for ctx, is_split in ((once, False), (agree, False), (split, True)):
        p.start(None, ctx, {}, None)
        assert p.draft_key(ctx) == (2, is_split, False)


def test_unsplit_matches_are_expected_to_start_better_than_split_ones():
    """The priors (measured by replay) expect the first draft token after a
    match whose earlier continuations agreed to be right more often than
    after one whose continuations split, at every depth."""
    from hf2q_py.draft_length import AdaptiveK

    policy = AdaptiveK(32, SuffixProposer.profile)
    for depth in (1, 2, 3, 4, 8, 16, 32):
        for line_start in (False, True):
            unsplit = policy.acceptance.rates((depth, False, line_start))[0]
            assert unsplit > policy.acceptance.rates((depth, True, line_start))[0]


def test_the_draft_key_says_whether_the_drafts_start_a_line():
    """A copy resumed right after a line break is keyed apart (edits begin
    at line starts), wherever the break token sits in the vocabulary."""
    NL = 9
    p = SuffixProposer(line_breaks=frozenset({NL}))
    mid_line = [5, 6, 7, 1, 5, 6]
    line_start = [5, NL, 7, 1, 5, NL]
    p.start(None, mid_line, {}, None)
    assert p.draft_key(mid_line) == (2, False, False)
    p.start(None, line_start, {}, None)
    assert p.draft_key(line_start) == (2, False, True)
    assert SuffixProposer().draft_key(line_start) == (2, False, False)  # no line breaks declared


def test_an_unsplit_copy_is_expected_to_break_off_more_often_at_a_line_start():
    from hf2q_py.draft_length import AdaptiveK

    rates = AdaptiveK(32, SuffixProposer.profile).acceptance.rates
    for depth in (4, 8, 16, 32):
        assert rates((depth, False, True))[0] < rates((depth, False, False))[0]
        assert rates((depth, False, True))[1:] == rates((depth, False, False))[1:]


def test_no_match_no_drafts():
    p = SuffixProposer()
    p.start(None, [1, 2, 3], {}, None)
    assert p.draft_key([1, 2, 3]) == 0
    assert p.propose([1, 2, 3], 8).tokens == []


def test_a_rewritten_history_is_reindexed():
    p = SuffixProposer(SuffixOptions(min_prob=0.0))
    p.start(None, [1, 2, 1], {}, None)
    assert p.propose([1, 2, 1], 2).tokens == [2, 1]
    assert p.propose([5, 6, 5], 2).tokens == [6, 5]


def test_memory_drafts_a_retried_answer():
    memory = DraftMemory()
    answer = [50, 51, 52, 53, 54, 55, 56, 57]
    first = SuffixProposer(SuffixOptions(min_prob=0.0), memory)
    first.start(None, [1, 2, 3], {}, None)
    first.finish([1, 2, 3, *answer])
    assert list(memory.entries.values()) == [(1, 2, 3, *answer)]  # the prompt leads into the answer
    retry = SuffixProposer(SuffixOptions(min_prob=0.0, factor=1.0, offset=4), memory)
    ctx = [7, 1, 2, 3]  # the same prompt: drafts from its first token
    retry.start(None, ctx, {}, None)
    assert retry.draft_key(ctx) == (3, False, False)
    assert retry.propose(ctx, 16).tokens == answer[:7]  # a match of 3: up to 3 + 4
    ctx = [9, 50]  # another prompt: a match of 1 drafts up to 1 + 4
    retry.start(None, ctx, {}, None)
    assert retry.propose(ctx, 16).tokens == [51, 52, 53, 54, 55]
    assert retry.source_used == 1
    # drafts never run past the end of a remembered generation
    ctx = [1, 2, 3, *answer[:6]]
    retry.start(None, ctx, {}, None)
    assert retry.propose(ctx, 8).tokens == [56, 57]
    memory.clear()
    assert len(memory) == 0
    retry.start(None, [9, 50], {}, None)
    assert retry.propose([9, 50], 8).tokens == []


def test_memory_is_bounded_and_least_recently_used_evicting_in_bulk():
    memory = DraftMemory(max_tokens=10, max_entries=3)
    memory.add([1, 2, 3, 4])
    memory.add([5, 6, 7, 8])
    memory.add([1, 2, 3, 4])  # held already: now the most recent
    memory.add([9, 10, 11, 12])  # 12 tokens > 10: the least recent go, down to 3/4 of the bound
    assert list(memory.entries.values()) == [(9, 10, 11, 12)]
    assert len(memory) == 4
    memory.add([20, 21])
    memory.add([22])  # a fourth entry: over max_entries
    assert (1, 2, 3, 4) not in memory.entries.values()
    assert len(memory.entries) == 3
    # the rebuilt automaton holds exactly the kept entries
    sam = memory.sam
    assert sam.size == sum(len(t) + 1 for t in memory.entries.values())


def test_memory_touch_keeps_a_drafted_entry():
    memory = DraftMemory(max_tokens=7)
    memory.add([1, 2, 3])
    memory.add([4, 5, 6])
    p = SuffixProposer(SuffixOptions(min_prob=0.0), memory)
    p.start(None, [9, 1], {}, None)
    assert p.propose([9, 1], 4).tokens == [2, 3]
    memory.add([7, 8])  # 8 tokens > 7: the least recently used entry, [4, 5, 6], goes
    assert list(memory.entries.values()) == [(1, 2, 3), (7, 8)]


def test_bad_options_are_refused():
    with pytest.raises(Hf2qError, match="min-prob"):
        SuffixProposer(SuffixOptions(min_prob=1.5))
    with pytest.raises(Hf2qError, match="memory bounds"):
        DraftMemory(max_tokens=0)


# -- end to end on tiny random models -------------------------------------------------

from helpers import assert_same_greedy  # noqa: E402
from models import random_prompt, tiny_target  # noqa: E402

import hf2q_py  # noqa: E402
from hf2q_py.method_spec import parse_method  # noqa: E402


@pytest.mark.parametrize("arch, scale", [("llama", 1.0), ("llama", 2.0), ("gemma4_text", 1.5)])
def test_suffix_ngram_is_lossless_and_a_retry_drafts_from_memory(arch, scale):
    target = tiny_target(arch, scale=scale)
    prompt = random_prompt(30, 4)
    want = hf2q_py.generate(target, prompt, max_tokens=60, method="baseline").tokens
    first = hf2q_py.generate(target, prompt, max_tokens=60, method="ngram", k=16)
    assert_same_greedy(target.model, prompt, first.tokens, want)
    assert len(target.memory) == len(first.tokens) + 30  # with the prompt leading into it
    retry = hf2q_py.generate(target, prompt, max_tokens=60, method="ngram", k=16)
    assert retry.tokens == first.tokens
    assert retry.stats.accepted >= first.stats.accepted
    assert retry.stats.mean_accepted_length > 3  # the earlier answer is drafted


def test_memory_off_neither_reads_nor_writes_it():
    target = tiny_target("llama")
    prompt = random_prompt(30, 5)
    plain = hf2q_py.generate(target, prompt, max_tokens=40, method="baseline").tokens
    got = hf2q_py.generate(target, prompt, max_tokens=40, method="ngram", memory=False)
    assert got.tokens == plain
    assert len(target.memory) == 0
    hf2q_py.generate(target, prompt, max_tokens=40, method="ngram")
    assert len(target.memory) == 30 + 40
    target.memory.clear()
    assert len(target.memory) == 0


def test_memory_belongs_to_its_target():
    a, b = tiny_target("llama"), tiny_target("llama")
    hf2q_py.generate(a, random_prompt(20, 6), max_tokens=20, method="ngram")
    assert len(a.memory) == 40 and len(b.memory) == 0


def test_the_lookup_proposer_stays_selectable():
    target = tiny_target("llama")
    prompt = (random_prompt(6, 3) * 6)[:30]
    want = hf2q_py.generate(target, prompt, max_tokens=40, method="baseline").tokens
    got = hf2q_py.generate(target, prompt, max_tokens=40, method="ngram", ngram_proposer="lookup")
    assert got.tokens == want
    assert len(target.memory) == 0  # only the suffix proposer remembers
    with pytest.raises(Hf2qError, match="n-gram proposer"):
        hf2q_py.generate(target, prompt, max_tokens=4, method="ngram", ngram_proposer="tree")


def test_bench_method_options_name_the_proposer_and_memory():
    m = parse_method("ngram:ngram_proposer=lookup,k=16,memory=0,suffix_min_prob=0.2")
    assert m.options == dict(method="ngram", ngram_proposer="lookup", k=16, memory=False, suffix_min_prob=0.2)
    with pytest.raises(Hf2qError, match="memory"):
        parse_method("ngram:memory=maybe")


def test_a_generation_ending_meanwhile_is_drafted_from_at_once():
    """Two generations interleaved on one Target: when one ends (the memory
    grows or is rebuilt), the other matches the new memory before drafting."""
    memory = DraftMemory(max_tokens=12)
    memory.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    p = SuffixProposer(SuffixOptions(min_prob=0.0), memory)
    ctx = [40, 41, 1, 2]
    p.start(None, ctx, {}, None)
    assert p.propose(ctx, 4).tokens == [3, 4, 5, 6]
    memory.add([30, 1, 2, 33, 34, 35])  # over 12 tokens: the first entry goes, the automaton is rebuilt
    assert p.draft_key(ctx) == (2, False, False)
    assert p.propose(ctx, 4).tokens == [33, 34, 35]
