"""The prompt cache: a prompt that extends an earlier one starts from the
saved state of the longest prefix that can be rebuilt exactly, and the
output equals a generation from scratch on every cache kind."""

import mlx.core as mx
import pytest
from helpers import assert_same_greedy
from models import random_prompt, tiny_target

import hf2q_py
from hf2q_py.errors import Hf2qError
from hf2q_py.prompt_cache import PromptCache

#: Full attention, sliding windows of 16 (the prompts run past them), Gemma 4's
#: shared KV, and hybrids whose recurrent state cannot be cut back.
ARCHS = ("llama", "gemma3_text", "gemma4_text", "qwen3_next", "lfm2")


def cached_target(arch: str, **bounds) -> hf2q_py.Target:
    target = tiny_target(arch, scale=4.0)
    target.prompt_cache = PromptCache(**bounds)
    return target


def fresh(arch: str, prompt: list[int], n: int, method: str = "baseline") -> list[int]:
    return hf2q_py.generate(tiny_target(arch, scale=4.0), prompt, max_tokens=n, method=method).tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_a_follow_up_turn_reuses_the_whole_earlier_conversation_and_matches_a_fresh_generation(arch):
    target = cached_target(arch)
    prompt = random_prompt(40)
    first = hf2q_py.generate(target, prompt, max_tokens=12, method="ngram")
    assert first.stats.cached_tokens == 0
    follow_up = prompt + first.tokens + random_prompt(9, seed=3)
    second = hf2q_py.generate(target, follow_up, max_tokens=12, method="ngram")
    assert second.stats.cached_tokens == len(prompt) + len(first.tokens) - 1
    assert_same_greedy(target.model, follow_up, second.tokens, fresh(arch, follow_up, 12))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_retried_request_reuses_its_whole_prompt_and_gives_the_same_answer(arch):
    target = cached_target(arch)
    prompt = random_prompt(40, seed=1)
    first = hf2q_py.generate(target, prompt, max_tokens=10, method="baseline")
    again = hf2q_py.generate(target, prompt, max_tokens=10, method="baseline")
    assert again.stats.cached_tokens == len(prompt) - 1
    assert again.tokens == first.tokens


@pytest.mark.parametrize(
    ("arch", "length", "shared", "reused"),
    [
        ("llama", 30, 20, 20),  # full attention is cut back to any prefix
        ("qwen3_next", 40, 20, 0),  # a recurrent state is never cut back
        ("gemma3_text", 800, 400, 0),  # the sliding windows (16) dropped the history before ~430
        ("gemma3_text", 40, 30, 30),  # ... but still hold it in a short conversation
    ],
)
def test_a_diverging_prompt_reuses_a_shared_prefix_only_where_its_state_is_held(arch, length, shared, reused):
    target = cached_target(arch)
    prompt = random_prompt(length)
    hf2q_py.generate(target, prompt, max_tokens=8, method="baseline")
    other = prompt[:shared] + random_prompt(10, seed=7)
    result = hf2q_py.generate(target, other, max_tokens=8, method="baseline")
    assert result.stats.cached_tokens == reused
    assert_same_greedy(target.model, other, result.tokens, fresh(arch, other, 8))


def test_every_method_and_sampling_leave_states_that_later_requests_reuse_exactly():
    target = cached_target("llama")
    prompt = random_prompt(24)
    hf2q_py.generate(target, prompt, max_tokens=10, method="baseline")
    for method, opts in (("ngram", {}), ("layerskip", {"skip_layers": [1]}), ("baseline", {})):
        got = hf2q_py.generate(target, prompt, max_tokens=10, method=method, **opts)
        assert got.stats.cached_tokens == len(prompt) - 1
        assert_same_greedy(target.model, prompt, got.tokens, fresh("llama", prompt, 10))
    sampled = [
        hf2q_py.generate(target, prompt, max_tokens=10, method="ngram", temperature=0.8, seed=5).tokens
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


def test_a_stream_closed_early_leaves_a_state_that_is_reused():
    target = cached_target("llama")
    prompt = random_prompt(24)
    stream = hf2q_py.stream_generate(target, prompt, max_tokens=20, method="baseline")
    got = next(stream).tokens
    stream.close()
    follow_up = prompt + got + random_prompt(5, seed=2)
    result = hf2q_py.generate(target, follow_up, max_tokens=6, method="baseline")
    assert result.stats.cached_tokens == len(prompt) + len(got) - 1
    assert_same_greedy(target.model, follow_up, result.tokens, fresh("llama", follow_up, 6))


def test_the_cache_keeps_at_most_its_entries_and_bytes_least_recently_used_out():
    target = cached_target("llama", max_entries=2)
    prompts = [random_prompt(20, seed=s) for s in range(3)]
    for p in prompts:
        hf2q_py.generate(target, p, max_tokens=4, method="baseline")
    cache = target.prompt_cache
    assert len(cache) == 2 and cache.stats.evicted == 1
    assert hf2q_py.generate(target, prompts[0], max_tokens=4, method="baseline").stats.cached_tokens == 0
    assert hf2q_py.generate(target, prompts[2], max_tokens=4, method="baseline").stats.cached_tokens == 19

    one = cache.nbytes // len(cache)
    small = cached_target("llama", max_bytes=int(one * 1.5))
    for p in prompts:
        hf2q_py.generate(small, p, max_tokens=4, method="baseline")
    assert len(small.prompt_cache) == 1 and small.prompt_cache.nbytes <= int(one * 1.5)


def test_a_longer_conversation_replaces_the_prefix_it_can_rebuild():
    target = cached_target("llama")
    prompt = random_prompt(20)
    first = hf2q_py.generate(target, prompt, max_tokens=6, method="baseline")
    hf2q_py.generate(target, prompt + first.tokens + [5, 6], max_tokens=6, method="baseline")
    assert len(target.prompt_cache) == 1


def test_a_saved_state_is_not_changed_by_the_generations_that_start_from_it():
    target = cached_target("gemma3_text")
    prompt = random_prompt(40)
    hf2q_py.generate(target, prompt, max_tokens=6, method="baseline")
    ((snap, _),) = target.prompt_cache._entries.values()
    before = [mx.array(a) for layer in snap.layers for a in layer.arrays]
    for seed in (1, 2):
        hf2q_py.generate(target, prompt + random_prompt(30, seed=seed), max_tokens=6, method="baseline")
    after = [a for layer in snap.layers for a in layer.arrays]
    assert all(mx.array_equal(b, a).item() for b, a in zip(before, after))


def test_dflash_which_reads_the_prompts_hidden_states_prefills_the_whole_prompt():
    from hf2q_py.tools.dflash_make import drafter_for

    target = cached_target("llama")
    prompt = random_prompt(24)
    hf2q_py.generate(target, prompt, max_tokens=4, method="baseline")
    got = hf2q_py.generate(target, prompt, max_tokens=4, method="dflash", drafter=drafter_for(target))
    assert got.stats.cached_tokens == 0


@pytest.mark.parametrize("bounds", [{"max_entries": 0}, {"max_bytes": -1}, {"max_entries": 1.5}])
def test_bad_bounds_are_refused(bounds):
    with pytest.raises(Hf2qError, match="prompt cache"):
        PromptCache(**bounds)
