"""What makes a DFlash drafter pay: a reduced draft vocabulary (drafting only
among frequent tokens, output unchanged), batched self-distillation (the
same answers, several at a time) and a warm start from the target's layers."""

import json

import mlx.core as mx
import pytest
from helpers import assert_same_greedy, reference_greedy
from models import VOCAB, random_prompt, tiny_target

import hf2q_py
from hf2q_py.draft_length import FixedK
from hf2q_py.engine import generate_tokens
from hf2q_py.errors import Hf2qError, ModelLoadError
from hf2q_py.proposers.dflash import DFlashProposer
from hf2q_py.proposers.dflash_drafter import DraftVocab, TargetHead, load_drafter
from hf2q_py.tools.dflash_make import drafter_for, frequency_vocab, save_drafter, warm_start_from
from hf2q_py.tools.dflash_data import batched_greedy
from hf2q_py.tools.dflash_train import TrainConfig, train


class Recording(DFlashProposer):
    """Keeps every draft it proposes."""

    def __init__(self, target, drafter):
        super().__init__(target, drafter)
        self.drafted: list[int] = []

    def propose(self, tokens, k):
        d = super().propose(tokens, k)
        self.drafted += d.tokens
        return d


def with_vocab(target, size, seed=1):
    drafter = drafter_for(target, layers=1, block_size=8, target_layer_ids=[0, 2], seed=seed)
    text = [random_prompt(40, seed=s) for s in range(3)]
    drafter.vocab = frequency_vocab(text, size, target.vocab_size)
    return drafter


# -- the reduced vocabulary ------------------------------------------------------------


def test_the_vocabulary_ranks_tokens_by_frequency_and_tops_up_in_id_order():
    v = frequency_vocab([[5, 5, 9, 9, 9, 2], [5, 7]], 6, 12)
    assert v.token_ids == [
        5,
        9,
        2,
        7,
        0,
        1,
    ]  # 5 and 9 three times (lower id first), then once each, then unseen
    assert v.index.tolist()[9] == 1 and v.index.tolist()[3] == -1
    full = v.to_full(mx.arange(6, dtype=mx.float32)[None])[0].tolist()
    assert full[5] == 0 and full[9] == 1 and full[1] == 5 and full[3] == float("-inf")


@pytest.mark.parametrize("ids", [[], [1, 1], [0, VOCAB]])
def test_bad_vocabularies_are_refused(ids):
    with pytest.raises(Hf2qError):
        DraftVocab(ids, VOCAB)


def test_the_draft_head_scores_the_chosen_rows_of_the_target_head():
    target = tiny_target("llama")
    vocab = DraftVocab([7, 3, 100], target.vocab_size)
    h = mx.random.normal((2, target.hidden_size))
    head, sub = TargetHead(target), TargetHead(target, vocab=vocab)
    assert mx.allclose(sub.draft_logits(h), head.logits(h)[:, mx.array([7, 3, 100])], atol=1e-5).item()
    assert mx.allclose(sub.logits(h), head.logits(h)).item()  # verification keeps the whole head


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_reduced_vocabulary_drafter_is_lossless_and_drafts_only_its_tokens(arch):
    target = tiny_target(arch, scale=1.5)
    drafter = with_vocab(target, 24)
    prompt = random_prompt(12, seed=4)
    want = reference_greedy(target.model, prompt, 40)
    for k in (1, 7):
        p = Recording(target, drafter)
        got = [
            t
            for new in generate_tokens(target, prompt, max_tokens=40, proposer=p, policy=FixedK(k))
            for t in new
        ]
        assert_same_greedy(target.model, prompt, got, want)
        assert p.drafted and set(p.drafted) <= set(drafter.vocab.token_ids)


