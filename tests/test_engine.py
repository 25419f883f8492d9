"""The shared speculative loop: lossless at temperature 0, stops where it must."""

import pytest
from helpers import assert_same_greedy, reference_greedy
from models import ARCHS, random_prompt, tiny_target

import hf2q_py
from hf2q_py.config import SpecConfig
from hf2q_py.draft_length import FixedK
from hf2q_py.generation import generate_tokens
from hf2q_py.errors import Hf2qError
from hf2q_py.methods import build_proposer
from hf2q_py.proposers.base import Draft, Proposer
from hf2q_py.stats import GenerationStats


def loopy_prompt(n: int = 24) -> list[int]:
    """A prompt that repeats itself, so n-gram lookup finds drafts."""
    base = random_prompt(6, 3)
    return (base * 10)[:n]


@pytest.mark.parametrize("arch", ARCHS)
def test_baseline_equals_mlx_lm_generate_step(arch):
    target = tiny_target(arch)
    prompt = random_prompt(20)
    got = hf2q_py.generate(target, prompt, max_tokens=40, method="baseline").tokens
    assert got == reference_greedy(target.model, prompt, 40)


# (arch, weight scale): scale 1 models repeat themselves (drafts mostly accepted),
# scale 2 models vary (drafts mostly rejected), gemma4 at 1.5 is in between.
REGIMES = [("llama", 1.0), ("llama", 2.0), ("gemma4_text", 1.0), ("gemma4_text", 1.5)]


@pytest.mark.parametrize("arch, scale", REGIMES)
@pytest.mark.parametrize("k", range(1, 9))
def test_ngram_equals_baseline_for_every_k(arch, scale, k):
    target = tiny_target(arch, scale=scale)
    prompt = loopy_prompt()
    want = hf2q_py.generate(target, prompt, max_tokens=60, method="baseline").tokens  # past the window of 16
    result = hf2q_py.generate(target, prompt, max_tokens=60, method="ngram", k=k, adaptive=False)
    assert_same_greedy(target.model, prompt, result.tokens, want)
    assert result.stats.drafted > 0, "the test should exercise verification"


@pytest.mark.parametrize("arch, scale", REGIMES)
def test_adaptive_ngram_equals_baseline(arch, scale):
    target = tiny_target(arch, scale=scale)
    prompt = loopy_prompt(40)
    want = hf2q_py.generate(target, prompt, max_tokens=80, method="baseline").tokens
    got = hf2q_py.generate(target, prompt, max_tokens=80, method="ngram", k=8).tokens
    assert_same_greedy(target.model, prompt, got, want)


def test_a_target_keeps_what_its_forwards_cost_across_generations():
    target = tiny_target("llama")
    hf2q_py.generate(target, loopy_prompt(40), max_tokens=40, method="ngram")
    timings = target.kept.timings["ngram"]
    assert any(w > 1 for w in timings.counts)  # verify widths it timed
    _, policy = build_proposer(target, SpecConfig(method="ngram"))
    assert policy.cost_model.timings is timings
    target.kept.clear()
    _, policy = build_proposer(target, SpecConfig(method="ngram"))
    assert policy.cost_model.time(1) is None


def test_one_token_prompt():
    target = tiny_target("llama")
    want = hf2q_py.generate(target, [5], max_tokens=30, method="baseline").tokens
    got = hf2q_py.generate(target, [5], max_tokens=30, method="ngram", k=4, adaptive=False).tokens
    assert_same_greedy(target.model, [5], got, want)
    assert len(got) == 30


@pytest.mark.parametrize("max_tokens", range(1, 12))
def test_budget_ends_inside_an_accepted_block(max_tokens):
    target = tiny_target("llama")
    prompt = loopy_prompt()
    want = hf2q_py.generate(target, prompt, max_tokens=max_tokens, method="baseline").tokens
    got = hf2q_py.generate(target, prompt, max_tokens=max_tokens, method="ngram", k=8, adaptive=False)
    assert got.tokens == want
    assert len(got.tokens) == max_tokens
    assert got.stats.finish_reason == "length"


class OracleProposer(Proposer):
    """Drafts the known greedy continuation: every draft is accepted, so each
    round commits a full block of k+1 tokens."""

    def __init__(self, prompt: list[int], future: list[int]):
        self.n, self.future = len(prompt), future

    def propose(self, tokens, k):
        i = len(tokens) - self.n
        return Draft(self.future[i : i + k])


