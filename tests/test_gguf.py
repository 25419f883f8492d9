"""GGUF loading: quantized weights kept on request, byte-level BPE
vocabularies, and every refusal made from the header alone, in one line."""

import time

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf_export import Q, export
from gguf_vocab import bpe_metadata, spm_metadata, write_vocab

import hf2q_py
from hf2q_py.errors import ModelLoadError, UnsupportedModelError
from hf2q_py.loaders import gguf as gguf_loader

PROMPT = [3, 17, 99, 250, 7, 64, 300, 12]


def test_quantized_weights_stay_quantized_when_asked(tmp_path):
    path = tmp_path / "llama.gguf"
    model = export(path, "llama", Q.Q8_0)
    target = hf2q_py.load(path, dtype="keep")
    assert type(target.model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    x = mx.array([PROMPT])
    assert mx.abs(target.model(x) - model(x)).max().item() < 1e-3


def test_byte_level_bpe_vocabulary_comes_from_the_metadata(tmp_path):
    path = tmp_path / "qwen2.gguf"
    export(path, "qwen2", Q.F32, vocab=bpe_metadata())
    target = hf2q_py.load(path)
    tok = target.tokenizer
    assert tok.encode("abc") == [258]  # both merges applied: "abc" is the last token
    assert tok.decode(tok.encode("héllo wörld 😀")) == "héllo wörld 😀"
    assert target.eos_token_ids == {0}


def write_header_only(path, arch: str, meta: dict | None = None, tensors=None, **keys) -> None:
    """A GGUF with a config and vocabulary but (by default) a single tensor."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(keys.get("block_count", 2))
    w.add_embedding_length(64)
    if keys.get("heads", True):
        w.add_head_count(4)
    w.add_feed_forward_length(128)
    if "scaling" in keys:
        w.add_rope_scaling_type(keys["scaling"])
    write_vocab(w, meta or spm_metadata(True))
    for name, value in (tensors or {"token_embd.weight": np.zeros((400, 64), np.float32)}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def refusal(path, monkeypatch) -> str:
    """The one-line message of loading ``path``, checking no tensor was read."""

    def no_read(*a, **k):
        raise AssertionError("tensor data was read before the refusal")

    monkeypatch.setattr(gguf_loader, "read_tensors", no_read)
    start = time.perf_counter()
    with pytest.raises((ModelLoadError, UnsupportedModelError)) as e:
        hf2q_py.load(path)
    assert time.perf_counter() - start < 1.0
    message = str(e.value)
    assert "\n" not in message and path.name in message
    return message


def test_unsupported_architecture_is_named_at_once(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    write_header_only(path, "mamba")
    assert "GGUF architecture 'mamba' is not supported" in refusal(path, monkeypatch)


def test_unsupported_vocabulary_kind_is_named_at_once(tmp_path, monkeypatch):
    path = tmp_path / "t.gguf"
    write_header_only(path, "llama", meta=dict(spm_metadata(True), **{"tokenizer.ggml.model": "t5"}))
    assert "GGUF tokenizer model 't5' is not supported" in refusal(path, monkeypatch)


def test_missing_metadata_is_named_at_once(tmp_path, monkeypatch):
    path = tmp_path / "h.gguf"
    write_header_only(path, "llama", heads=False)
    assert "lacks llama.attention.head_count" in refusal(path, monkeypatch)


def test_tensors_with_no_place_in_the_model_are_named_at_once(tmp_path, monkeypatch):
    path = tmp_path / "shared.gguf"
    tensors = {
        "token_embd.weight": np.zeros((400, 64), np.float32),
        "blk.0.ffn_gate_shexp.weight": np.zeros((128, 64), np.float32),  # a shared expert
    }
    write_header_only(path, "llama", tensors=tensors)
    assert "'blk.0.ffn_gate_shexp.weight' has no place" in refusal(path, monkeypatch)


def test_experts_without_their_counts_are_named_at_once(tmp_path, monkeypatch):
    path = tmp_path / "moe.gguf"
    tensors = {
        "token_embd.weight": np.zeros((400, 64), np.float32),
        "blk.0.ffn_gate_inp.weight": np.zeros((4, 64), np.float32),
    }
    write_header_only(path, "llama", tensors=tensors)
    assert "lacks llama.expert_count, llama.expert_used_count" in refusal(path, monkeypatch)


def test_shapes_that_do_not_fit_the_config_are_named_at_once(tmp_path, monkeypatch):
    path = tmp_path / "s.gguf"
    write_header_only(path, "llama", tensors={"token_embd.weight": np.zeros((400, 32), np.float32)})
    message = refusal(path, monkeypatch)
    assert "model.embed_tokens.weight has shape (400, 32)" in message or "lacks tensors" in message


def test_unsupported_rope_scaling_is_named_at_once(tmp_path, monkeypatch):
    path = tmp_path / "y.gguf"
    write_header_only(path, "llama", scaling=gguf.RopeScalingType.YARN)
    assert "rope scaling 'yarn' is not supported" in refusal(path, monkeypatch)


@pytest.mark.parametrize(
    "content",
    [b"", b"GGUF\x03\x00\x00\x00garbage", b"not a model at all", b"GGUF\x09\x00\x00\x00" + bytes(16)],
)
def test_corrupt_files_give_a_clear_error(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        hf2q_py.load(path)


def test_truncated_tensor_data_is_named(tmp_path):
    path = tmp_path / "cut.gguf"
    export(path, "llama", Q.F32)
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="truncated"):
        hf2q_py.load(path)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K])  # read by mx.load; Q4_K falls back to Q5_0: numpy
def test_a_split_gguf_loads_from_any_of_its_parts_as_the_whole_file(tmp_path, qtype):
    export(tmp_path / "whole.gguf", "llama", qtype)
    export(tmp_path / "m.gguf", "llama", qtype, split_tensors=8)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) > 2
    x = mx.array([PROMPT])
    want = hf2q_py.load(tmp_path / "whole.gguf", dtype="float32").model(x)
    for part in (parts[0], parts[-1]):
        target = hf2q_py.load(part, dtype="float32")
        assert mx.array_equal(target.model(x), want) and target.source == str(parts[0])
    parts[1].unlink()
    with pytest.raises(ModelLoadError, match=f"missing {parts[1].name}"):
        hf2q_py.load(parts[0])


def test_missing_sources_give_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        hf2q_py.load(tmp_path / "missing.gguf")
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        hf2q_py.load("nobody/no-such-model-xyz")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        hf2q_py.load(tmp_path / "empty")