def test_the_vocabulary_travels_with_the_drafter_folder(tmp_path):
    target = tiny_target("llama")
    drafter = with_vocab(target, 16)
    save_drafter(drafter, tmp_path / "d")
    assert (
        json.loads((tmp_path / "d" / "draft_vocab.json").read_text())["token_ids"] == drafter.vocab.token_ids
    )
    again = load_drafter(tmp_path / "d")
    assert again.vocab.token_ids == drafter.vocab.token_ids
    r = hf2q_py.generate(
        target,
        random_prompt(10),
        max_tokens=20,
        method="dflash",
        drafter=str(tmp_path / "d"),
        adaptive=False,
        k=4,
    )
    assert r.tokens == reference_greedy(target.model, random_prompt(10), 20)
    drafter.vocab = None  # saving a full-vocabulary drafter over it removes the file
    save_drafter(drafter, tmp_path / "d")
    assert load_drafter(tmp_path / "d").vocab is None


@pytest.mark.parametrize(
    "text", ["[1, 2", '{"token_ids": [1, "x"]}', '{"token_ids": [1, 1]}', '{"ids": [1]}']
)
def test_malformed_vocabulary_files_are_refused(tmp_path, text):
    target = tiny_target("llama")
    save_drafter(with_vocab(target, 8), tmp_path / "d")
    (tmp_path / "d" / "draft_vocab.json").write_text(text)
    with pytest.raises(ModelLoadError, match="draft vocabulary|draft_vocab"):
        load_drafter(tmp_path / "d")


def test_training_with_a_draft_vocabulary_ranks_the_training_answers(tmp_path):
    target = tiny_target("llama", scale=3.0)
    rows = []
    for i in range(6):
        p = random_prompt(8, seed=i)
        rows.append(
            {"prompt_tokens": len(p), "tokens": p + hf2q_py.generate(target, p, max_tokens=30).tokens}
        )
    cfg = TrainConfig(
        out=str(tmp_path / "d"),
        steps=20,
        eval_every=10,
        checkpoint_every=10,
        holdout=1,
        block_size=4,
        samples=6,
        target_layer_ids=[1, 2],
        draft_vocab=20,
    )
    drafter = train(target, cfg, rows, progress=False)
    assert drafter.vocab.token_ids == frequency_vocab([r["tokens"] for r in rows[1:]], 20, VOCAB).token_ids
    assert load_drafter(tmp_path / "d").vocab.token_ids == drafter.vocab.token_ids
    cfg.steps, cfg.draft_vocab = 30, 10
    with pytest.raises(Hf2qError, match="draft-vocab"):
        train(target, cfg, rows, progress=False)  # resuming with another vocabulary size is refused


# -- batched self-distillation -------------------------------------------------


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
        assert row["tokens"] == ids + hf2q_py.generate(target, ids, max_tokens=10).tokens


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


def test_an_empty_prompt_is_refused():
    with pytest.raises(Hf2qError, match="empty prompt"):
        batched_greedy(tiny_target("llama"), [[1, 2], []], max_new_tokens=4, batch_size=2)


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
        assert row["tokens"] == ids + hf2q_py.generate(target, ids, max_tokens=8).tokens
    assert [x.split(":")[0] for x in lines] == ["data 8/10", "data 10/10"]


def test_training_uses_the_features_captured_during_generation(tmp_path, monkeypatch):
    """Rows generated with capture train without a second target pass; rows
    captured at other layers (or read back from the file) get one."""
    from hf2q_py.tools import dflash_data, dflash_train

    target = tiny_target("llama", scale=1.5, tokenizer=True)
    prompts = ["abc", "hello there", "x y z", "a longer prompt", "zz top"]
    rows = dflash_data.self_distill(
        target, prompts, tmp_path / "data.jsonl", max_new_tokens=12, batch_size=2, capture_layers=[0, 2]
    )
    assert all(r["captured"].layer_ids == (0, 2) for r in rows)
    assert "captured" not in (tmp_path / "data.jsonl").read_text()
    passes = []
    real_pass = dflash_train.target_pass
    monkeypatch.setattr(dflash_train, "target_pass", lambda *a: passes.append(a) or real_pass(*a))
    cfg = TrainConfig(
        out=str(tmp_path / "d"), steps=2, eval_every=2, checkpoint_every=2, holdout=1, block_size=4, samples=5
    )
    train(target, replace_layers(cfg, [0, 2]), rows, progress=False)
    assert passes == []
    train(target, replace_layers(cfg, [1, 2], out=str(tmp_path / "e")), rows, progress=False)
    usable = [r for r in rows if len(r["tokens"]) - r["prompt_tokens"] >= 2]  # train() skips the others
    assert len(passes) == len(usable) >= 3


