"""GGUF loading: llama.cpp's conventions are undone, every tensor type loads."""

import gguf
import mlx.core as mx
import numpy as np
import pytest
from models import CONFIGS, random_prompt, tiny_model

import hf2q_py
from hf2q_py.errors import ModelLoadError, UnsupportedModelError

Q = gguf.GGMLQuantizationType
NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(name: str) -> str:
    if name.startswith("model.embed_tokens."):
        return "token_embd." + name.rsplit(".", 1)[1]
    if name.startswith("model.norm."):
        return "output_norm.weight"
    if name.startswith("lm_head."):
        return "output.weight"
    _, _, i, rest = name.split(".", 3)
    layer, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{NAMES[layer]}.{kind}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of attn_q/attn_k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, arch: str, qtype):
    """Export a tiny random model the way llama.cpp's converter would; returns
    the model with its weights replaced by their quantize->dequantize round
    trip (computed by the gguf package), i.e. what the file really holds."""
    from mlx.utils import tree_flatten
    from tokenizers.pre_tokenizers import ByteLevel

    cfg = CONFIGS[arch]
    model = tiny_model(arch)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_context_length(4096)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    alphabet = sorted(ByteLevel.alphabet())
    w.add_token_list(["<eos>"] + alphabet[: cfg["vocab_size"] - 1])
    w.add_token_types([3] + [1] * (cfg["vocab_size"] - 1))
    w.add_token_merges([])
    w.add_eos_token_id(0)
    w.add_bos_token_id(0)
    held = []
    for name, value in tree_flatten(model.parameters()):
        a = np.array(value, dtype=np.float32)
        if a.ndim == 2 and qtype != Q.F32:
            a = gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
        held.append((name, mx.array(a)))
        if arch == "llama" and ("q_proj.weight" in name or "k_proj.weight" in name):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            a = permute(a, heads)
        if a.ndim == 2 and qtype != Q.F32:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), a)
    model.load_weights(held)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_0, Q.Q5_0])
def test_gguf_logits_match_the_weights_in_the_file(tmp_path, arch, qtype):
    """F32/Q8_0/Q4_0 load through mx.load, Q5_0 through the gguf package."""
    path = tmp_path / f"{arch}.gguf"
    model = write_gguf(path, arch, qtype)
    target = hf2q_py.load(path, dtype="float32")
    x = mx.array([random_prompt(16)])
    got, want = target.model(x), model(x)
    assert mx.abs(got - want).max().item() < 1e-3
    assert mx.array_equal(got.argmax(-1), want.argmax(-1)).item()


def test_gguf_keeps_quantized_weights_when_asked(tmp_path):
    path = tmp_path / "llama.gguf"
    model = write_gguf(path, "llama", Q.Q8_0)
    target = hf2q_py.load(path, dtype="keep")
    assert type(target.model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    x = mx.array([random_prompt(16)])
    assert mx.abs(target.model(x) - model(x)).max().item() < 1e-3


def test_gguf_tokenizer_comes_from_the_metadata(tmp_path):
    path = tmp_path / "llama.gguf"
    write_gguf(path, "llama", Q.F32)
    target = hf2q_py.load(path)
    ids = target.tokenizer.encode("abc")
    assert target.tokenizer.decode(ids) == "abc"
    assert target.eos_token_ids == {0}


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(UnsupportedModelError, match="mamba"):
        hf2q_py.load(path)


@pytest.mark.parametrize("content", [b"", b"GGUF\x03\x00\x00\x00garbage", b"not a model at all"])
def test_corrupt_files_give_a_clear_error(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        hf2q_py.load(path)


def test_missing_sources_give_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        hf2q_py.load(tmp_path / "missing.gguf")
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        hf2q_py.load("nobody/no-such-model-xyz")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        hf2q_py.load(tmp_path / "empty")
