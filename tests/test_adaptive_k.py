"""The draft method's draft length follows the draft model's confidence, and
its drafts come from copies of the context where the context matches deeply:
both stay lossless, and a copy costs no draft-model forward."""

import math

import mlx.core as mx
from dataclasses import replace

import pytest
from helpers import assert_same_greedy
from models import random_prompt, tiny_target

import hf2q_py
from hf2q_py.config import SpecConfig
from hf2q_py.draft_length import AdaptiveK, DraftProfile
from hf2q_py.errors import Hf2qError
from hf2q_py.methods import build_proposer
from hf2q_py.proposers.combined import MODEL_KEY, CombinedProposer
from hf2q_py.proposers.draft_model import DraftModelProposer
from hf2q_py.proposers.suffix import SuffixProposer
from hf2q_py.sampling import Greedy
from hf2q_py.stats import Round

PAIRS = [("llama", 2.0), ("qwen2", 1.5), ("gemma4_text", 1.5)]


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
    want = hf2q_py.generate(target, prompt, max_tokens=40).tokens
    for d in (draft, target):  # a weak draft and a perfect one
        r = hf2q_py.generate(
            target, prompt, max_tokens=40, method="draft", draft=d, k=6, adaptive=adaptive, **gate
        )
        assert_same_greedy(target.model, prompt, r.tokens, want)


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
    want = hf2q_py.generate(target, prompt, max_tokens=40).tokens
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
    assert proposer.draft_key(prompt) == ("copy", (4, False))
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
    assert plain.propose(prompt, 3).tokens == got.tokens


def test_the_copy_option_builds_a_combined_proposer_with_a_larger_cap():
    target = tiny_target("llama", seed=0, scale=2.0)
    draft = tiny_target("llama", seed=1, scale=2.0)
    proposer, policy = build_proposer(
        target, SpecConfig(method="draft", draft=draft, k=4, draft_suffix_depth=3)
    )
    assert isinstance(proposer, CombinedProposer) and proposer.model_k == 4 and proposer.min_depth == 3
    assert isinstance(policy, AdaptiveK) and policy.k_max >= 16 and policy.profile.split_drafting
    assert (
        policy.profile.draft_cost_priors[("copy", (4, False))] == 0.0 and 0 < policy.profile.draft_cost_priors[MODEL_KEY] <= 1
    )
    default, _ = build_proposer(target, SpecConfig(method="draft", draft=draft))
    assert isinstance(default, CombinedProposer) and default.min_depth == 4  # copies by default
    plain, _ = build_proposer(target, SpecConfig(method="draft", draft=draft, draft_suffix_depth=0))
    # without copies too, the draft model reads the prompt when it first drafts
    assert isinstance(plain, DraftModelProposer) and plain.lazy_prefill
    with pytest.raises(Hf2qError, match="draft-suffix-depth"):
        SpecConfig(method="draft", draft=draft, draft_suffix_depth=-1).validate()


def timed_round(k, accepted, verify_s, propose_s, key=None):
    return Round(
        k=k,
        drafted=k,
        accepted=accepted,
        key=key,
        cost_seconds=verify_s + propose_s,
        propose_seconds=propose_s,
        verify_seconds=verify_s,
    )


def test_split_drafting_charges_drafting_per_token_and_speculates_from_the_first_round():
    policy = AdaptiveK(8, DraftProfile(split_drafting=True, prior_rate=0.9, draft_cost_priors={None: 0.3}))
    assert policy.next_k() > 0  # no plain decode is needed to start
    # a draft model accepted every time; target forwards cost 1.0 s + 0.05 s per extra token,
    # drafting 0.1 s per token: more drafts keep paying, so K climbs to the cap
    for _ in range(20):
        k = policy.next_k()
        policy.update(timed_round(k, k, 1.0 + 0.05 * k, 0.1 * k))
    assert policy.next_k() == 8


def test_split_drafting_drafts_less_when_drafting_is_dear():
    ks = {}
    for per_token in (0.05, 0.6):
        policy = AdaptiveK(8, DraftProfile(split_drafting=True, key_priors={"x": 0.7}))
        policy.update(Round(cost_seconds=1.0))  # a plain decode: 1 s
        policy.update(timed_round(4, 4, 1.2, per_token * 4))  # a verify of 5 tokens: 1.2 s
        assert policy.cost_model.draft_cost() == pytest.approx(per_token)
        ks[per_token] = policy.next_k("x")  # drafts right 70% of the time
    assert ks[0.05] > ks[0.6] >= 1


def real_pair_round(k: int, accepted: int) -> Round:
    """A round of the Qwen2.5-Coder 1.5B/0.5B pair on this CPU: target forwards of
    1/5/9 tokens take 0.65/1.19/1.39 s, a draft step 0.2 s."""
    verify_s = 0.65 + 0.135 * min(k, 4) + 0.05 * max(k - 4, 0)
    return timed_round(k, accepted, verify_s, 0.2 * k)


