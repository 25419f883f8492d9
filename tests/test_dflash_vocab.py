"""A DFlash drafter's reduced draft vocabulary: chosen by token frequency, scored
with the chosen rows of the target's head, saved with the drafter and chosen
from the training answers; drafts come from it only, and the output is unchanged."""

import json

import mlx.core as mx
import pytest
from helpers import assert_same_greedy, reference_greedy
from models import VOCAB, random_prompt, tiny_target

import hf2q_py
from hf2q_py.draft_length import FixedK
from hf2q_py.generation import generate_tokens
from hf2q_py.errors import Hf2qError, ModelLoadError
from hf2q_py.proposers.dflash import DFlashProposer
from hf2q_py.proposers.dflash_drafter import DraftVocab, TargetHead, load_drafter
from hf2q_py.tools.dflash_make import drafter_for, frequency_vocab, save_drafter
from hf2q_py.tools.dflash_train import TrainConfig, train


class Recording(DFlashProposer):
    """Keeps every draft it proposes."""

    def __init__(self, target, drafter):
        super().__init__(target, drafter)
        self.drafted: list[int] = []

    def propose(self, tokens, k):
        d = super().propose(tokens, k)
        self.drafted += d.ids()
        return d


def with_vocab(target, size, seed=1):
    drafter = drafter_for(target, layers=1, block_size=8, target_layer_ids=[0, 2], seed=seed)
    text = [random_prompt(40, seed=s) for s in range(3)]
    drafter.vocab = frequency_vocab(text, size, target.vocab_size)
    return drafter


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


@pytest.mark.parametrize(
    "text", ["[1, 2", '{"token_ids": [1, "x"]}', '{"token_ids": [1, 1]}', '{"ids": [1]}']
)
def test_malformed_vocabulary_files_are_refused(tmp_path, text):
    target = tiny_target("llama")
    save_drafter(with_vocab(target, 8), tmp_path / "d")
    (tmp_path / "d" / "draft_vocab.json").write_text(text)
    with pytest.raises(ModelLoadError, match="draft vocabulary|draft_vocab"):
        load_drafter(tmp_path / "d")


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


def test_training_with_a_draft_vocabulary_ranks_the_training_answers(tmp_path):
    target = tiny_target("llama", scale=3.0)
    rows = []
    for i in range(6):
        p = random_prompt(8, seed=i)
        rows.append(
            {
                "prompt_tokens": len(p),
                "tokens": p + hf2q_py.generate(target, p, max_tokens=30, method="baseline").tokens,
            }
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
