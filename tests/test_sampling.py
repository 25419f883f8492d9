"""Sampling at temperature > 0: every method keeps the target's distribution."""

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from helpers import UNGATED
from models import random_prompt, tiny_target
from scipy.stats import chisquare

import hf2q_py
from hf2q_py.generation import generate_tokens
from hf2q_py.errors import Hf2qError
from hf2q_py.methods import build_proposer
from hf2q_py.config import SpecConfig
from hf2q_py.sampling import SamplingConfig, Sampler, apply_penalty, filtered_probs

CFG = dict(temperature=1.0, top_k=4)
RUNS = 500
TOKENS = 3  # a first round drafts K = 2 and verifies them: 3 tokens
ALPHA = 1e-3  # fixed seeds: the verdicts are deterministic; the level keeps them meaningful


def exact_distribution(target, prompt, cfg, n=TOKENS):
    """P(t1..tn) under the filtered target distribution, by enumeration."""
    dist = {(): 1.0}
    for _ in range(n):
        longer = {}
        for seq, p in dist.items():
            probs = filtered_probs(target.model(mx.array([prompt + list(seq)]))[0, -1:], cfg)[0]
            for t in np.nonzero(np.array(probs))[0].tolist():
                longer[seq + (t,)] = p * probs[t].item()
        dist = longer
    return dist


def samples(target, prompt, runs, **opts):
    """Counts of the first TOKENS tokens over seeded runs, and the number of
    drafts in each run's first round."""
    out, first_drafted = Counter(), []
    for seed in range(runs):
        rounds = []
        r = hf2q_py.generate(
            target, prompt, max_tokens=TOKENS, seed=seed, on_round=rounds.append, **CFG, **opts
        )
        out[tuple(r.tokens)] += 1
        first_drafted.append(rounds[0].drafted)
    return out, first_drafted


def p_value(counts, dist, runs):
    """Chi-square over the support, cells expected fewer than 5 times pooled."""
    assert sum(counts.get(c, 0) for c in dist) == sum(counts.values()), "a sample fell outside the support"
    total = sum(counts.values())
    observed, expected, rest_o, rest_e = [], [], 0.0, 0.0
    for c in sorted(dist):
        e = dist[c] * total / sum(dist.values())
        if e >= 5:
            observed.append(counts.get(c, 0))
            expected.append(e)
        else:
            rest_o += counts.get(c, 0)
            rest_e += e
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    return chisquare(np.array(observed, float), np.array(expected) / sum(expected) * sum(observed)).pvalue


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama", scale=2.0)
    prompt = random_prompt(8)
    return target, prompt, exact_distribution(target, prompt, SamplingConfig(**CFG))


METHODS = {
    "baseline": dict(method="baseline"),
    "ngram": dict(method="ngram", ngram_proposer="lookup", k=2, adaptive=False),
    "suffix": dict(method="ngram", ngram_proposer="suffix", memory=False, k=2, adaptive=False),
    "draft": dict(method="draft", k=2, adaptive=False, **UNGATED, draft_suffix_depth=0),
    "draft+copies": dict(
        method="draft",
        k=2,
        adaptive=False,
        **UNGATED,
        draft_suffix_depth=1,
        memory=False,
    ),
    # drafts end where the draft model's probability of the whole draft falls below 0.5
    "draft-confidence": dict(method="draft", k=2, adaptive=False, draft_min_prob=0.5, draft_suffix_depth=0),
    "layerskip": dict(method="layerskip", skip_layers=[1, 2], k=2, adaptive=False),
    "dflash": dict(method="dflash", k=2, adaptive=False),
    "dflash-vocab": dict(method="dflash", k=2, adaptive=False),  # drafts from half the vocabulary
}


@pytest.mark.parametrize("method", list(METHODS))
def test_first_tokens_follow_the_target_distribution(setup, method):
    target, prompt, dist = setup
    opts = dict(METHODS[method])
    if method.startswith("draft"):
        opts["draft"] = tiny_target("llama", seed=1, scale=2.0)
    if method.startswith("dflash"):
        from hf2q_py.proposers.dflash_drafter import DraftVocab
        from hf2q_py.tools.dflash_make import drafter_for

        opts["drafter"] = drafter_for(target, layers=1, block_size=4, target_layer_ids=[0, 2], seed=1)
        if method == "dflash-vocab":  # q is zero outside the subset, where the target still samples
            opts["drafter"].vocab = DraftVocab(range(0, target.vocab_size, 2), target.vocab_size)
            assert {t % 2 for seq in dist for t in seq} == {0, 1}
    if method in (
        "ngram",
        "suffix",
        "draft+copies",
    ):  # put the likely continuations in the context so drafts happen
        prompt = prompt + [t for seq in sorted(dist, key=dist.get)[-3:] for t in seq] + prompt[-2:]
        dist = exact_distribution(target, prompt, SamplingConfig(**CFG))
    counts, first_drafted = samples(target, prompt, RUNS, **opts)
    assert p_value(counts, dist, RUNS) > ALPHA
    # every speculative run verifies K = 2 drafts in its first round (n-gram: when the context matches)
    if method == "baseline":
        assert set(first_drafted) == {0}
    elif method in ("ngram", "suffix"):
        assert first_drafted.count(2) > RUNS // 2 and set(first_drafted) <= {0, 2}
    elif method == "draft-confidence":  # the first draft token is always kept
        assert set(first_drafted) <= {1, 2} and 1 in first_drafted
    else:
        assert set(first_drafted) == {2}


class AlwaysAccept(Sampler):
    def accept(self, p_draft, q_draft, u):
        return mx.ones(p_draft.shape, dtype=mx.bool_)


