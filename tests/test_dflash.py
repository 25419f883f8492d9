"""DFlash block drafting: published-format drafters load and run, drafting is
lossless, context bookkeeping is exact, and drafters that do not fit the target
or whose files are malformed are refused."""

import dataclasses
import json

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_same_greedy, reference_greedy
from models import random_prompt, tiny_target

import hf2q_py
from hf2q_py.tools.cli import main
from hf2q_py.proposers.dflash_drafter import check_against_target, load_drafter
from hf2q_py.tools.dflash_make import drafter_for, save_drafter
from hf2q_py.errors import Hf2qError, ModelLoadError
from hf2q_py.proposers.base import Draft
from hf2q_py.proposers.dflash import DFlashProposer


def published_folder(tmp_path, target, *, layers=2, block_size=8, layer_ids=(0, 2), sliding=False, seed=3):
    """A checkpoint written by hand in z-lab's layout: Qwen3 fields, top-level
    block_size and num_target_layers, dflash_config with mask and layer ids."""
    H, heads, kv, hd, inter = target.hidden_size, 4, 2, 16, 96
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": H,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "intermediate_size": inter,
        "vocab_size": target.vocab_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "max_position_embeddings": 40960,
        "block_size": block_size,
        "num_target_layers": target.num_layers,
        "dflash_config": {"mask_token_id": target.vocab_size - 1, "target_layer_ids": list(layer_ids)},
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if sliding:
        cfg["layer_types"] = ["sliding_attention"] + ["full_attention"] * (layers - 1)
        cfg["sliding_window"] = 8
    rng = np.random.default_rng(seed)

    def w(*shape):
        return mx.array(rng.normal(0, 0.5 / shape[-1] ** 0.5, shape).astype(np.float32)).astype(mx.bfloat16)

    weights = {
        "fc.weight": w(H, len(layer_ids) * H),
        "hidden_norm.weight": mx.ones((H,)),
        "norm.weight": mx.ones((H,)),
    }
    for i in range(layers):
        p = f"layers.{i}."
        weights.update(
            {
                p + "self_attn.q_proj.weight": w(heads * hd, H),
                p + "self_attn.k_proj.weight": w(kv * hd, H),
                p + "self_attn.v_proj.weight": w(kv * hd, H),
                p + "self_attn.o_proj.weight": w(H, heads * hd),
                p + "self_attn.q_norm.weight": mx.ones((hd,)),
                p + "self_attn.k_norm.weight": mx.ones((hd,)),
                p + "mlp.gate_proj.weight": w(inter, H),
                p + "mlp.up_proj.weight": w(inter, H),
                p + "mlp.down_proj.weight": w(H, inter),
                p + "input_layernorm.weight": mx.ones((H,)),
                p + "post_attention_layernorm.weight": mx.ones((H,)),
            }
        )
    folder = tmp_path / "drafter"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


def test_a_published_format_checkpoint_loads_and_runs(tmp_path):
    target = tiny_target("llama")
    folder = published_folder(tmp_path, target)
    drafter = load_drafter(folder)
    assert drafter.config.block_size == 8 and drafter.config.target_layer_ids == (0, 2)
    prompt = random_prompt(12)
    r = hf2q_py.generate(
        target, prompt, max_tokens=30, method="dflash", drafter=str(folder), adaptive=False, k=7
    )
    assert r.tokens == reference_greedy(target.model, prompt, 30)
    assert r.stats.drafted > 0 and r.stats.method == "dflash"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma4_text"])
@pytest.mark.parametrize(
    "shape",
    [dict(layers=1, block_size=2), dict(layers=2, block_size=5, sliding=True), dict(layers=1, block_size=16)],
)
def test_random_drafters_are_lossless(tmp_path, arch, shape):
    """gemma4_text's sliding window is 16: prompt + answer run far past it."""
    target = tiny_target(arch, scale=1.5)
    folder = published_folder(tmp_path, target, layer_ids=(1, 3), **shape)
    prompt = random_prompt(20, seed=5)
    for k in sorted({1, shape["block_size"] - 1, 8}):
        r = hf2q_py.generate(
            target, prompt, max_tokens=40, method="dflash", drafter=str(folder), adaptive=False, k=k
        )
        assert_same_greedy(target.model, prompt, r.tokens, reference_greedy(target.model, prompt, 40))


class OracleDFlash(DFlashProposer):
    """Runs the real drafter (so its bookkeeping runs) but proposes the
    target's own continuation for the first ``good`` drafts of each block."""

    def __init__(self, target, drafter, truth, good):
        super().__init__(target, drafter)
        self.truth, self.good, self.checks = truth, good, 0

    def propose(self, tokens, k):
        self.check(tokens)
        drafts = super().propose(tokens, k).ids()
        n = len(tokens)
        right = self.truth[n : n + self.good]
        return Draft((right + drafts[len(right) :])[: len(drafts)])

    def check(self, tokens):
        """The drafter has seen every committed position but the last."""
        pending = sum(p.shape[1] for p in self.pending)
        assert self.cache.offset + pending == len(tokens) - 1
        self.checks += 1


