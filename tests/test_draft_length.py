"""Draft-length policies: a fixed K, and an adaptive K chosen from measured
acceptance and measured round cost (per draft key when the proposer has one)."""

import pytest

from hf2q_py.draft_length import AdaptiveK, DraftProfile, FixedK
from hf2q_py.errors import Hf2qError
from hf2q_py.stats import Round

DECODE_S = 0.1


def seconds(width: int) -> float:
    """A round feeding ``width`` tokens costs 1 + 0.1 per extra token, in decodes."""
    return DECODE_S * (1 + 0.1 * (width - 1))


def play(policy, accepted_of, rounds: int, key=None) -> list[int]:
    """Run rounds where ``accepted_of(k)`` drafts of k are accepted; returns each round's K."""
    ks = []
    for _ in range(rounds):
        k = policy.next_k(key)
        ks.append(k)
        n = accepted_of(k) if k else 0
        policy.update(Round(drafted=k, accepted=n, key=key, cost_seconds=seconds(k + 1)))
    return ks


def test_fixed_k_always_drafts_k():
    assert FixedK(5).next_k() == 5 == FixedK(5).next_k("any key")


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_k_below_one_is_refused(bad):
    with pytest.raises(Hf2qError):
        FixedK(bad)
    with pytest.raises(Hf2qError):
        AdaptiveK(bad)


def test_before_anything_is_timed_k_follows_the_prior_costs():
    """The first round may draft where the proposer knows something about
    its drafts (a key with a prior: a retried answer copies from its first
    token); how much follows from the prior rates and the prior costs.
    Drafts with nothing known about them wait for a timed plain decode."""
    priors = {"likely": 0.9, "unlikely": 0.05}
    assert (
        AdaptiveK(8, DraftProfile(key_priors=priors)).next_k("likely")
        == AdaptiveK(8, DraftProfile(key_priors=priors)).best_k("likely")
        > 0
    )
    assert AdaptiveK(8, DraftProfile(key_priors=priors)).next_k("unlikely") == 0
    assert AdaptiveK(8).next_k() == 0 < AdaptiveK(8).best_k()


def test_drafts_that_are_always_right_grow_to_k_max():
    policy = AdaptiveK(8)
    policy.update(Round(cost_seconds=seconds(1)))  # a timed pipelined decode
    ks = play(policy, lambda k: k, 30)
    assert ks[-1] == 8


def test_drafts_that_are_never_right_fall_back_to_plain_decoding_with_rare_probes():
    policy = AdaptiveK(8)
    ks = play(policy, lambda k: 0, 300)
    late = ks[100:]
    assert late.count(0) >= 0.97 * len(late)
    assert set(late) <= {0, policy.probes.probe_k}
    assert policy.probes.cooldown == policy.probes.max_cooldown  # failed probes back off


def test_drafts_that_could_not_pay_even_if_all_were_accepted_are_never_probed():
    """A draft model as dear as its target (one drafting for itself) decodes
    plainly throughout; a cheap one whose drafts fail is still probed."""
    dear = AdaptiveK(8, DraftProfile(split_drafting=True, prior_rate=0.95, draft_cost_priors={None: 1.0}))
    cheap = AdaptiveK(8, DraftProfile(split_drafting=True, prior_rate=0.95, draft_cost_priors={None: 0.1}))
    assert not dear.could_pay() and cheap.could_pay()
    assert set(play(dear, lambda k: 0, 300)) == {0}
    late = play(cheap, lambda k: 0, 300)[100:]
    assert 0 < sum(k > 0 for k in late) <= 0.03 * len(late)


def test_a_probe_never_drafts_more_than_k_max():
    policy = AdaptiveK(1)
    ks = play(policy, lambda k: 0, 200)
    assert max(ks) == 1 and ks.count(1) >= 2  # it probes, one draft at a time


def test_each_key_keeps_its_own_acceptance():
    policy = AdaptiveK(8)
    for _ in range(20):
        play(policy, lambda k: k, 1, key="deep copy")
        play(policy, lambda k: 0, 1, key="lone 1-gram")
    assert policy.next_k("deep copy") == 8
    assert policy.next_k("lone 1-gram") < 2


def test_a_new_key_starts_from_the_pooled_rates():
    policy = AdaptiveK(8)
    play(policy, lambda k: k, 20, key="seen")
    assert policy.next_k("unseen") == policy.next_k(None) == 8


