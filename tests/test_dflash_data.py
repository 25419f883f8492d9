"""Self-distilled DFlash training data (``tools.dflash_data``): batched greedy
answers equal one-at-a-time ones, prompts enter and prefill together in an order
that wastes little, the features captured while generating equal a separate
training pass, and the data file is written in prompt order and resumed."""

import json

import mlx.core as mx
import pytest
from helpers import assert_same_greedy, reference_greedy
from models import random_prompt, tiny_target

import hf2q_py
from hf2q_py.errors import Hf2qError
from hf2q_py.tools.dflash_data import batched_greedy


def test_batched_answers_equal_one_at_a_time_greedy_answers():
    """Prompts of different lengths (left padding), rows finishing at their own
    EOS while others go on, more prompts than batch rows."""
    target = tiny_target("llama", scale=1.5)
    prompts = [random_prompt(n, seed=n) for n in (3, 11, 7, 20, 5)]
    single = [reference_greedy(target.model, p, 24) for p in prompts]
    eos = single[1][6]  # one row stops early at this token
    target.eos_token_ids = {eos}
    want = [s[: s.index(eos)] if eos in s else s for s in single]
    assert any(len(w) < 24 for w in want) and any(len(w) == 24 for w in want)
    for batch in (1, 2, 8):
        got = batched_greedy(target, prompts, max_new_tokens=24, batch_size=batch)
        for p, g, w in zip(prompts, got, want):
            assert_same_greedy(target.model, p, g, w)


def test_an_empty_prompt_is_refused():
    with pytest.raises(Hf2qError, match="empty prompt"):
        batched_greedy(tiny_target("llama"), [[1, 2], []], max_new_tokens=4, batch_size=2)


def test_prompts_enter_window_by_window_longest_first():
    from hf2q_py.tools.dflash_data import entry_order

    prompts = [[0] * n for n in (3, 9, 1, 4, 7, 2)]
    assert entry_order(prompts, 4) == [1, 3, 0, 2, 4, 5]
    assert entry_order(prompts, 1) == list(range(6))


def test_prompts_prefill_together_only_with_little_padding():
    from hf2q_py.tools.dflash_data import length_groups

    prompts = [[0] * n for n in (100, 5, 96, 40, 99, 6, 60)]
    assert length_groups(range(7), prompts) == [[1, 5], [3], [6], [2, 4, 0]]


def test_answers_are_the_same_with_and_without_capture():
    from hf2q_py.tools.dflash_data import batched_answers

    target = tiny_target("llama", scale=1.5)
    prompts = [random_prompt(n, seed=n) for n in (3, 8, 5)]
    plain = batched_greedy(target, prompts, max_new_tokens=10, batch_size=2)
    got = batched_answers(target, prompts, max_new_tokens=10, batch_size=2, capture_layers=[1])
    assert [a.tokens for a in got] == plain


@pytest.mark.parametrize("batch", [1, 3])
def test_features_captured_while_generating_equal_the_training_pass(batch):
    """Hidden states, final states and greedy-agreement flags taken from the
    generating forwards (prefill + decode steps, rows refilled, some rows
    ending at EOS, others at the budget) equal those of one separate target
    pass over prompt + answer."""
    from hf2q_py.tools.dflash_data import GenerationTimes, batched_answers
    from hf2q_py.tools.dflash_train import target_pass

    target = tiny_target("llama", scale=1.5)
    prompts = [random_prompt(n, seed=n) for n in (1, 9, 4, 15, 16, 14, 6)]  # 14-16 prefill together
    plain = batched_greedy(target, prompts, max_new_tokens=12, batch_size=batch)
    target.eos_token_ids = {plain[1][4]}
    times = GenerationTimes()
    got = batched_answers(
        target, prompts, max_new_tokens=12, batch_size=batch, capture_layers=[0, 2], times=times
    )
    assert [len(a.tokens) for a in got].count(12) < len(got)  # some rows stopped at EOS
    assert times.steps > 0 and times.decode > 0 and times.prefill_tokens >= sum(len(p) - 1 for p in prompts)
    for p, a in zip(prompts, got):
        feats, agrees, finals = target_pass(target, p + a.tokens, [0, 2])
        assert a.features.shape == feats.shape and a.finals.shape == finals.shape
        assert mx.allclose(a.features.astype(mx.float32), feats.astype(mx.float32), atol=1e-2).item()
        assert mx.allclose(a.finals.astype(mx.float32), finals.astype(mx.float32), atol=1e-2).item()
        assert a.agrees.tolist() == agrees.tolist()


def test_self_distill_writes_answers_in_prompt_order_and_resumes(tmp_path):
    from hf2q_py.tools import dflash_data

    target = tiny_target("llama", scale=1.5, tokenizer=True)
    prompts = ["abc", "hello there", "x", "a longer prompt", "zz"]
    path = tmp_path / "data.jsonl"
    rows = dflash_data.self_distill(target, prompts[:3], path, max_new_tokens=10, batch_size=2)
    rows = dflash_data.self_distill(
        target, prompts, path, max_new_tokens=10, batch_size=4
    )  # answers only 2 more
    assert len(path.read_text().splitlines()) == 5
    from hf2q_py.generation import encode_prompt

    for prompt, row in zip(prompts, rows):
        ids = encode_prompt(target, prompt, True)
        assert row["prompt_tokens"] == len(ids)
        assert row["tokens"] == ids + hf2q_py.generate(target, ids, max_tokens=10, method="baseline").tokens


def test_self_distill_streams_windows_and_writes_each_row_in_prompt_order(tmp_path):
    """Ten prompts at batch 2 run as one continuous batch over two windows
    of 8 (longest first within each); the file is in prompt order."""
    from hf2q_py.generation import encode_prompt
    from hf2q_py.tools import dflash_data

    target = tiny_target("llama", scale=1.5, tokenizer=True)
    prompts = [("abcdefghij" * 3)[: 1 + (7 * k) % 23] for k in range(10)]
    path = tmp_path / "data.jsonl"
    lines = []
    rows = dflash_data.self_distill(
        target, prompts, path, max_new_tokens=8, batch_size=2, log=lambda s: lines.append(s)
    )
    assert [json.loads(x) for x in path.read_text().splitlines()] == rows
    for prompt, row in zip(prompts, rows):
        ids = encode_prompt(target, prompt, True)
        assert row["tokens"] == ids + hf2q_py.generate(target, ids, max_tokens=8, method="baseline").tokens
    assert [x.split(":")[0] for x in lines] == ["data 8/10", "data 10/10"]
