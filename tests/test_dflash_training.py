"""DFlash training (``train-dflash``, ``tools.dflash_train``): options are checked
before a model loads or data is made, a model folder is never overwritten, a
run resumes only as the same run; training sees what inference sees, lowers
the loss, resumes, stops on a time budget, uses the features captured while
generating, and warm-starts from the target's last layers."""

import json

import mlx.core as mx
import pytest
from helpers import assert_one_line_error, cli, reference_greedy
from models import VOCAB, random_prompt, tiny_target

import hf2q_py
from hf2q_py.draft_length import MAX_K
from hf2q_py.errors import Hf2qError
from hf2q_py.proposers.dflash import DFlashProposer
from hf2q_py.proposers.dflash_drafter import TargetHead, load_drafter
from hf2q_py.tools.cli import main
from hf2q_py.tools.dflash_make import drafter_for, warm_start_from
from hf2q_py.tools.dflash_train import (
    TrainConfig,
    TrainSequence,
    accepted_lengths,
    block_batch,
    target_features,
    train,
)


def test_training_options_are_checked():
    with pytest.raises(Hf2qError, match="ce-positions"):
        TrainConfig(out="x", ce_positions=-1).validate()
    with pytest.raises(Hf2qError, match="nothing would be trained"):
        TrainConfig(out="x", ce_positions=0, hidden_weight=0.0).validate()
    with pytest.raises(Hf2qError, match="holdout"):
        TrainConfig(out="x", samples=4, holdout=4).validate()
    with pytest.raises(Hf2qError, match="max-minutes"):
        TrainConfig(out="x", max_minutes=-1).validate()


@pytest.mark.parametrize("bad", [dict(draft_vocab=0), dict(gen_batch=0), dict(warm_start="yes")])
def test_draft_vocab_gen_batch_and_warm_start_options_are_checked(bad):
    with pytest.raises(Hf2qError):
        TrainConfig(out="x", **bad).validate()


def test_train_dflash_cli_rejects_bad_options(capsys, tmp_path):
    assert main(["train-dflash", "--out", str(tmp_path), "--target-layers", "1,x"]) == 2
    assert "--target-layers" in capsys.readouterr().err
    assert main(["train-dflash", "--out", str(tmp_path), "--block-size", "1"]) == 2
    assert "block-size" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    assert main(["train-dflash", "--out", str(tmp_path / "a-file"), "--samples", "2", "--holdout", "1"]) == 2
    assert "cannot use" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, words",
    [
        (["--target-layers", "-1"], ["target layer id"]),
        (["--target-layers", "1,1"], ["twice"]),
        (["--mask-token-id", "-5"], ["mask-token-id"]),
        (["--block-size", str(MAX_K + 2)], ["block-size"]),
        (["--lr", "nan"], ["lr"]),
    ],
)
def test_train_dflash_options_are_checked_before_loading(tmp_path, capsys, no_model_load, args, words):
    assert_one_line_error(cli(capsys, "train-dflash", "--out", str(tmp_path / "d"), *args), *words)


def test_target_layers_and_mask_are_checked_against_the_target_before_data():
    from hf2q_py.tools.dflash_train import TrainConfig

    target = tiny_target("llama")  # 4 layers, vocabulary 128
    TrainConfig(out="x", target_layer_ids=[0, 3], mask_token_id=127).check_target(target)
    with pytest.raises(Hf2qError, match=r"target-layers \[4\] are out of range"):
        TrainConfig(out="x", target_layer_ids=[0, 4]).check_target(target)
    with pytest.raises(Hf2qError, match="mask-token-id 128"):
        TrainConfig(out="x", mask_token_id=128).check_target(target)


def test_a_draft_vocabulary_larger_than_the_target_s_is_refused_before_any_data_is_made():
    with pytest.raises(Hf2qError, match="draft-vocab"):
        TrainConfig(out="x", draft_vocab=VOCAB + 1).check_target(tiny_target("llama"))


@pytest.mark.slow
def test_train_dflash_checks_target_layers_before_generating_data(tmp_path, capsys):
    out = tmp_path / "d"
    result = cli(
        capsys,
        "train-dflash",
        "--out",
        str(out),
        "--target-layers",
        "1,99",
        "--samples",
        "2",
        "--holdout",
        "1",
        "--max-new-tokens",
        "4",
    )
    assert_one_line_error(result, "out of range", "30 layers")
    data = out / "train-state" / "data.jsonl"
    assert not data.exists() or data.read_text() == ""


