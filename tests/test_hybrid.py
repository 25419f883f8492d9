"""Hybrid recurrent models (gated delta, short conv, Mamba-2 layers): rollback
of recurrent state is exact, and every method's greedy output equals mlx-lm's."""

import mlx.core as mx
import pytest
from helpers import UNGATED, assert_same_greedy, reference_greedy
from mlx_lm.models.cache import ArraysCache, trim_prompt_cache
from models import HYBRIDS, perturbed_target, random_prompt, tiny_target

import hf2q_py
from hf2q_py.tools.dflash_make import drafter_for
from hf2q_py.errors import UnsupportedModelError

ATOL = 1e-4  # batched forwards of different lengths differ by ~1e-5 (BLAS reduction order)


def recurrent_states(rt) -> list[mx.array]:
    return [a for c in rt.cache if isinstance(c, ArraysCache) for a in c.cache]


def assert_same_states(got, want):
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert mx.allclose(g, w, rtol=ATOL, atol=ATOL).item(), float(mx.abs(g - w).max())


@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("k", [1, 4, 16])
def test_a_verify_trimmed_to_n_accepted_leaves_the_state_of_the_committed_tokens(arch, k):
    target = tiny_target(arch)
    prompt, block = random_prompt(10), random_prompt(k + 1, seed=1)
    for n in sorted({0, 1, k // 2, k - 1, k}):
        rt = target.runtime(rollback=k + 2)
        rt.prefill(prompt, logits="none")
        rt.verify(block)
        rt.trim(k - n)
        ref = target.runtime()
        ref.prefill(prompt, logits="none")
        ref.forward(block[: n + 1], logits="none")
        assert_same_states(recurrent_states(rt), recurrent_states(ref))
        nxt = random_prompt(3, seed=2)
        assert mx.allclose(rt.forward(nxt).logits, ref.forward(nxt).logits, atol=1e-4).item()


@pytest.mark.parametrize("arch", HYBRIDS)
def test_trims_across_several_forwards_and_twice_into_one_are_exact(arch):
    """Layer skip drafts with single-token forwards, then trims them all; a
    draft model trims into its last block more than once."""
    target = tiny_target(arch)
    prompt, more = random_prompt(9), random_prompt(12, seed=3)
    rt = target.runtime(rollback=20)
    rt.prefill(prompt, logits="none")
    for t in more[:3]:
        rt.decode(t)
    rt.forward(more[3:9], logits="none")
    rt.trim(7)  # all of the 6-token forward and one decode
    rt.forward(more[3:9], logits="none")
    rt.trim(2)
    rt.trim(1)  # into the same forward again
    ref = target.runtime()
    ref.prefill(prompt + more[:2] + more[3:6], logits="none")
    assert_same_states(recurrent_states(rt), recurrent_states(ref))


def test_mlx_lm_alone_cannot_roll_recurrent_state_back():
    """The state a trim must restore differs from what mlx-lm's own trim leaves."""
    target = tiny_target("qwen3_next")
    prompt, block = random_prompt(10), random_prompt(6, seed=1)
    rt = target.runtime()
    rt.prefill(prompt + block, logits="none")
    trim_prompt_cache(rt.cache, 5)  # trims the KV caches; recurrent state stays put
    ref = target.runtime()
    ref.prefill(prompt + block[:1], logits="none")
    assert not all(
        mx.allclose(g, w, atol=ATOL).item() for g, w in zip(recurrent_states(rt), recurrent_states(ref))
    )


def test_rolling_back_past_the_recorded_positions_is_refused():
    target = tiny_target("lfm2")
    rt = target.runtime(rollback=4)
    rt.prefill(random_prompt(10), logits="none")
    rt.forward(random_prompt(3), logits="none")
    with pytest.raises(RuntimeError, match="cannot roll recurrent state back"):
        rt.trim(5)


def run(target, prompt, method, k, n=32, **kw):
    return hf2q_py.generate(target, prompt, max_tokens=n, method=method, k=k, adaptive=False, **kw)


def method_options(arch, method, target):
    if method == "draft":
        return {
            "draft": perturbed_target(arch, scale=1.5, noise=0.02),
            **UNGATED,
        }
    if method == "layerskip":
        return {"skip_layers": [2]}
    if method == "dflash":
        return {"drafter": drafter_for(target, layers=1, target_layer_ids=[0, 2], block_size=17)}
    return {}


@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("method", ["ngram", "draft", "layerskip", "dflash"])
@pytest.mark.parametrize("k", [1, 16])
def test_every_method_matches_mlx_lm_greedy_on_hybrids(arch, method, k):
    target = tiny_target(arch, scale=1.5)
    prompt = random_prompt(6) * 3  # repeats: n-gram drafts
    want = reference_greedy(target.model, prompt, 32)
    if method == "layerskip" and arch == "nemotron_h":
        with pytest.raises(UnsupportedModelError, match="one cache per layer"):
            run(target, prompt, method, k, **method_options(arch, method, target))
        return
    r = run(target, prompt, method, k, **method_options(arch, method, target))
    assert_same_greedy(target.model, prompt, r.tokens, want)
    assert r.stats.drafted > 0


@pytest.mark.parametrize("arch", HYBRIDS)
def test_a_close_draft_model_accepts_part_of_its_blocks(arch):
    """Rollback is exercised at every accepted length, not only at 0 or K."""
    target = tiny_target(arch, scale=1.5)
    prompt = random_prompt(12)
    want = reference_greedy(target.model, prompt, 48)
    r = run(
        target,
        prompt,
        "draft",
        6,
        n=48,
        draft=perturbed_target(arch, scale=1.5, noise=0.02),
        **UNGATED,
    )
    assert_same_greedy(target.model, prompt, r.tokens, want)
    assert 0.2 < r.stats.acceptance_rate < 0.95


def test_eos_and_budget_inside_an_accepted_block_on_a_hybrid():
    target = tiny_target("qwen3_5", scale=1.5)
    prompt = random_prompt(10)
    free = reference_greedy(target.model, prompt, 40)
    i = next(i for i in range(3, 40) if free[i] not in free[:i])
    for n in (1, 5, 9, 17):
        r = run(target, prompt, "draft", 8, n=n, draft=target)
        assert r.tokens == free[:n]
    target.eos_token_ids = {free[i]}
    r = run(target, prompt, "draft", 8, n=40, draft=target)
    assert r.tokens == free[:i] and r.stats.finish_reason == "stop"
