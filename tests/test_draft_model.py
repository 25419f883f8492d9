"""Draft-model and layer-skip proposers on the shared engine: lossless, exact caches."""

import pytest
from helpers import UNGATED, assert_same_greedy, reference_greedy
from models import random_prompt, tiny_target

import hf2q_py
from hf2q_py.errors import Hf2qError
from mlx.utils import tree_flatten

from hf2q_py.draft_length import AdaptiveK
from hf2q_py.engine import generate_tokens
from hf2q_py.proposers import layer_skip
from hf2q_py.proposers.layer_skip import (
    LayerSkipProposer,
    auto_candidates,
    draft_cost_share,
    optimistic_speedup,
    skip_recipe,
)
from hf2q_py.stats import GenerationStats

# (target arch, scale): repetitive and varied models; gemma4 runs far past its window of 16.
TARGETS = [("llama", 1.0), ("llama", 2.0), ("qwen2", 1.5), ("gemma4_text", 1.5)]


def baseline(target, prompt, n):
    return hf2q_py.generate(target, prompt, max_tokens=n).tokens


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


def test_draft_method_needs_a_draft_model():
    with pytest.raises(Hf2qError, match="draft model"):
        hf2q_py.generate(tiny_target("llama"), [1, 2], max_tokens=4, method="draft")


@pytest.mark.parametrize(
    "arch, scale", [("llama", 1.0), ("llama", 2.0), ("qwen2", 1.5), ("gemma3_text", 1.5)]
)
@pytest.mark.parametrize("skip", [[1], [1, 2], "alternate", "early:2"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_layer_skip_is_lossless(arch, scale, skip, k):
    target = tiny_target(arch, scale=scale)
    prompt = random_prompt(12)
    want = baseline(target, prompt, 48)  # gemma3_text: past its window of 16
    r = hf2q_py.generate(
        target, prompt, max_tokens=48, method="layerskip", skip_layers=skip, k=k, adaptive=False
    )
    assert_same_greedy(target.model, prompt, r.tokens, want)
    assert r.stats.drafted > 0


def test_layer_skip_auto_is_lossless_and_remembers_its_choice(monkeypatch):
    monkeypatch.setattr(layer_skip, "MARGIN", 0.0)  # no candidate is dropped untried
    target = tiny_target("llama", scale=1.0)
    prompt = random_prompt(12)
    want = baseline(target, prompt, 60)
    r = hf2q_py.generate(target, prompt, max_tokens=60, method="layerskip", skip_layers="auto", k=4)
    assert_same_greedy(target.model, prompt, r.tokens, want)
    assert "auto" in target.kept.skip_sets  # calibrated once ...
    again = LayerSkipProposer(target, "auto")
    assert again.trials == []  # ... and the next run starts with the choice


def test_auto_drops_untried_the_skip_sets_that_could_not_pay():
    target = tiny_target("llama", scale=1.0)
    prompt = random_prompt(12)
    want = baseline(target, prompt, 30)
    hopeless = LayerSkipProposer(target, "auto", optimistic_acceptance=0.0)
    assert hopeless.trials  # candidates to try, until the prompt is in ...
    stats = GenerationStats()
    got = [
        t
        for new in generate_tokens(
            target, prompt, max_tokens=30, proposer=hopeless, policy=AdaptiveK(4), stats=stats
        )
        for t in new
    ]
    assert got == want
    assert hopeless.trials == [] and len(hopeless.pruned) == len(auto_candidates(target.num_layers))
    assert stats.drafted == 0  # ... then plain decoding, with no calibration rounds
    assert LayerSkipProposer(target, "auto").trials == []  # and the choice is remembered


def test_a_skip_pass_costs_its_share_of_the_weights():
    model = tiny_target("llama").model
    n = len(model.layers)
    assert draft_cost_share(model, []) == 1.0
    shares = [draft_cost_share(model, range(m)) for m in range(n + 1)]
    assert shares == sorted(shares, reverse=True)
    head = model.model.embed_tokens.weight.nbytes  # tied embeddings: the head
    assert shares[-1] == pytest.approx(
        head
        / (head + sum(sum(v.nbytes for _, v in tree_flatten(layer.parameters())) for layer in model.layers))
    )


def test_optimistic_speedup():
    def flat(n):
        return 1.0

    assert optimistic_speedup(0.0, flat, 4, acceptance=1.0) == 5.0  # free, always-right drafts
    assert optimistic_speedup(1.0, flat, 8, acceptance=1.0) < 1.0 + 1e-9  # a full pass per draft
    assert optimistic_speedup(0.5, flat, 8, 0.0) < 1.0  # never accepted


def test_skip_recipes():
    assert skip_recipe("alternate", 6) == [1, 3, 5]
    assert skip_recipe("early:4", 6) == [4, 5]
    assert skip_recipe("middle:2", 6) == [2, 3]
    assert skip_recipe("3,5,7", 30) == [3, 5, 7]
    assert auto_candidates(30) == [list(range(12, 18)), list(range(10, 19)), list(range(20, 30))]
    for bad in ("99", "early:0", "middle:30", "x,y", ""):
        with pytest.raises(Hf2qError):
            skip_recipe(bad, 30)
