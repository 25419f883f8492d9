"""The adaptive draft length (``AdaptiveK``): K has a documented maximum and is
chosen fast even there, acceptance estimates follow their definition, and
drafting is charged for what it costs: per draft token when drafting is timed
apart, never for a draft model's catch-up on the prompt nor for drafts made
during a decode."""

import time
from dataclasses import replace

import pytest
from models import tiny_target

from hf2q_py.config import SpecConfig
from hf2q_py.draft_length import MAX_K, AdaptiveK, DraftProfile, validate_k
from hf2q_py.errors import Hf2qError
from hf2q_py.methods import build_proposer
from hf2q_py.proposers.combined import MODEL_KEY
from hf2q_py.proposers.draft_model import DraftModelProposer
from hf2q_py.stats import Round


def test_k_has_a_documented_maximum():
    validate_k(MAX_K)
    for bad in (0, MAX_K + 1, 10**6, True, 2.0, "3"):
        with pytest.raises(Hf2qError, match="k"):
            validate_k(bad)


def test_choosing_k_at_the_maximum_is_fast():
    """It was cubic in K (6.4 s per round at k=512, a RecursionError near 990)."""
    policy = AdaptiveK(MAX_K)
    policy.update(Round(cost_seconds=0.01))
    for _ in range(20):
        policy.update(Round(drafted=MAX_K, accepted=MAX_K - 1, cost_seconds=0.02))
    t0 = time.perf_counter()
    for _ in range(50):
        k = policy.next_k()
    assert time.perf_counter() - t0 < 1.0
    assert 1 <= k <= MAX_K


def reference_rate(policy, i, key=None):
    """The conditional acceptance estimate as defined (recursively)."""
    prior = (
        policy.profile.prior_rate
        if i == 0 or policy.acceptance.tried[i] >= 0.5
        else reference_rate(policy, i - 1)
    )
    pooled = (policy.acceptance.hits[i] + prior * policy.acceptance.prior_weight) / (
        policy.acceptance.tried[i] + policy.acceptance.prior_weight
    )
    if key is None or key not in policy.acceptance.keyed:
        return pooled
    tried, hits = policy.acceptance.keyed[key]
    return (hits[i] + pooled * policy.acceptance.key_weight) / (tried[i] + policy.acceptance.key_weight)


def test_adaptive_rates_match_their_definition():
    policy = AdaptiveK(12)
    for drafted, accepted, key in [(12, 3, "a"), (4, 4, "b"), (8, 0, None), (2, 1, "a")]:
        policy.update(Round(drafted=drafted, accepted=accepted, key=key, cost_seconds=0.01))
    for key in (None, "a", "b", "never seen"):
        assert policy.acceptance.rates(key) == pytest.approx(
            [reference_rate(policy, i, key) for i in range(12)]
        )


def test_draft_positions_share_one_rate_for_geometric_keys_only():
    policy = AdaptiveK(8, DraftProfile(geometric_keys=frozenset({"model"})))
    policy.observe(2, 1, "model")  # first accepted, second rejected
    policy.observe(2, 1, "copy")
    assert len(set(policy.acceptance.rates("model"))) == 1
    assert policy.acceptance.rates("copy")[1] < policy.acceptance.rates("copy")[0]


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


def test_a_draft_models_catch_up_on_the_prompt_is_not_charged_as_drafting_cost():
    # the combined proposer's first model round reads the 221-token prompt lazily:
    # 2.5 s of proposing for two drafts. Charged per draft token (1.4 decodes each),
    # it priced the draft model out for the rest of the generation (traced on the real pair)
    target = tiny_target("llama", seed=0, scale=2.0)
    _, policy = build_proposer(target, SpecConfig(method="draft", draft=tiny_target("llama", seed=1)))
    priors = {
        **policy.profile.draft_cost_priors,
        MODEL_KEY: 0.3,
    }  # a draft model a third of the target's size
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