def test_a_key_prior_sets_where_a_new_key_starts():
    """A proposer that knows its deep matches are usually right says so: that
    key starts with long drafts, an unknown key with the pooled guess."""
    policy = AdaptiveK(16, DraftProfile(key_priors={"deep": 0.97}))
    policy.update(Round(cost_seconds=seconds(1)))
    first = policy.next_k("deep")
    assert first >= 8
    assert policy.next_k("other") < first
    play(policy, lambda k: 0, 12, key="deep")  # then evidence wins
    assert policy.next_k("deep") <= first // 2


def test_a_measured_pipeline_restart_stands_weak_drafts_down():
    """Plain decodes are pipelined; a verify round breaks the pipeline, and
    what the decodes around the break cost beyond as many pipelined decodes
    is charged to drafting: a draft that saves less is not made, a strong
    one still is."""
    policy = AdaptiveK(16, DraftProfile(key_priors={"weak": 0.45, "strong": 0.95}))
    policy.update(Round(cost_seconds=DECODE_S))  # a pipelined decode
    assert policy.next_k("weak") > 0 and policy.cost_model.restart_cost() == 0.0
    policy.update(Round(drafted=1, accepted=0, key="other", cost_seconds=seconds(2)))
    policy.update(Round(cost_seconds=2.5 * DECODE_S, restarted=True))  # the restart ran two forwards
    policy.update(Round(cost_seconds=0.5 * DECODE_S))  # so the next decode had little left to do
    policy.update(Round(cost_seconds=DECODE_S))  # pipelined again: the break cost 1 decode extra
    assert policy.cost_model.restart_cost() == pytest.approx(1.0)
    assert policy.cost_model.time(1) == pytest.approx(
        DECODE_S
    )  # the decodes of the break are not the yardstick
    assert policy.cost_model.cost(2) == pytest.approx(1.1 + 1.0)  # measured: 1.1 decodes, plus the break
    assert policy.next_k("weak") == 0
    assert policy.next_k("strong") >= 8


def test_a_break_by_early_drafts_is_timed_from_the_chains_last_decode():
    """Drafts proposed while a decode runs end the chain: the chain's last
    decode, the restarted one and the next are timed together."""
    policy = AdaptiveK(8)
    policy.update(Round(cost_seconds=DECODE_S))
    policy.update(Round(cost_seconds=0.2 * DECODE_S, chain_end=True))
    policy.update(Round(cost_seconds=2.3 * DECODE_S, restarted=True))
    policy.update(Round(cost_seconds=DECODE_S))
    policy.update(Round(cost_seconds=DECODE_S))
    assert policy.cost_model.restart_cost() == pytest.approx(0.5)


def test_untimed_policies_ignore_the_restart():
    policy = AdaptiveK(8, timed=False)
    policy.update(Round(cost_seconds=DECODE_S))
    policy.update(Round(cost_seconds=5 * DECODE_S, restarted=True))
    policy.update(Round(cost_seconds=DECODE_S))
    policy.update(Round(cost_seconds=DECODE_S))
    assert policy.cost_model.restart_cost() == 0.0


def test_a_key_prior_can_set_the_first_position_apart():
    """A prior (first, later) models drafts whose first token is the risky
    one: a weak first token stands a key down even when later ones are sure."""
    policy = AdaptiveK(16, DraftProfile(key_priors={"weak start": (0.2, 0.95), "strong start": (0.9, 0.95)}))
    policy.update(Round(cost_seconds=seconds(1)))
    assert policy.acceptance.rates("weak start")[:3] == [0.2, 0.95, 0.95]
    assert policy.next_k("weak start") < policy.next_k("strong start")


def test_unmeasured_widths_lie_on_the_line_between_measured_ones():
    """Once some widths are timed, an untimed width between two of them (a
    decode costs 1) costs the line between them: cheap measured verifies make
    longer drafts worth trying."""
    policy = AdaptiveK(32)
    policy.update(Round(cost_seconds=DECODE_S))
    policy.update(Round(drafted=8, accepted=8, cost_seconds=DECODE_S * 1.3))  # 9 tokens: 1.3 (prior: 1.8)
    policy.update(Round(drafted=16, accepted=16, cost_seconds=DECODE_S * 1.7))  # 17 tokens: 1.7
    cost = policy.cost_model.cost
    assert cost(9) == pytest.approx(1.3) and cost(17) == pytest.approx(1.7)
    assert cost(5) == pytest.approx(1.0 + 0.3 * 4 / 8)
    assert cost(13) == pytest.approx(1.5)
    assert AdaptiveK(32).cost_model.cost(17) == pytest.approx(
        AdaptiveK(32).cost_model.prior_cost(17)
    )  # nothing measured


