"""Gemma 4 GGUF files in llama.cpp's three layouts (31B-like dense with K = V,
E2B-like with per-layer inputs and KV sharing, 26B-A4B-like with experts)
load into mlx-lm's gemma4_text with the file's values, every method equals
plain greedy decoding past the sliding window, and the ``gemma4`` vocabulary
tokenizes as llama.cpp does (an independent BPE written here)."""

import re

import mlx.core as mx
import numpy as np
import pytest
from gguf_export import Q, export
from gguf_export_gemma4 import GEMMA4_EXPORTS
from gguf_vocab import CORPUS, gemma4_metadata
from helpers import UNGATED, assert_same_greedy, reference_greedy

import hf2q_py
from hf2q_py.errors import UnsupportedModelError
from hf2q_py.loaders.gguf_tokenizer import tokenizer_from_gguf
from hf2q_py.taps import kv_sources
from hf2q_py.tools.dflash_make import drafter_for

LAYOUTS = list(GEMMA4_EXPORTS)
PROMPT = [(37 * i + 11) % 400 for i in range(12)] * 2  # past the sliding window (8)


def load(path):
    """A float32 target that generates past its end tokens (to compare with mlx-lm's greedy)."""
    target = hf2q_py.load(path, dtype="float32")
    target.eos_token_ids = set()
    return target


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4")
    out = {}
    for name in LAYOUTS:
        model = export(root / f"{name}.gguf", name, Q.F32)
        out[name] = (root / f"{name}.gguf", model)
    export(root / "draft.gguf", "gemma4-small", Q.F32, seed=1)
    out["draft"] = (root / "draft.gguf", None)
    return out


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_layout_computes_the_source_models_logits(files, name):
    path, model = files[name]
    target = hf2q_py.load(path, dtype="float32")
    x = mx.array([PROMPT])
    assert float(mx.abs(target.model(x) - model(x)).max()) < 1e-4


def test_the_layouts_config_as_the_file_says(files):
    dense = hf2q_py.load(files["gemma4-dense"][0], dtype="float32").model.args
    assert dense.attention_k_eq_v and dense.num_global_key_value_heads == 1 and dense.num_key_value_heads == 2
    assert dense.rope_parameters["full_attention"]["partial_rotary_factor"] == 0.25
    small = hf2q_py.load(files["gemma4-small"][0], dtype="float32").model
    assert small.args.num_kv_shared_layers == 4 and small.args.use_double_wide_mlp
    assert small.layers[6].mlp.gate_proj.weight.shape[0] == 2 * small.args.intermediate_size
    assert kv_sources(small) == {4: 2, 5: 2, 6: 2, 7: 3}  # llama.cpp's rule: sliding M-2, full M-1
    moe = hf2q_py.load(files["gemma4-moe"][0], dtype="float32").model
    assert moe.layers[0].experts.switch_glu.gate_proj.weight.shape == (4, 32, 64)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q5_0], ids=lambda q: q.name)
def test_quantized_files_load_to_their_values_kept_or_as_floats(tmp_path, qtype):
    path = tmp_path / "g4.gguf"
    model = export(path, "gemma4-moe", qtype)
    x = mx.array([PROMPT])
    for dtype in ("float32", "keep"):
        got = hf2q_py.load(path, dtype=dtype).model(x)
        assert float(mx.abs(got - model(x)).max()) < 1e-4, dtype


