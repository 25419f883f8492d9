"""The draft-model proposer: lossless whatever the draft model, the target as its
own draft accepts everything, a draft ends where the draft model is unsure, its
cache holds only the drafts it kept, and draft models that cannot serve the
target are refused (or, for a target's padding ids, drafting goes on)."""

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import UNGATED, assert_same_greedy, baseline, reference_greedy
from models import PAIRS, VOCAB, random_prompt, tiny_target

import hf2q_py
from hf2q_py.errors import Hf2qError
from hf2q_py.proposers.draft_model import DraftModelProposer
from hf2q_py.sampling import Greedy

# (target arch, scale): repetitive and varied models; gemma4 runs far past its window of 16.
TARGETS = [("llama", 1.0), ("llama", 2.0), ("qwen2", 1.5), ("gemma4_text", 1.5)]


@pytest.mark.parametrize("arch, scale", TARGETS)
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_a_different_random_draft_model_is_lossless(arch, scale, k):
    target = tiny_target(arch, seed=0, scale=scale)
    draft = tiny_target(arch, seed=1, scale=scale)  # low acceptance
    prompt = random_prompt(12)
    want = baseline(target, prompt, 48)
    r = hf2q_py.generate(
        target,
        prompt,
        max_tokens=48,
        method="draft",
        draft=draft,
        k=k,
        adaptive=False,
        **UNGATED,
    )
    assert_same_greedy(target.model, prompt, r.tokens, want)
    assert r.stats.drafted > 0


@pytest.mark.parametrize("arch, scale", TARGETS)
@pytest.mark.parametrize("k", [1, 4, 8])
def test_the_target_as_its_own_draft_accepts_everything(arch, scale, k):
    target = tiny_target(arch, scale=scale)
    prompt = random_prompt(12)
    want = baseline(target, prompt, 48)
    r = hf2q_py.generate(
        target,
        prompt,
        max_tokens=48,
        method="draft",
        draft=target,
        k=k,
        adaptive=False,
        **UNGATED,
        draft_suffix_depth=0,
    )
    assert_same_greedy(target.model, prompt, r.tokens, want)
    # all drafts accepted (bar numerical near-ties between batched and single-token forwards)
    assert r.stats.acceptance_rate > 0.9
    assert r.stats.mean_accepted_length > 1 + 0.9 * k * 0.8


@pytest.mark.parametrize(
    "arch, scale, seed", [("gemma4_text", 1.0, 0), ("gemma4", 1.0, 3), ("gpt_oss", 1.5, 3)]
)
def test_eos_and_budget_inside_a_draft_block(arch, scale, seed):
    target = tiny_target(arch, scale=scale)
    prompt = random_prompt(10, seed=seed)
    free = reference_greedy(target.model, prompt, 40)
    i = next(i for i in range(3, 40) if free[i] not in free[:i])
    for n in (1, 5, 9, 17):
        r = hf2q_py.generate(target, prompt, max_tokens=n, method="draft", draft=target, k=8, adaptive=False)
        assert r.tokens == free[:n]
    target.eos_token_ids = {free[i]}
    r = hf2q_py.generate(target, prompt, max_tokens=40, method="draft", draft=target, k=8, adaptive=False)
    assert r.tokens == free[:i] and r.stats.finish_reason == "stop"


def test_draft_p_min_drafts_less_and_stays_lossless():
    target = tiny_target("llama", scale=2.0)
    draft = tiny_target("llama", seed=1, scale=2.0)
    prompt = random_prompt(12)
    want = baseline(target, prompt, 40)
    free = hf2q_py.generate(
        target,
        prompt,
        max_tokens=40,
        method="draft",
        draft=draft,
        k=6,
        adaptive=False,
        **UNGATED,
    )
    gated = hf2q_py.generate(
        target, prompt, max_tokens=40, method="draft", draft=draft, k=6, adaptive=False, draft_p_min=0.3
    )
    assert_same_greedy(target.model, prompt, gated.tokens, want)
    assert gated.stats.drafted < free.stats.drafted