def test_a_wrong_acceptance_rule_fails_the_same_test(setup):
    target, prompt, dist = setup
    draft = tiny_target("llama", seed=1, scale=2.0)
    counts = Counter()
    for seed in range(RUNS):
        proposer, policy = build_proposer(
            target,
            SpecConfig(method="draft", draft=draft, k=2, adaptive=False, **UNGATED),
        )
        out = []
        for new in generate_tokens(
            target,
            prompt,
            max_tokens=TOKENS,
            proposer=proposer,
            policy=policy,
            decider=AlwaysAccept(SamplingConfig(seed=seed, **CFG)),
        ):
            out += new
        counts[tuple(out)] += 1
    in_support = {c: n for c, n in counts.items() if c in dist}
    assert len(in_support) < len(counts) or p_value(in_support, dist, sum(in_support.values())) < ALPHA


def test_sampling_keeps_speculating_after_plain_rounds():
    from test_engine import loopy_prompt

    target = tiny_target("gemma4_text", scale=1.5)
    r = hf2q_py.generate(
        target, loopy_prompt(40), max_tokens=80, temperature=0.3, seed=1, method="ngram", k=4
    )
    assert r.stats.empty_proposals > 0 and r.stats.verify_rounds > 3


def test_same_seed_same_output():
    target = tiny_target("llama", scale=2.0)
    a = hf2q_py.generate(target, random_prompt(8), max_tokens=20, temperature=0.8, seed=7, method="ngram")
    b = hf2q_py.generate(target, random_prompt(8), max_tokens=20, temperature=0.8, seed=7, method="ngram")
    c = hf2q_py.generate(target, random_prompt(8), max_tokens=20, temperature=0.8, seed=8, method="ngram")
    assert a.tokens == b.tokens != c.tokens


@pytest.mark.parametrize("k", [1, 3, 6])
def test_ngram_sampling_emits_what_plain_sampling_emits_with_the_same_seed(k):
    """Randomness is keyed by position, so how rounds split the sequence does not matter."""
    from test_engine import loopy_prompt

    target = tiny_target("llama", scale=1.5)
    prompt = loopy_prompt(30)
    plain = hf2q_py.generate(target, prompt, max_tokens=40, temperature=0.5, seed=3, method="baseline")
    spec = hf2q_py.generate(
        target, prompt, max_tokens=40, temperature=0.5, seed=3, method="ngram", k=k, adaptive=False
    )
    assert spec.stats.accepted > 0
    assert spec.tokens == plain.tokens


def test_seeded_adaptive_draft_model_repeats_exactly():
    target, draft = tiny_target("llama", scale=2.0), tiny_target("llama", seed=1, scale=2.0)
    runs = [
        hf2q_py.generate(
            target, random_prompt(8), max_tokens=30, temperature=0.8, seed=5, method="draft", draft=draft
        )
        for _ in range(3)
    ]
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens


def test_filters_keep_the_right_tokens():
    logits = mx.log(mx.array([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda **kw: (
        np.array(filtered_probs(logits, SamplingConfig(temperature=1.0, **kw))[0]) > 0
    ).tolist()
    assert keep(top_k=2) == [True, True, False, False]
    assert keep(top_p=0.8) == [True, True, False, False]
    assert keep(top_p=0.81) == [True, True, True, False]
    assert keep(min_p=0.5) == [True, True, False, False]
    p = filtered_probs(logits, SamplingConfig(temperature=1.0, top_k=2))[0].tolist()
    assert p[0] == pytest.approx(0.5 / 0.8) and sum(p) == pytest.approx(1.0)


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-30])
def test_tiny_temperatures_give_argmax_not_nan(temperature):
    logits = mx.array([[1.0, 3.0, 2.0, -50.0], [0.5, 0.5, 0.1, 0.0]])
    p = filtered_probs(logits, SamplingConfig(temperature=temperature))
    assert not np.isnan(np.array(p)).any()
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]  # ties share the mass


def test_sampling_at_a_tiny_temperature_is_greedy():
    target = tiny_target("llama", scale=2.0)
    prompt = random_prompt(8)
    want = hf2q_py.generate(target, prompt, max_tokens=12, method="baseline").tokens
    for method in ("baseline", "ngram"):
        got = hf2q_py.generate(target, prompt, max_tokens=12, temperature=1e-40, seed=1, method=method)
        assert got.tokens == want


def test_repetition_penalty_matches_mlx_lm():
    from mlx_lm.sample_utils import make_repetition_penalty

    logits = mx.array([[1.0, -2.0, 3.0, 0.5, -0.1]])
    ctx = [1, 2, 2]
    want = make_repetition_penalty(1.5, 20)(mx.array(ctx), mx.array(logits))  # it edits in place
    got = apply_penalty(logits, [ctx], SamplingConfig(repetition_penalty=1.5))
    assert mx.allclose(got, want).item()


def test_greedy_with_a_repetition_penalty_is_identical_across_methods():
    target = tiny_target("llama", scale=1.0)
    prompt = random_prompt(10)
    want = hf2q_py.generate(target, prompt, max_tokens=40, repetition_penalty=1.3, method="baseline").tokens
    assert want != hf2q_py.generate(target, prompt, max_tokens=40, method="baseline").tokens
    got = hf2q_py.generate(target, prompt, max_tokens=40, repetition_penalty=1.3, method="ngram", k=4).tokens
    assert got == want


@pytest.mark.parametrize(
    "opts",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(min_p=1.0),
        dict(repetition_penalty=0),
    ],
)
def test_bad_sampling_options_are_refused(opts):
    with pytest.raises(Hf2qError):
        hf2q_py.generate(tiny_target("llama"), [1, 2], max_tokens=2, **opts)
