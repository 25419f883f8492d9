"""Copies followed through edits (``CopyTrack``): after a rename, once a
token confirms where the copy stands in its source, drafts resume from
there instead of from a shallow match elsewhere."""

from hf2q_py.memory import DraftMemory
from hf2q_py.proposers.copy_track import MAX_GAP, MAX_MISS, CopyTrack
from hf2q_py.proposers.suffix import RESUME, SuffixOptions, SuffixProposer

SOURCE = list(range(100, 140))  # 40 tokens of a file, none repeated
#: The file in the context, then the request, which also holds SOURCE[11] followed by other tokens
#: (as a request naming the new name does): a shallow match after the edit drafts those.
PROMPT = [1, 2, *SOURCE, 3, SOURCE[11], 77, 78, 79, 4]


def proposer(memory=None, resume=True):
    return SuffixProposer(SuffixOptions(min_prob=0.0, resume=resume), memory)


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


def test_a_same_length_rename_resumes_the_copy_once_a_token_confirms_it():
    p = proposer()
    tokens = copy_then(p, PROMPT, SOURCE[:10], [999])  # SOURCE[10] renamed to 999
    assert p.draft_key(tokens) == 0  # nothing confirms the guess yet, and nothing else matches
    tokens.append(SOURCE[11])  # as the same-length guess expects
    assert p.draft_key(tokens) == (RESUME, 1)
    assert p.propose(tokens, 8).tokens == SOURCE[12:20]
    tokens += SOURCE[12:14]
    assert p.propose(tokens, 4).tokens == SOURCE[14:18]


def test_without_following_the_copy_a_shallow_match_elsewhere_drafts_after_a_rename():
    p = proposer(resume=False)
    tokens = copy_then(p, PROMPT, SOURCE[:10], [999, SOURCE[11]])
    assert p.propose(tokens, 3).tokens == [77, 78, 79]  # the request's, the latest of two


def test_an_edit_that_writes_more_tokens_than_it_replaced_resyncs_on_the_source():
    p = proposer()
    tokens = copy_then(p, PROMPT, SOURCE[:10], [998, 999])  # one token replaced by two
    assert p.draft_key(tokens) == 0
    tokens.append(SOURCE[11])  # the copy goes on where it left off
    assert p.draft_key(tokens) == (RESUME, 1)
    assert p.propose(tokens, 4).tokens == SOURCE[12:16]


def test_an_edit_that_drops_tokens_resyncs_further_on():
    p = proposer()
    tokens = copy_then(p, PROMPT, SOURCE[:10], [SOURCE[14]])  # SOURCE[10:14] left out
    assert p.draft_key(tokens) == (RESUME, 1)
    assert p.propose(tokens, 4).tokens == SOURCE[15:19]


def test_a_match_reaching_back_before_the_edit_drafts_from_the_automaton():
    """The edited text occurred earlier (say in the model's own earlier
    answer): the automaton's match spans the edit and knows better."""
    edited = [*SOURCE[:10], 999, SOURCE[11], 500, 501, 502]
    p = proposer()
    tokens = copy_then(p, [*PROMPT, *edited, 5], SOURCE[:10], [999, SOURCE[11]])
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
    memory.add([SOURCE[11], 77, 78, 79])
    p = proposer(memory)
    tokens = copy_then(p, [7, 8, 9], SOURCE[:10], [999, SOURCE[11]])
    assert p.draft_key(tokens) == (RESUME, 1)
    assert p.propose(tokens, 8).tokens == SOURCE[12:20]
    assert p.source_used == 1


def test_a_resumed_draft_ends_with_its_remembered_entry():
    memory = DraftMemory()
    memory.add(SOURCE[:14])
    p = proposer(memory)
    tokens = copy_then(p, [7, 8, 9], SOURCE[:10], [999, SOURCE[11]])
    assert p.propose(tokens, 8).tokens == SOURCE[12:14]


def test_a_copy_is_given_up_after_too_many_disagreements():
    track = CopyTrack(SOURCE, 0, 0, 8)
    track.advance([*SOURCE[:8], *range(900, 900 + MAX_MISS)])
    assert track.ran == 0
    track.advance([*SOURCE[:8], *range(900, 900 + MAX_MISS), SOURCE[8 + MAX_MISS]])  # a chance agreement
    assert not track.resumes(0, 8 + MAX_MISS + 1)
