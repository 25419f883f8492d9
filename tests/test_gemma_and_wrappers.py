"""Multimodal wrappers (the text model under ``language_model``), Gemma 4's
KV-shared layers and gpt-oss (attention sinks, alternating sliding window):
configuration, capture, layer skip and DFlash on the language model; greedy
output equals mlx-lm's past the sliding window."""

import mlx.core as mx
import pytest
from helpers import UNGATED, assert_same_greedy, reference_greedy
from models import CONFIGS, VOCAB, WRAPPERS, perturbed_target, random_prompt, tiny_target

import hf2q_py
from hf2q_py.proposers.dflash_drafter import TargetHead
from hf2q_py.tools.dflash_make import drafter_for
from hf2q_py.errors import UnsupportedModelError
from hf2q_py.proposers.layer_skip import LayerSkipProposer
from hf2q_py.taps import kv_sources


@pytest.mark.parametrize("arch", WRAPPERS)
def test_target_reads_the_language_models_config(arch):
    target = tiny_target(arch)
    text = CONFIGS[arch]["text_config"]
    assert target.lm is target.model.language_model
    assert target.hidden_size == text["hidden_size"]
    assert target.num_layers == text["num_hidden_layers"]
    assert target.vocab_size == VOCAB
    assert target.sliding_window == text.get("sliding_window")
    assert target.softcap == text.get("final_logit_softcapping")
    assert target.embed_scale == (text["hidden_size"] ** 0.5 if arch.startswith("gemma") else 1.0)


@pytest.mark.parametrize("arch", WRAPPERS)
def test_capture_and_the_borrowed_head_reproduce_the_wrappers_logits(arch):
    target = tiny_target(arch, scale=1.5)
    prompt = random_prompt(24)
    fwd = target.runtime().prefill(prompt, logits="all", capture_layers=[1], capture_final=True)
    assert fwd.hidden[1].shape == (1, 24, target.hidden_size)
    head = TargetHead(target)
    assert mx.allclose(head.logits(fwd.final[0]), fwd.logits, atol=1e-4).item()
    want = target.model(mx.array([prompt]))[0]
    assert mx.allclose(fwd.logits, want, atol=2e-4).item()


def options(arch, method, target):
    if method == "draft":
        return {
            "draft": perturbed_target(arch, scale=1.5 if arch == "gpt_oss" else 1.0, noise=0.02),
            **UNGATED,
        }
    if method == "layerskip":
        return {"skip_layers": [1]}
    if method == "dflash":
        return {"drafter": drafter_for(target, layers=1, target_layer_ids=[0, 2], block_size=17)}
    return {}


@pytest.mark.parametrize("arch", ["gemma4", "gemma4_text", "gpt_oss"])
@pytest.mark.parametrize("method", ["ngram", "draft", "layerskip", "dflash"])
@pytest.mark.parametrize("k", [1, 16])
def test_every_method_matches_mlx_lm_greedy_past_the_window(arch, method, k):
    """gemma4: sliding window 16, KV-shared layers 4 and 5; gpt_oss: window 8
    with sinks. Prompt and output run past the window."""
    target = tiny_target(arch, scale=1.5 if arch == "gpt_oss" else 1.0)
    prompt = random_prompt(10, seed=3) * 2
    want = reference_greedy(target.model, prompt, 40)
    r = hf2q_py.generate(
        target, prompt, max_tokens=40, method=method, k=k, adaptive=False, **options(arch, method, target)
    )
    assert_same_greedy(target.model, prompt, r.tokens, want)
    assert r.stats.drafted > 0


def test_skip_sets_that_keep_shared_kv_valid_work():
    target = tiny_target("gemma4_text", scale=1.5)
    assert kv_sources(target.model) == {4: 3, 5: 2}
    prompt = random_prompt(12)
    want = reference_greedy(target.model, prompt, 30)
    for skip in ([4], [3, 4], [2, 3, 4, 5], [1, 5]):
        r = hf2q_py.generate(
            target, prompt, max_tokens=30, method="layerskip", skip_layers=skip, k=4, adaptive=False
        )
        assert_same_greedy(target.model, prompt, r.tokens, want)


def test_a_skip_set_that_breaks_shared_kv_is_refused_naming_the_layer():
    target = tiny_target("gemma4")
    with pytest.raises(
        UnsupportedModelError, match=r"cannot skip layer 3: KV-shared layer 4 reads its cache"
    ):
        hf2q_py.generate(target, [1, 2, 3], max_tokens=4, method="layerskip", skip_layers=[3])
    # automatic calibration only tries valid sets
    prop = LayerSkipProposer(target, "auto")
    assert all(not (3 in c and 4 not in c) and not (2 in c and 5 not in c) for c in prop.trials[1:])
