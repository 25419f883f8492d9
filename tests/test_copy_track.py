"""Copies followed through edits (``CopyTrack``): after a rename the drafts
resume where the copy left off in its source, instead of waiting for a
fresh deep match."""

from hf2q_py.memory import DraftMemory
from hf2q_py.proposers.copy_track import MAX_GAP, CopyTrack
from hf2q_py.proposers.suffix import RESUME, SuffixOptions, SuffixProposer

SOURCE = list(range(100, 140))  # 40 tokens of a file, none repeated
PROMPT = [1, 2, *SOURCE, 3, 4]  # the file in the context, then the request


def proposer(memory=None):
    p = SuffixProposer(SuffixOptions(min_prob=0.0), memory)
    return p


def copy_then(p, prompt, copied, edit):
    """Generate ``copied`` (drafting each round as the engine would), then ``edit``."""
    tokens = list(prompt)
    p.start(None, tokens, {}, None)
    for t in copied:
        p.draft_key(tokens)
        p.propose(tokens, 8)
        tokens.append(t)
    p.draft_key(tokens)
    p.propose(tokens, 8)
    tokens += edit
    return tokens


def test_a_same_length_rename_resumes_the_copy_right_after_it():
    p = proposer()
    tokens = copy_then(p, PROMPT, SOURCE[:10], [999])  # SOURCE[10] renamed to 999
    assert p.draft_key(tokens) == (RESUME, 0)
    assert p.propose(tokens, 8).tokens == SOURCE[11:19]
    tokens += SOURCE[11:14]  # the target agreed: the copy runs on from there
    assert p.draft_key(tokens) == (RESUME, 3)
    assert p.propose(tokens, 4).tokens == SOURCE[14:18]


def test_without_following_the_copy_the_automaton_has_nothing_to_draft_after_a_rename():
    p = proposer()
    tokens = copy_then(p, PROMPT, SOURCE[:10], [999])
    p.copy = None
    assert p.draft_key(tokens) == 0 and p.propose(tokens, 8).tokens == []


def test_an_edit_that_writes_more_tokens_than_it_replaced_resyncs_on_the_source():
    p = proposer()
    tokens = copy_then(p, PROMPT, SOURCE[:10], [998, 999])  # one token replaced by two
    assert p.propose(tokens, 4).tokens == SOURCE[12:16]  # the same-length guess: off by one
    tokens.append(SOURCE[11])  # the copy goes on where it left off
    assert p.draft_key(tokens) == (RESUME, 1)
    assert p.propose(tokens, 4).tokens == SOURCE[12:16]


def test_an_edit_that_drops_tokens_resyncs_further_on():
    p = proposer()
    tokens = copy_then(p, PROMPT, SOURCE[:10], [SOURCE[14]])  # SOURCE[10:14] left out
    assert p.propose(tokens, 4).tokens == SOURCE[15:19]


def test_a_match_reaching_back_before_the_edit_drafts_from_the_automaton():
    """The edited text occurred earlier (say in the model's own earlier
    answer): the automaton's match spans the edit and knows better."""
    edited = [*SOURCE[:10], 999, 500, 501, 502]
    p = proposer()
    tokens = copy_then(p, [*PROMPT, *edited, 5], SOURCE[:10], [999])
    assert p.draft_key(tokens)[0] != RESUME
    assert p.propose(tokens, 3).tokens == [500, 501, 502]


def test_drafts_stop_resuming_once_the_copy_runs_again_deeply():
    p = proposer()
    tokens = copy_then(p, PROMPT, SOURCE[:10], [999])
    tokens += SOURCE[11 : 11 + MAX_GAP]
    assert p.draft_key(tokens)[0] != RESUME  # the automaton's match is deep again
    assert p.propose(tokens, 4).tokens == SOURCE[11 + MAX_GAP : 15 + MAX_GAP]


def test_a_copy_from_the_memory_resumes_after_a_rename():
    memory = DraftMemory()
    memory.add(SOURCE)  # a quoted view, or an earlier answer
    p = proposer(memory)
    tokens = copy_then(p, [7, 8, 9], SOURCE[:10], [999])
    assert p.draft_key(tokens) == (RESUME, 0)
    assert p.propose(tokens, 8).tokens == SOURCE[11:19]
    assert p.source_used == 1


def test_a_resumed_draft_ends_with_its_remembered_entry():
    memory = DraftMemory()
    memory.add(SOURCE[:14])
    p = proposer(memory)
    tokens = copy_then(p, [7, 8, 9], SOURCE[:10], [999])
    assert p.propose(tokens, 8).tokens == SOURCE[11:14]


def test_a_copy_is_given_up_after_too_many_disagreements():
    track = CopyTrack(SOURCE, 0, 0, 8)
    track.advance([*SOURCE[:8], *range(900, 910)])
    assert not track.resumes(0, 18)
    assert track.drafts(2) == SOURCE[18:20]  # its place moved on, but it no longer drafts