def confidences(model, tokens):
    """The draft model's top probability after every prefix of ``tokens`` (one full forward)."""
    logits = model(mx.array([tokens]))[0].astype(mx.float32)
    return mx.softmax(logits, axis=-1).max(axis=-1).tolist()


@pytest.mark.parametrize("p_min", [0.05, 0.2, 0.5])
def test_a_draft_ends_before_the_first_token_the_draft_is_unsure_of(p_min):
    draft = tiny_target("llama", seed=1, scale=2.0)
    prompt = random_prompt(10)
    proposer = DraftModelProposer(draft, p_min=p_min)
    proposer.start(None, prompt, {}, Greedy())
    got = proposer.propose(prompt, 8).tokens
    conf = confidences(draft.model, prompt + got)[len(prompt) - 1 :]
    # every kept draft was at least p_min likely to the draft, and the next one was not
    assert all(c >= p_min for c in conf[: len(got)])
    if len(got) < 8:
        assert conf[len(got)] < p_min
    assert proposer.confidence == pytest.approx(conf[: len(got)], abs=1e-4)


def own_probabilities(model, tokens):
    """The draft model's probability of each next token of ``tokens`` (one full forward)."""
    logits = model(mx.array([tokens]))[0].astype(mx.float32)
    probs = mx.softmax(logits[:-1], axis=-1)
    return mx.take_along_axis(probs, mx.array(tokens[1:])[:, None], axis=-1)[:, 0].tolist()


@pytest.mark.parametrize("min_prob", [0.05, 0.3, 0.7])
def test_a_draft_ends_at_the_token_where_its_probability_of_acceptance_falls_below_min_prob(min_prob):
    draft = tiny_target("llama", seed=1, scale=2.0)
    prompt = random_prompt(10)
    proposer = DraftModelProposer(draft, min_prob=min_prob)
    proposer.start(None, prompt, {}, Greedy())
    got = proposer.propose(prompt, 8).tokens
    assert got  # the first token is always kept
    own = own_probabilities(draft.model, prompt + got)[len(prompt) - 1 :]
    whole = [math.prod(own[: i + 1]) for i in range(len(got))]
    # every token before the last kept one left the draft at least min_prob likely;
    # a draft cut short ended at the token that took it below
    assert all(w >= min_prob for w in whole[:-1])
    if len(got) < 8:
        assert whole[-1] < min_prob
    assert proposer.rt.offset == len(proposer.cached)


def test_a_sure_draft_model_drafts_the_whole_k():
    target = tiny_target("llama", seed=0, scale=2.0)
    prompt = random_prompt(10)
    proposer = DraftModelProposer(target, min_prob=1e-9)  # any draft is likelier than this
    proposer.start(None, prompt, {}, Greedy())
    assert len(proposer.propose(prompt, 8).tokens) == 8


def test_the_draft_cache_holds_the_kept_drafts_only():
    draft = tiny_target("llama", seed=1, scale=2.0)
    prompt = random_prompt(10)
    proposer = DraftModelProposer(draft, p_min=0.2)
    proposer.start(None, prompt, {}, Greedy())
    got = proposer.propose(prompt, 8).tokens
    assert proposer.rt.offset == len(proposer.cached) <= len(prompt) + len(got)
    assert proposer.cached == (prompt + got)[: len(proposer.cached)]


@pytest.mark.parametrize("arch, scale", PAIRS)
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("gate", [dict(draft_p_min=0.1), dict(draft_min_prob=0.5)])
def test_confidence_gated_drafts_are_lossless(arch, scale, adaptive, gate):
    target = tiny_target(arch, seed=0, scale=scale)
    draft = tiny_target(arch, seed=1, scale=scale)
    prompt = random_prompt(12)
    want = hf2q_py.generate(target, prompt, max_tokens=40, method="baseline").tokens
    for d in (draft, target):  # a weak draft and a perfect one
        r = hf2q_py.generate(
            target, prompt, max_tokens=40, method="draft", draft=d, k=6, adaptive=adaptive, **gate
        )
        assert_same_greedy(target.model, prompt, r.tokens, want)