@pytest.mark.parametrize("good", [0, 2, 7])
def test_context_bookkeeping_is_exact_whatever_is_accepted(good):
    from hf2q_py.draft_length import FixedK
    from hf2q_py.generation import generate_tokens

    target = tiny_target("gemma4_text", scale=1.5)
    drafter = drafter_for(target, layers=1, block_size=8, target_layer_ids=[1, 4])
    prompt = random_prompt(10)
    want = reference_greedy(target.model, prompt, 50)
    proposer = OracleDFlash(target, drafter, prompt + want, good)
    got = [
        t
        for new in generate_tokens(target, prompt, max_tokens=50, proposer=proposer, policy=FixedK(7))
        for t in new
    ]
    assert got == want and proposer.checks > 5


def test_eos_and_budget_inside_a_block():
    from hf2q_py.draft_length import FixedK
    from hf2q_py.generation import generate_tokens

    target = tiny_target("llama", scale=1.5)
    drafter = drafter_for(target, layers=1, block_size=8, target_layer_ids=[0, 2])
    prompt = random_prompt(10)
    want = reference_greedy(target.model, prompt, 40)
    for budget in (1, 3, 13):
        p = OracleDFlash(target, drafter, prompt + want, 7)
        got = [
            t
            for new in generate_tokens(target, prompt, max_tokens=budget, proposer=p, policy=FixedK(7))
            for t in new
        ]
        assert got == want[:budget]
    eos = want[9]
    p = OracleDFlash(target, drafter, prompt + want, 7)
    got = [
        t
        for new in generate_tokens(
            target, prompt, max_tokens=40, proposer=p, policy=FixedK(7), eos_token_ids=[eos]
        )
        for t in new
    ]
    assert got == want[: want.index(eos)]


def test_save_and_load_round_trip(tmp_path):
    target = tiny_target("qwen2")
    drafter = drafter_for(target, layers=2, block_size=8, target_layer_ids=[1, 2, 3])
    save_drafter(drafter, tmp_path / "d")
    again = load_drafter(tmp_path / "d")
    x = mx.random.normal((1, 8, target.hidden_size))
    f = mx.random.normal((1, 5, 3 * target.hidden_size))
    a = drafter(x, f, cache=drafter.make_cache())
    b = again(x, f, cache=again.make_cache())
    assert mx.allclose(a, b).item()


def test_drafters_made_for_another_target_are_refused(tmp_path):
    target = tiny_target("llama")
    folder = published_folder(tmp_path, target, layer_ids=(0, 9))
    with pytest.raises(Hf2qError, match="out of range"):
        hf2q_py.generate(target, [1, 2, 3], max_tokens=4, method="dflash", drafter=str(folder))
    good = load_drafter(published_folder(tmp_path / "b", target)).config
    for change, message in [
        (dict(hidden_size=32), "hidden size"),
        (dict(vocab_size=64), "vocabulary"),
        (dict(num_target_layers=12), "12-layer target"),
        (dict(mask_token_id=500), "mask_token_id"),
    ]:
        with pytest.raises(Hf2qError, match=message):
            check_against_target(dataclasses.replace(good, **change), target)


def test_malformed_drafter_folders_are_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_drafter(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 1}))
    with pytest.raises(Hf2qError, match="lacks.*dflash_config.mask_token_id"):
        load_drafter(tmp_path)
    target = tiny_target("llama")
    folder = published_folder(tmp_path, target)
    weights = mx.load(str(folder / "model.safetensors"))
    weights.pop("fc.weight")
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(ModelLoadError, match="do not match"):
        load_drafter(folder)


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(target_layer_ids=["1", "2"]), ["target_layer_ids entry", "integer"]),
        (dict(block_size="8"), ["block_size", "integer"]),
        (dict(hidden_size="64"), ["hidden_size", "integer"]),
        (dict(num_attention_heads=0), ["num_attention_heads"]),
        (dict(num_key_value_heads=3), ["multiple of num_key_value_heads"]),
        (dict(dflash_config=[1, 2]), ["dflash_config must be an object"]),
        (dict(layer_types="full_attention"), ["layer_types"]),
        (dict(rope_theta="big"), ["rope_theta"]),
    ],
)
def test_drafter_configs_with_wrong_types_are_refused(tmp_path, change, words):
    from hf2q_py.proposers.dflash_drafter import load_drafter

    folder = published_folder(tmp_path, tiny_target("llama"))
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in change.items():
        (cfg["dflash_config"] if key == "target_layer_ids" else cfg)[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Hf2qError) as e:
        load_drafter(folder)
    for w in words:
        assert w in str(e.value)


def test_a_drafter_config_that_is_a_list_is_refused(tmp_path):
    from hf2q_py.proposers.dflash_drafter import load_drafter

    (tmp_path / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(Hf2qError, match="must hold an object"):
        load_drafter(tmp_path)


def test_dflash_needs_a_drafter(capsys):
    with pytest.raises(Hf2qError, match="needs a drafter"):
        hf2q_py.generate(tiny_target("llama"), [1, 2, 3], max_tokens=4, method="dflash")
    assert main(["generate", "--method", "dflash", "--prompt", "hi"]) == 2
    assert "needs a drafter" in capsys.readouterr().err