def run_engine(target, prompt, proposer, max_tokens, eos=()):
    stats = GenerationStats()
    out = []
    for new in generate_tokens(
        target,
        prompt,
        max_tokens=max_tokens,
        proposer=proposer,
        policy=FixedK(8),
        eos_token_ids=eos,
        stats=stats,
    ):
        out += new
    return out, stats


def test_eos_inside_an_accepted_block_ends_generation():
    target = tiny_target("gemma4_text")
    prompt = random_prompt(10)
    free = hf2q_py.generate(target, prompt, max_tokens=40, method="baseline").tokens
    i = next(i for i in range(2, 40) if free[i] not in free[:i] and i % 9 not in (0, 8))
    got, stats = run_engine(target, prompt, OracleProposer(prompt, free), 40, eos={free[i]})
    assert got == free[:i]
    assert stats.finish_reason == "stop"
    assert stats.accepted == stats.drafted  # the block really was accepted


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 9, 10, 13])
def test_budget_inside_a_fully_accepted_block(max_tokens):
    target = tiny_target("gemma4_text")
    prompt = random_prompt(10)
    free = hf2q_py.generate(target, prompt, max_tokens=40, method="baseline").tokens
    got, stats = run_engine(target, prompt, OracleProposer(prompt, free), max_tokens)
    assert got == free[:max_tokens]
    assert stats.finish_reason == "length"


def test_stats_count_rounds_drafts_and_acceptance():
    target = tiny_target("llama")
    r = hf2q_py.generate(target, loopy_prompt(), max_tokens=50, method="ngram", k=4, adaptive=False)
    s = r.stats
    assert s.generated_tokens == len(r.tokens) == 50
    assert s.rounds == s.empty_proposals + s.verify_rounds
    assert 0 < s.accepted <= s.drafted
    assert s.acceptance_rate == pytest.approx(s.accepted / s.drafted)
    assert s.mean_accepted_length == pytest.approx(1 + s.accepted / s.verify_rounds)
    assert s.position_drafted[0] == s.verify_rounds
    assert all(0.0 <= p <= 1.0 for p in s.per_position_acceptance)
    # every round commits at least one token and at most k+1
    assert s.rounds <= 50 <= s.rounds * 5


def test_profile_hook_sees_every_round():
    target = tiny_target("llama")
    seen = []
    r = hf2q_py.generate(target, loopy_prompt(), max_tokens=30, method="ngram", k=4, on_round=seen.append)
    assert len(seen) == r.stats.rounds
    assert sum(x.emitted for x in seen) == 30


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(k=0), "k"),
        (dict(k=-2), "k"),
        (dict(ngram_min=3, ngram_max=2), "ngram-max"),
        (dict(ngram_min=0), "ngram-min"),
        (dict(max_tokens=0), "max-tokens"),
        (dict(method="telepathy"), "unknown method"),
        (dict(bogus=1), "unknown option"),
    ],
)
def test_bad_options_are_refused_with_a_clear_error(options, message):
    target = tiny_target("llama")
    opts = {"method": "ngram", **options}
    with pytest.raises(Hf2qError, match=message):
        hf2q_py.generate(target, [1, 2, 3], **opts)


def test_bad_prompts_are_refused():
    target = tiny_target("llama")
    with pytest.raises(Hf2qError, match="empty"):
        hf2q_py.generate(target, [], max_tokens=4, method="baseline")
    with pytest.raises(Hf2qError, match="not a token id"):
        hf2q_py.generate(target, [1, 10_000], max_tokens=4, method="baseline")
    with pytest.raises(Hf2qError, match="no tokenizer"):
        hf2q_py.generate(target, "hello", max_tokens=4, method="baseline")


@pytest.mark.parametrize("method", ["ngram", "layerskip"])
def test_a_plain_first_token_decodes_the_first_round_and_changes_no_token(method):
    target = tiny_target("llama")
    prompt = loopy_prompt()
    opts = {"skip_layers": [1]} if method == "layerskip" else {}
    rounds = []
    got = hf2q_py.generate(
        target, prompt, max_tokens=24, method=method, plain_first_token=True, on_round=rounds.append, **opts
    )
    assert rounds[0].drafted == 0 and got.stats.drafted > 0
    assert got.tokens == hf2q_py.generate(target, prompt, max_tokens=24, method="baseline").tokens