def test_a_draft_model_reports_the_tokens_it_caught_up_on():
    draft = tiny_target("llama", seed=1, scale=2.0)
    proposer = DraftModelProposer(draft, lazy_prefill=True)
    prompt = list(range(5, 30))
    proposer.start(None, prompt, {}, Greedy())
    first = proposer.propose(prompt, 3)
    assert first.catch_up == len(prompt)  # the lazy prefill
    after = prompt + first.ids() + [7]  # every draft accepted, then the bonus token
    proposer.update(after, 3, 3, {})
    assert proposer.propose(after, 3).catch_up == 2  # the last draft (never fed) and the bonus token


def test_lazy_drafts_stay_in_the_draft_cache_as_far_as_the_target_accepted_them():
    draft = tiny_target("llama", seed=1, scale=2.0)
    proposer = DraftModelProposer(draft, lazy_prefill=True)
    prompt = list(range(5, 30))
    proposer.start(None, prompt, {}, Greedy())
    drafts = proposer.propose(prompt, 4).ids()
    after = prompt + drafts[:2] + [(drafts[2] + 1) % 128]  # two accepted, the third rejected
    proposer.update(after, 4, 2, {})
    assert proposer.cached == prompt + drafts[:2] and proposer.rt.offset == len(prompt) + 2
    assert proposer.propose(after, 3).catch_up == 1  # only the token the target chose


def test_draft_method_needs_a_draft_model():
    with pytest.raises(Hf2qError, match="draft model"):
        hf2q_py.generate(tiny_target("llama"), [1, 2], max_tokens=4, method="draft")


def test_a_draft_model_with_another_vocabulary_is_refused():
    from models import CONFIGS, tiny_model

    from hf2q_py.target import Target

    target = tiny_target("llama")
    CONFIGS["llama_big_vocab"] = dict(CONFIGS["llama"], vocab_size=256)
    try:
        big = Target.from_mlx_lm(tiny_model("llama_big_vocab"))
    finally:
        del CONFIGS["llama_big_vocab"]
    with pytest.raises(Hf2qError, match="vocabulary"):
        hf2q_py.generate(target, [1, 2, 3], max_tokens=4, method="draft", draft=big)


def test_a_draft_smaller_than_the_tokenizer_is_refused():
    target = tiny_target("llama", tokenizer=True)
    draft = tiny_target("llama", seed=1, tokenizer=True, vocab_size=100)  # tokenizer ids go to 127
    with pytest.raises(
        Hf2qError, match=r"draft model's vocabulary \(100\) is smaller than its tokenizer's \(128"
    ):
        hf2q_py.generate(target, "abc", max_tokens=4, method="draft", draft=draft)


def test_target_padding_ids_never_index_past_the_draft_embedding():
    """A target with a padded vocabulary (160 rows, tokenizer 128) may emit ids
    the draft has no row for: drafting goes on, output equals plain decoding."""
    target = tiny_target("llama", scale=3.0, tokenizer=True, vocab_size=160)
    target.eos_token_ids = set()
    draft = tiny_target("llama", seed=1, scale=3.0, tokenizer=True)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 128, 12)]
    want = hf2q_py.generate(target, prompt, max_tokens=40, method="baseline").tokens
    assert max(want) >= VOCAB  # the case under test: ids past the draft's table
    got = hf2q_py.generate(
        target,
        prompt,
        max_tokens=40,
        method="draft",
        draft=draft,
        k=4,
        adaptive=False,
        **UNGATED,
    )
    assert got.tokens == want and got.stats.drafted > 0