def model_folder(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"weights the user owns")
    return folder


def test_train_dflash_never_overwrites_a_model_folder(tmp_path, capsys, no_model_load):
    folder = model_folder(tmp_path)
    assert_one_line_error(
        cli(capsys, "train-dflash", "--out", str(folder), "--samples", "2", "--holdout", "1"),
        "not empty",
        "--overwrite",
    )
    assert (folder / "model.safetensors").read_bytes() == b"weights the user owns"
    assert not (folder / "train-state").exists()


def test_the_python_trainer_never_overwrites_a_model_folder(tmp_path):
    from hf2q_py.tools.dflash_train import TrainConfig, train

    folder = model_folder(tmp_path)
    with pytest.raises(Hf2qError, match="not empty"):
        train(tiny_target("llama"), TrainConfig(out=str(folder), samples=2, holdout=1), [])
    assert (folder / "config.json").read_text() == '{"model_type": "llama"}'


def test_overwrite_starts_afresh(tmp_path):
    from hf2q_py.tools.dflash_train import TrainConfig, prepare_out, run_record

    folder = model_folder(tmp_path)
    (folder / "README.md").write_text("kept")
    cfg = TrainConfig(out=str(folder), samples=2, holdout=1, overwrite=True)
    data = prepare_out(cfg, run_record(None, ["a", "b"], 8))
    assert not (folder / "config.json").exists() and not (folder / "model.safetensors").exists()
    assert (folder / "README.md").read_text() == "kept"
    assert (
        data.parent.name == "train-state"
        and json.loads((data.parent / "run.json").read_text())["prompts"] == 2
    )


def test_resuming_with_other_prompts_or_target_is_refused(tmp_path, capsys, no_model_load):
    from hf2q_py.tools.dflash_train import TrainConfig, prepare_out, run_record

    out = tmp_path / "drafter"
    cfg = TrainConfig(out=str(out), samples=2, holdout=1)
    prepare_out(cfg, run_record(None, ["first prompt", "second prompt"], 8))
    prepare_out(cfg, run_record(None, ["first prompt", "second prompt"], 8))  # the same run resumes
    with pytest.raises(Hf2qError, match="--prompts"):
        prepare_out(cfg, run_record(None, ["first prompt", "another prompt"], 8))
    with pytest.raises(Hf2qError, match="--target"):
        prepare_out(cfg, run_record(str(tmp_path), ["first prompt", "second prompt"], 8))
    with pytest.raises(Hf2qError, match="--max-new-tokens"):
        prepare_out(cfg, run_record(None, ["first prompt", "second prompt"], 9))
    prompts = tmp_path / "p.txt"
    prompts.write_text("first prompt\nthird prompt\n")
    assert_one_line_error(
        cli(
            capsys,
            "train-dflash",
            "--out",
            str(out),
            "--prompts",
            str(prompts),
            "--samples",
            "2",
            "--holdout",
            "1",
            "--max-new-tokens",
            "8",
        ),
        "--prompts",
    )


def test_a_run_without_a_record_is_not_resumed_blindly(tmp_path):
    from hf2q_py.tools.dflash_train import TrainConfig, prepare_out, run_record

    work = tmp_path / "d" / "train-state"
    work.mkdir(parents=True)
    (work / "data.jsonl").write_text('{"prompt_tokens": 1, "tokens": [1, 2, 3]}\n')
    with pytest.raises(Hf2qError, match="without a record"):
        prepare_out(
            TrainConfig(out=str(tmp_path / "d"), samples=2, holdout=1), run_record(None, ["a", "b"], 8)
        )


def test_training_sees_exactly_what_inference_sees():
    """The training forward (all anchors at once, masked context) gives the
    same block logits as the cached inference forward at that point."""
    target = tiny_target("llama", scale=1.5)
    drafter = drafter_for(target, layers=2, block_size=6, target_layer_ids=[0, 3])
    tokens = random_prompt(30)
    feats = target_features(target, tokens, drafter.config.target_layer_ids)
    seq = TrainSequence(mx.array(tokens, dtype=mx.int32), feats, 0)
    head = TargetHead(target)
    anchors = mx.array([5, 17, 26], dtype=mx.int32)
    block, _, _, visible = block_batch(seq, anchors, drafter.config)
    trained = drafter(head.embed(block), feats.astype(mx.float32), block_pos=anchors, ctx_visible=visible)
    for row, a in enumerate(anchors.tolist()):
        cache = drafter.make_cache()
        drafter(
            head.embed(block[row : row + 1]), feats[:, : a - 2].astype(mx.float32), cache=cache
        )  # earlier round
        live = drafter(head.embed(block[row : row + 1]), feats[:, a - 2 : a].astype(mx.float32), cache=cache)
        assert mx.allclose(trained[row], live[0], atol=1e-4).item()


