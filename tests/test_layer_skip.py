"""The layer-skip proposer: lossless for every skip recipe; ``auto`` calibrates
once, drops untried the skip sets that could not pay and remembers its choice;
a skip pass costs its share of the weights."""

import pytest
from helpers import assert_same_greedy, baseline
from mlx.utils import tree_flatten
from models import random_prompt, tiny_target

import hf2q_py
from hf2q_py.draft_length import AdaptiveK
from hf2q_py.generation import generate_tokens
from hf2q_py.errors import Hf2qError
from hf2q_py.proposers import layer_skip
from hf2q_py.proposers.layer_skip import (
    LayerSkipProposer,
    auto_candidates,
    draft_cost_share,
    optimistic_speedup,
    skip_recipe,
)
from hf2q_py.stats import GenerationStats


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


def test_optimistic_speedup_is_highest_for_free_always_accepted_drafts():
    def flat(n):
        return 1.0

    assert optimistic_speedup(0.0, flat, 4, acceptance=1.0) == 5.0  # free, always-right drafts
    assert optimistic_speedup(1.0, flat, 8, acceptance=1.0) < 1.0 + 1e-9  # a full pass per draft
    assert optimistic_speedup(0.5, flat, 8, 0.0) < 1.0  # never accepted


def test_skip_recipes_name_the_layers_they_skip_and_bad_ones_are_refused():
    assert skip_recipe("alternate", 6) == [1, 3, 5]
    assert skip_recipe("early:4", 6) == [4, 5]
    assert skip_recipe("middle:2", 6) == [2, 3]
    assert skip_recipe("3,5,7", 30) == [3, 5, 7]
    assert auto_candidates(30) == [list(range(12, 18)), list(range(10, 19)), list(range(20, 30))]
    for bad in ("99", "early:0", "middle:30", "x,y", ""):
        with pytest.raises(Hf2qError):
            skip_recipe(bad, 30)