def test_one_late_rejection_does_not_pin_a_draft_models_k():
    # a draft model right 95% of the time; its first probe at K=2 loses the second draft
    proposer = DraftModelProposer(draft=None, cost=0.3)
    policy = AdaptiveK(8, proposer.profile)
    policy.update(real_pair_round(2, 1))
    ks = []
    for i in range(30):
        k = policy.next_k()
        ks.append(k)
        policy.update(real_pair_round(k, k if i % 20 else k - 1))
    # after the rejection K does not stay at 1: measured costs make long drafts pay
    assert max(ks[:10]) >= 4 and ks[-1] >= 6, ks


def test_draft_positions_share_one_rate_for_geometric_keys_only():
    policy = AdaptiveK(8, DraftProfile(geometric_keys=frozenset({"model"})))
    policy.observe(2, 1, "model")  # first accepted, second rejected
    policy.observe(2, 1, "copy")
    assert len(set(policy.acceptance.rates("model"))) == 1
    assert policy.acceptance.rates("copy")[1] < policy.acceptance.rates("copy")[0]


def test_a_draft_models_catch_up_on_the_prompt_is_not_charged_as_drafting_cost():
    # the combined proposer's first model round reads the 221-token prompt lazily:
    # 2.5 s of proposing for two drafts. Charged per draft token (1.4 decodes each),
    # it priced the draft model out for the rest of the generation (traced on the real pair)
    target = tiny_target("llama", seed=0, scale=2.0)
    _, policy = build_proposer(target, SpecConfig(method="draft", draft=tiny_target("llama", seed=1)))
    priors = {**policy.profile.draft_cost_priors, MODEL_KEY: 0.3}  # a draft model a third of the target's size
    policy = AdaptiveK(policy.k_max, replace(policy.profile, draft_cost_priors=priors))
    policy.update(Round(cost_seconds=0.87))  # a plain decode
    first = timed_round(2, 2, 1.08, 2.5, key=MODEL_KEY)
    first.catch_up = 221
    policy.update(first)
    assert policy.cost_model.draft_cost(MODEL_KEY) == 0.3  # still the prior
    assert policy.next_k(MODEL_KEY) >= 2
    routine = timed_round(4, 4, 1.2, 0.8, key=MODEL_KEY)
    routine.catch_up = 2  # the bonus token and the last draft: a routine round is a sample
    policy.update(routine)
    assert policy.cost_model.draft_cost(MODEL_KEY) == pytest.approx(0.8 / 4 / 0.87)


def test_a_draft_model_reports_the_tokens_it_caught_up_on():
    draft = tiny_target("llama", seed=1, scale=2.0)
    proposer = DraftModelProposer(draft, lazy_prefill=True)
    prompt = list(range(5, 30))
    proposer.start(None, prompt, {}, Greedy())
    first = proposer.propose(prompt, 3)
    assert first.catch_up == len(prompt)  # the lazy prefill
    after = prompt + first.tokens + [7]  # every draft accepted, then the bonus token
    assert proposer.propose(after, 3).catch_up == 2  # the last draft (never fed) and the bonus token


def test_drafts_made_during_a_decode_are_not_a_sample_of_drafting_cost():
    # traced on the built-in model drafting for itself: a probe drafted during a decode
    # (timed with that decode) and verified next round with no drafting time of its own
    # read as free drafting, and the next round drafted 8 tokens at the full price
    policy = AdaptiveK(8, DraftProfile(split_drafting=True, draft_cost_priors={None: 1.0}))
    policy.update(Round(cost_seconds=0.08))
    policy.update(Round(k=2, drafted=1, accepted=1, cost_seconds=0.09, verify_seconds=0.09, predrafted=True))
    assert policy.cost_model.draft_cost() == 1.0
    assert policy.next_k() == 0  # a draft as dear as the target never pays


def test_drafting_during_a_decode_is_not_charged_as_a_pipeline_break():
    policy = AdaptiveK(8)
    for _ in range(5):
        policy.update(Round(cost_seconds=0.08))  # pipelined decodes
    policy.update(Round(cost_seconds=0.30, propose_seconds=0.22, chain_end=True))  # drafts made meanwhile
    policy.update(Round(cost_seconds=0.08, restarted=True))
    policy.update(Round(cost_seconds=0.08))
    policy.update(Round(k=2, drafted=2, accepted=2, cost_seconds=0.1, verify_seconds=0.1))
    assert policy.cost_model.restart_cost() < 0.05


def test_drafting_during_a_decode_is_what_a_probe_costs():
    policy = AdaptiveK(8)
    for _ in range(5):
        policy.update(Round(cost_seconds=0.08))
    policy.update(Round(cost_seconds=0.30, propose_seconds=0.16, chain_end=True))
    assert policy.cost_model.excess() == pytest.approx(0.16 / 0.08)