@pytest.mark.parametrize("method", ["ngram", "draft", "layerskip", "dflash"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_every_method_equals_plain_greedy_past_the_window(files, name, method):
    target = load(files[name][0])
    opts = {
        "draft": {"draft": load(files["draft"][0]), **UNGATED},
        "layerskip": {"skip_layers": [1]},
        "dflash": {"drafter": drafter_for(target, layers=1, target_layer_ids=[0, 2], block_size=9)},
    }.get(method, {})
    want = reference_greedy(target.model, PROMPT, 30)
    r = hf2q_py.generate(target, PROMPT, max_tokens=30, method=method, k=8, adaptive=False, **opts)
    assert_same_greedy(target.model, PROMPT, r.tokens, want)
    assert r.stats.drafted > 0


def test_layer_skip_on_kv_shared_layers_keeps_valid_sets_and_calibrates(files):
    target = load(files["gemma4-small"][0])
    want = reference_greedy(target.model, PROMPT, 30)
    for skip in ([5], [4, 6], [1, 7], "auto"):
        r = hf2q_py.generate(target, PROMPT, max_tokens=30, method="layerskip", skip_layers=skip, k=4)
        assert_same_greedy(target.model, PROMPT, r.tokens, want)
    with pytest.raises(UnsupportedModelError, match="cannot skip layer 2"):
        hf2q_py.generate(target, PROMPT, max_tokens=4, method="layerskip", skip_layers=[2])


def reference_ids(meta: dict, text: str) -> list[int]:
    """llama.cpp's gemma4 tokenization, written plainly: special and
    user-defined tokens matched whole (longest first); spaces as ▁; runs of
    newlines and of the rest apart; merges by rank; unknown symbols as bytes."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    rank = {tuple(m.split(" ", 1)): r for r, m in enumerate(meta["tokenizer.ggml.merges"])}
    specials = sorted((t for t, ty in zip(tokens, types) if ty in (3, 4)), key=len, reverse=True)
    pattern = "(" + "|".join(re.escape(s) for s in specials) + ")"
    ids = [meta["tokenizer.ggml.bos_token_id"]]
    for part in re.split(pattern, text):
        if part in vocab and part in specials:
            ids.append(vocab[part])
            continue
        for run in re.findall(r"[^\n]+|\n+", part.replace(" ", "\u2581")):
            symbols = list(run)
            while True:
                pairs = [(rank.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(symbols, symbols[1:]))]
                best, i = min(pairs, default=(1 << 30, 0))
                if best == 1 << 30:
                    break
                symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
            for s in symbols:
                ids += [vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()]
    return ids


def test_gemma4_vocabulary_ids_equal_the_plain_reference_and_round_trip():
    meta = gemma4_metadata()
    tok = tokenizer_from_gguf(meta)
    for text in [*CORPUS, "a\n\n\nb  c\n", " lead", "x😀y"]:
        assert tok.encode(text) == reference_ids(meta, text), repr(text)
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_gemma4_vocabulary_always_adds_bos_and_ends_at_turn_ends():
    meta = dict(gemma4_metadata(), **{"tokenizer.ggml.add_bos_token": False})
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokens[3] = "<turn|>"
    meta["tokenizer.ggml.tokens"] = tokens
    tok = tokenizer_from_gguf(meta)
    assert tok.encode("a")[0] == meta["tokenizer.ggml.bos_token_id"]  # llama.cpp forces it for gemma4
    assert 3 in tok.eos_token_ids and 2 in tok.eos_token_ids


def _rewrite(path, tmp_path, name, extra=None, **changes):
    """The file with some metadata replaced and ``extra`` tensors added."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = tmp_path / name
    w = gguf.GGUFWriter(str(out), "gemma4")
    for field in reader.fields.values():
        key = field.name
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = changes.get(key, field.contents())
        w.add_key_value(
            key, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None
        )
    for t in reader.tensors:
        w.add_tensor(
            t.name, np.array(t.data), raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type
        )
    for tname, value in (extra or {}).items():
        w.add_tensor(tname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_kv_sharing_llama_cpp_and_mlx_lm_read_differently_is_refused_in_one_line(files, tmp_path):
    path = _rewrite(
        files["gemma4-small"][0], tmp_path, "shared.gguf", **{"gemma4.attention.shared_kv_layers": 5}
    )
    with pytest.raises(
        UnsupportedModelError, match=r"KV-shared layers from 3 need layer 2 full and 1 sliding"
    ):
        hf2q_py.load(path)


def test_mlp_widths_mlx_lm_cannot_hold_are_refused_in_one_line(files, tmp_path):
    widths = [64, 64, 96, 64, 128, 128, 128, 128]
    path = _rewrite(files["gemma4-small"][0], tmp_path, "ff.gguf", **{"gemma4.feed_forward_length": widths})
    with pytest.raises(UnsupportedModelError, match="feed_forward_length .* per layer"):
        hf2q_py.load(path)


def test_unused_kv_projections_of_shared_layers_are_carried_and_ignored(files, tmp_path):
    extra = {
        "blk.6.attn_k.weight": np.ones((16, 64), np.float32),
        "blk.6.attn_v.weight": np.ones((16, 64), np.float32),
        "blk.6.attn_k_norm.weight": np.ones(16, np.float32),
    }
    path = _rewrite(files["gemma4-small"][0], tmp_path, "carried.gguf", extra=extra)
    x = mx.array([PROMPT])
    _, model = files["gemma4-small"]
    assert float(mx.abs(hf2q_py.load(path, dtype="float32").model(x) - model(x)).max()) < 1e-4
