"""The runtime: forwards match mlx-lm, captures are free riders, trims are exact."""

import random

import mlx.core as mx
import pytest
from models import ARCHS, HYBRIDS, SLIDING, random_prompt, tiny_model, tiny_target

from hf2q_py.cache import SlidingWindowCache
from hf2q_py.errors import UnsupportedModelError
from hf2q_py.target import Target

ATOL = 2e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_equal_a_plain_mlx_lm_forward(arch):
    target = tiny_target(arch)
    prompt = random_prompt(40)
    want = target.model(mx.array([prompt]))[0]
    got = target.runtime().prefill(prompt, logits="all").logits
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=ATOL).item()


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_after_prefill_equals_full_forward(arch):
    target = tiny_target(arch)
    prompt = random_prompt(30)
    rt = target.runtime()
    rt.prefill(prompt[:-1], logits="none")
    last = rt.decode(prompt[-1]).logits
    want = target.model(mx.array([prompt]))[0, -1:]
    assert mx.allclose(last, want, atol=ATOL).item()
    assert rt.offset == len(prompt)


def test_last_position_logits_only_compute_the_head_once():
    target = tiny_target("llama")
    out = target.runtime().prefill(random_prompt(20), logits="last")
    assert out.logits.shape == (1, target.vocab_size)


@pytest.mark.parametrize("arch", ["llama", "gemma4_text"])
def test_capture_returns_layer_outputs_from_the_same_forward(arch):
    target = tiny_target(arch)
    prompt = random_prompt(12)
    out = target.runtime().prefill(prompt, logits="all", capture_layers=(0, 2), capture_final=True)
    assert set(out.hidden) == {0, 2}
    H = target.hidden_size
    assert out.hidden[0].shape == (1, 12, H)
    assert out.final.shape == (1, 12, H)
    # the final hidden state is the LM head's input
    want = target.model(mx.array([prompt]))[0]
    head = target.model.model.embed_tokens.as_linear(out.final)[0]
    if arch == "gemma4_text":
        head = mx.tanh(head / 30.0) * 30.0
    assert mx.allclose(head, want, atol=ATOL).item()
    # capture leaves the model untouched
    assert all(type(l).__name__ != "_Tap" for l in target.model.layers)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", range(4))
def test_trim_then_extend_equals_a_fresh_prefill(arch, seed):
    """prefill(A+B); trim(len(B)); prefill(C) == prefill(A+C), A far past the window.
    Recurrent state rolls back within short forwards only: hybrids get A, then B."""
    rng = random.Random(seed)
    target = tiny_target(arch)
    a = random_prompt(rng.choice([5, 17, 40, 70]), seed)
    b = random_prompt(rng.randint(1, 12), seed + 100)
    c = random_prompt(rng.randint(1, 12), seed + 200)
    rt = target.runtime()
    if arch in HYBRIDS:
        rt.prefill(a, logits="none")
        rt.prefill(b, logits="none")
    else:
        rt.prefill(a + b, logits="none")
    rt.trim(len(b))
    got = rt.prefill(c, logits="all").logits
    fresh = target.runtime().prefill(a + c, logits="all").logits[len(a) :]
    assert mx.allclose(got, fresh, atol=ATOL).item()


@pytest.mark.parametrize("arch", SLIDING)
def test_many_decode_trim_cycles_past_the_window_stay_exact(arch):
    """Speculation's pattern: verify k+1, trim the rejected, repeat, far past the window."""
    rng = random.Random(7)
    target = tiny_target(arch)
    seq = random_prompt(10, 1)
    rt = target.runtime()
    rt.prefill(seq[:-1], logits="none")
    while len(seq) < 90:
        drafts = random_prompt(rng.randint(0, 6), len(seq))
        got = rt.verify([seq[-1], *drafts]).logits
        keep = rng.randint(0, len(drafts))
        rt.trim(len(drafts) - keep)
        want = target.model(mx.array([seq + drafts]))[0, len(seq) - 1 :]
        assert mx.allclose(got, want, atol=ATOL).item(), f"at length {len(seq)}"
        seq += drafts[:keep] + [rng.randrange(target.vocab_size)]


def test_sliding_cache_refuses_a_trim_beyond_its_slack():
    cache = SlidingWindowCache(window=4, slack=2)
    for _ in range(100):  # 300 positions: past the buffer, so old ones were dropped
        k = mx.zeros((1, 1, 3, 2))
        cache.update_and_fetch(k, k)
    with pytest.raises(RuntimeError, match="slack"):
        cache.trim(cache.offset)
    # the last update plus the slack can always be taken back
    assert cache.trim(3 + 2) == 5


def test_recurrent_caches_without_a_convolution_state_are_refused_up_front():
    from mlx_lm.models.cache import ArraysCache

    model = tiny_model("llama")
    model.make_cache = lambda: [ArraysCache(2) for _ in model.layers]
    with pytest.raises(UnsupportedModelError, match="cannot roll back"):
        Target.from_mlx_lm(model).runtime()


def test_caches_of_unknown_kinds_are_refused_up_front():
    from mlx_lm.models.cache import ChunkedKVCache

    model = tiny_model("llama")
    model.make_cache = lambda: [ChunkedKVCache(8) for _ in model.layers]
    with pytest.raises(UnsupportedModelError, match="ChunkedKVCache layer cache, which cannot be trimmed"):
        Target.from_mlx_lm(model).runtime()