def replace_layers(cfg, layers, **kw):
    from dataclasses import replace

    return replace(cfg, target_layer_ids=layers, **kw)


# -- warm start ----------------------------------------------------------------


def test_a_warm_start_copies_the_target_s_last_layers():
    target = tiny_target("llama")
    drafter = drafter_for(target, layers=2, block_size=4, target_layer_ids=[0, 1], warm_start=True)
    L = target.num_layers
    for i, mine in enumerate(drafter.layers):
        theirs = target.layers[L - 2 + i]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert mx.array_equal(
                getattr(mine.self_attn, name).weight, getattr(theirs.self_attn, name).weight
            ).item()
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert mx.array_equal(getattr(mine.mlp, name).weight, getattr(theirs.mlp, name).weight).item()
        assert mx.array_equal(mine.input_layernorm.weight, theirs.input_layernorm.weight).item()
        assert mx.array_equal(mine.self_attn.q_norm.weight, mx.ones_like(mine.self_attn.q_norm.weight)).item()
    cold = drafter_for(target, layers=2, block_size=4, target_layer_ids=[0, 1])
    assert mx.array_equal(cold.fc.weight, drafter.fc.weight).item()  # fc keeps its (seeded) initialisation
    assert not mx.array_equal(cold.layers[0].mlp.up_proj.weight, drafter.layers[0].mlp.up_proj.weight).item()


def test_a_warm_start_skips_tensors_whose_shapes_or_biases_differ():
    """qwen2's q/k/v projections carry biases the drafter's lack: they keep
    their initialisation, like a tensor whose shape differs."""
    target = tiny_target("qwen2")
    drafter = drafter_for(target, layers=1, block_size=4, target_layer_ids=[0, 1])
    drafter.layers[0].mlp.up_proj.weight = mx.zeros((8, target.hidden_size))  # not the target's shape
    copied = warm_start_from(drafter, target)
    assert "layers.0.self_attn.o_proj.weight" in copied and "layers.0.mlp.down_proj.weight" in copied
    assert "layers.0.mlp.up_proj.weight" not in copied and "layers.0.self_attn.q_proj.weight" not in copied


def test_training_features_cover_sequences_longer_than_a_prefill_chunk(monkeypatch):
    """The target pass runs in chunks; every position keeps its features,
    final state and greedy-agreement flag."""
    from hf2q_py import target as target_module
    from hf2q_py.tools.dflash_train import target_pass

    target = tiny_target("llama", scale=1.5)
    prompt = random_prompt(6)
    tokens = prompt + reference_greedy(target.model, prompt, 20)
    whole = target_pass(target, tokens, [0, 2])
    monkeypatch.setattr(target_module, "PREFILL_CHUNK", 7)
    chunked = target_pass(target, tokens, [0, 2])
    assert chunked[0].shape == whole[0].shape == (1, 26, 2 * target.hidden_size)
    assert mx.allclose(chunked[0].astype(mx.float32), whole[0].astype(mx.float32), atol=1e-2).item()
    assert chunked[1].tolist() == whole[1].tolist() and all(chunked[1].tolist()[6:])  # the answer is greedy
    assert chunked[2].shape == whole[2].shape


@pytest.mark.parametrize("bad", [dict(draft_vocab=0), dict(gen_batch=0), dict(warm_start="yes")])
def test_the_new_training_options_are_checked(bad):
    with pytest.raises(Hf2qError):
        TrainConfig(out="x", **bad).validate()


def test_a_draft_vocabulary_larger_than_the_target_s_is_refused_before_any_data_is_made():
    with pytest.raises(Hf2qError, match="draft-vocab"):
        TrainConfig(out="x", draft_vocab=VOCAB + 1).check_target(tiny_target("llama"))