def self_distilled(target, n, answer_tokens):
    """Training rows as ``data.self_distill`` writes them: random prompts + greedy answers."""
    rows = []
    for i in range(n):
        p = random_prompt(8, seed=i)
        rows.append(
            {
                "prompt_tokens": len(p),
                "tokens": p + hf2q_py.generate(target, p, max_tokens=answer_tokens, method="baseline").tokens,
            }
        )
    return rows


def test_training_lowers_the_loss_and_resumes(tmp_path):
    target = tiny_target("llama", scale=3.0)
    rows = self_distilled(target, 10, 40)
    cfg = TrainConfig(
        out=str(tmp_path / "d"),
        steps=40,
        eval_every=20,
        checkpoint_every=20,
        holdout=2,
        block_size=4,
        lr=3e-3,
        samples=10,
        target_layer_ids=[1, 2],
    )
    train(target, cfg, rows, progress=False)
    state = json.loads((tmp_path / "d" / "train-state" / "trainer.json").read_text())
    assert state["step"] == 40 and len(state["history"]) == 2
    cfg.steps = 60
    drafter = train(target, cfg, rows, progress=False)  # resumes at step 40
    state = json.loads((tmp_path / "d" / "train-state" / "trainer.json").read_text())
    assert state["step"] == 60 and [h["step"] for h in state["history"]] == [20, 40, 60]
    assert state["history"][-1]["loss"] < state["history"][0]["loss"]
    # the written folder is a loadable drafter in the published layout
    cfg_json = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg_json["dflash_config"]["target_layer_ids"] == [1, 2] and cfg_json["block_size"] == 4
    r = hf2q_py.generate(
        target, rows[0]["tokens"][:8], max_tokens=20, method="dflash", drafter=str(tmp_path / "d")
    )
    assert r.tokens == rows[0]["tokens"][8:28]
    assert drafter.config.block_size == 4


def test_held_out_acceptance_counts_leading_matches():
    """Labels built from the drafter's own inference-time drafts: the first m
    agree, then one differs, so the accepted length is known to be 1 + m."""
    from hf2q_py.sampling import Greedy

    target = tiny_target("llama", scale=1.5)
    drafter = drafter_for(target, layers=1, block_size=5, target_layer_ids=[0, 1], seed=2)
    ids = drafter.config.target_layer_ids
    prefix = random_prompt(12)  # the anchor is its last token, at position 11
    rt = target.runtime()
    fwd = rt.prefill(prefix[:-1], logits="none", capture_layers=ids)
    proposer = DFlashProposer(target, drafter)
    proposer.start(rt, prefix, fwd.hidden, Greedy())
    drafts = proposer.propose(prefix, 4).ids()
    head = TargetHead(target)
    for m in range(5):
        wrong = [(d + 1) % 128 for d in drafts]
        tokens = prefix + drafts[:m] + wrong[m:] + random_prompt(3, seed=5)
        seq = TrainSequence(mx.array(tokens, dtype=mx.int32), target_features(target, tokens, ids), 0)
        got = accepted_lengths(drafter, head, seq, mx.array([11], dtype=mx.int32)).tolist()
        assert got == [1 + m]
    # near the end of the sequence only the labels that exist count
    tokens = prefix + drafts[:2]
    seq = TrainSequence(mx.array(tokens, dtype=mx.int32), target_features(target, tokens, ids), 0)
    assert accepted_lengths(drafter, head, seq, mx.array([11], dtype=mx.int32)).tolist() == [3]


def test_a_time_budget_stops_training_with_a_checkpoint(tmp_path):
    target = tiny_target("llama", scale=3.0)
    rows = self_distilled(target, 6, 20)
    cfg = TrainConfig(
        out=str(tmp_path / "d"),
        steps=10_000,
        eval_every=1000,
        checkpoint_every=1000,
        holdout=1,
        block_size=4,
        samples=6,
        target_layer_ids=[1, 2],
        max_minutes=0.0,
    )
    train(target, cfg, rows, progress=False)
    state = json.loads((tmp_path / "d" / "train-state" / "trainer.json").read_text())
    assert state["step"] == 1 and state["history"][-1]["step"] == 1
    assert load_drafter(tmp_path / "d").config.block_size == 4


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