def test_past_the_widest_measured_width_each_token_costs_a_prefilled_tokens_share():
    """A prefill's seconds per token, relative to a decode, is what one more
    token of a wide forward costs: past the widest timed width, costs grow
    by it (until a prefill is timed, as the prior's shape through that width)."""
    policy = AdaptiveK(32)
    policy.update(Round(cost_seconds=DECODE_S))
    policy.update(Round(drafted=8, accepted=8, cost_seconds=DECODE_S * 1.3))
    prior = policy.cost_model.prior_cost
    assert policy.cost_model.slope() is None
    assert policy.cost_model.cost(17) == pytest.approx(1.3 * prior(17) / prior(9))
    policy.prefilled(200, 200 * 0.05 * DECODE_S)  # 0.05 decodes a token
    assert policy.cost_model.slope() == pytest.approx(0.05)
    assert policy.cost_model.cost(17) == pytest.approx(1.3 + 0.05 * 8)
    short = AdaptiveK(32)
    short.update(Round(cost_seconds=DECODE_S))
    short.prefilled(10, 10 * 0.5 * DECODE_S)  # a short prefill times mostly a forward's fixed cost
    assert short.cost_model.slope() is None


def test_before_a_decode_is_timed_verifies_estimate_it():
    """A first request that drafts from its first round (a long copy) never
    times a plain decode while it copies: the narrowest timed verify,
    through the prior's shape, stands in for one, so the prefill's slope
    and the measured widths apply from the first rounds."""
    policy = AdaptiveK(32)
    policy.prefilled(200, 200 * 0.05 * DECODE_S)
    policy.update(Round(drafted=4, accepted=4, cost_seconds=DECODE_S * 1.5))
    t1 = DECODE_S * 1.5 / policy.cost_model.prior_cost(5)
    assert policy.cost_model.decode_time() == pytest.approx(t1)
    assert policy.cost_model.slope() == pytest.approx(0.05 * DECODE_S / t1)
    assert not policy.cost_model.knows_decode()


def simulate(policy, draft_cost: float, p_accept: float, tokens: int, seed: int = 0) -> float:
    """Speed relative to plain decoding of a proposer whose every draft attempt
    costs ``draft_cost`` decodes and whose drafts each pass with probability
    ``p_accept`` (independently); verify widths cost as in ``seconds``."""
    import random

    rng = random.Random(seed)
    done, elapsed = 0, 0.0
    while done < tokens:
        k = policy.next_k()
        n = 0
        while n < k and rng.random() < p_accept:
            n += 1
        cost = seconds(k + 1) + (draft_cost * DECODE_S if k else 0.0)
        policy.update(
            Round(
                drafted=k, accepted=n, cost_seconds=cost, propose_seconds=draft_cost * DECODE_S if k else 0.0
            )
        )
        done += n + 1
        elapsed += cost
    return (done / elapsed) / (1 / DECODE_S)


@pytest.mark.parametrize("draft_cost", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("p_accept", [0.0, 0.1])
@pytest.mark.parametrize("tokens", [256, 1024])
def test_a_weak_costly_proposer_stands_down_to_at_least_097x_of_plain_decoding(draft_cost, p_accept, tokens):
    """DFlash with poor drafts: each attempt costs up to two decodes of drafting
    and almost never passes. Failed probes then wait long enough that the run
    keeps at least 0.97x of plain decoding's speed."""
    assert simulate(AdaptiveK(8), draft_cost, p_accept, tokens) >= 0.97


def test_the_cool_down_after_a_failed_probe_grows_with_its_measured_cost():
    cheap, costly = AdaptiveK(8), AdaptiveK(8)
    simulate(cheap, 0.0, 0.0, 200)
    simulate(costly, 2.0, 0.0, 200)
    assert costly.cost_model.probe_excess == pytest.approx(2.0 + 0.1 * cheap.probes.probe_k, rel=0.2)
    assert (
        costly.probes.cooldown
        >= costly.cost_model.probe_excess / costly.probes.probe_budget
        > cheap.probes.cooldown
    )


def test_a_good_costly_proposer_still_drafts():
    """Standing down is for drafts that fail: drafts that pass 90% of the time
    pay for a drafter costing a decode per round."""
    policy = AdaptiveK(8)
    assert simulate(policy, 1.0, 0.9, 512) > 1.5


def test_timings_shared_between_policies_carry_what_was_measured():
    """A Target hands each generation's adaptive K the same ``Timings``: a
    width one generation measured is known to the next."""
    first = AdaptiveK(16)
    first.update(Round(cost_seconds=DECODE_S))
    first.update(Round(drafted=15, accepted=15, cost_seconds=1.3 * DECODE_S))
    second = AdaptiveK(16, timings=first.cost_model.timings)
    assert second.cost_model.cost(16) == pytest.approx(1.3)
    assert AdaptiveK(16).cost_model.time(16) is None
