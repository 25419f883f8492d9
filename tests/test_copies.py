"""The draft method's copies (``draft_suffix_depth``): where the context matches
deeply, the draft is copied from it without a draft-model forward; elsewhere the
draft model drafts, reading the context lazily; together they stay lossless."""

import pytest
from helpers import assert_same_greedy
from models import PAIRS, random_prompt, tiny_target

import hf2q_py
from hf2q_py.config import SpecConfig
from hf2q_py.draft_length import AdaptiveK
from hf2q_py.errors import Hf2qError
from hf2q_py.methods import build_proposer
from hf2q_py.proposers.combined import MODEL_KEY, CombinedProposer
from hf2q_py.proposers.draft_model import DraftModelProposer
from hf2q_py.proposers.suffix import SuffixProposer
from hf2q_py.sampling import Greedy


def repeating_prompt(n=12):
    """A random block, then its first half again: the context matches deeply."""
    block = random_prompt(n)
    return block + block[: n // 2]


@pytest.mark.parametrize("arch, scale", PAIRS)
@pytest.mark.parametrize("adaptive", [False, True])
def test_copies_and_model_drafts_together_are_lossless(arch, scale, adaptive):
    target = tiny_target(arch, seed=0, scale=scale)
    draft = tiny_target(arch, seed=1, scale=scale)
    prompt = repeating_prompt()
    want = hf2q_py.generate(target, prompt, max_tokens=40, method="baseline").tokens
    r = hf2q_py.generate(
        target,
        prompt,
        max_tokens=40,
        method="draft",
        draft=draft,
        k=4,
        adaptive=adaptive,
        draft_suffix_depth=2,
        memory=False,
    )
    assert_same_greedy(target.model, prompt, r.tokens, want)
    assert r.stats.drafted > 0


def combined(draft, min_depth=4, k=4):
    model = DraftModelProposer(draft, lazy_prefill=True)
    return CombinedProposer(model, SuffixProposer(), min_depth, model_k=k)


def test_a_deep_match_is_copied_without_running_the_draft_model():
    draft = tiny_target("llama", seed=1, scale=2.0)
    prompt = repeating_prompt()  # the last 6 tokens occurred before, followed by the block's second half
    proposer = combined(draft)
    proposer.start(None, prompt, {}, Greedy())
    assert proposer.draft_key(prompt) == ("copy", (4, False, False))
    got = proposer.propose(prompt, 16)
    assert got.tokens == prompt[6 : 6 + len(got)] and len(got) >= 4
    assert got.probs is None  # a copy is a point mass
    assert proposer.model.rt.offset == 0  # the draft model has not even read the prompt


def test_a_shallow_match_drafts_with_the_model_after_one_catch_up():
    draft = tiny_target("llama", seed=1, scale=2.0)
    prompt = random_prompt(12)
    proposer = combined(draft, min_depth=4, k=3)
    proposer.start(None, prompt, {}, Greedy())
    assert proposer.draft_key(prompt) == MODEL_KEY
    got = proposer.propose(prompt, 16)
    assert len(got) == 3  # the model's own cap, not the engine's K
    assert proposer.model.cached[: len(prompt)] == prompt  # the whole context, read once, lazily
    plain = DraftModelProposer(draft)
    plain.start(None, prompt, {}, Greedy())
    assert plain.propose(prompt, 3).ids() == got.ids()


def test_the_copy_option_builds_a_combined_proposer_with_a_larger_cap():
    target = tiny_target("llama", seed=0, scale=2.0)
    draft = tiny_target("llama", seed=1, scale=2.0)
    proposer, policy = build_proposer(
        target, SpecConfig(method="draft", draft=draft, k=4, draft_suffix_depth=3)
    )
    assert isinstance(proposer, CombinedProposer) and proposer.model_k == 4 and proposer.min_depth == 3
    assert isinstance(policy, AdaptiveK) and policy.k_max >= 16 and policy.profile.split_drafting
    assert (
        policy.profile.draft_cost_priors[("copy", (4, False, False))] == 0.0
        and 0 < policy.profile.draft_cost_priors[MODEL_KEY] <= 1
    )
    default, _ = build_proposer(target, SpecConfig(method="draft", draft=draft))
    assert isinstance(default, CombinedProposer) and default.min_depth == 4  # copies by default
    plain, _ = build_proposer(target, SpecConfig(method="draft", draft=draft, draft_suffix_depth=0))
    # without copies too, the draft model reads the prompt when it first drafts
    assert isinstance(plain, DraftModelProposer) and plain.lazy_prefill
    with pytest.raises(Hf2qError, match="draft-suffix-depth"):
        SpecConfig(method="draft", draft=draft, draft_suffix_depth=-1).validate()
