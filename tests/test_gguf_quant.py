"""GGUF quantized tensors kept quantized (``dtype="keep"``): MLX's own
dequantization of what the loader packs equals the values the blocks encode
(the ``gguf`` package's decoder), exactly for the types MLX's affine groups
hold and within the stated bound for Q6_K; a model loaded that way computes
what the float-loaded model computes."""

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf.quants import dequantize as numpy_dequantize
from kquants import quantize as kquantize

import hf2q_py
from hf2q_py.loaders.gguf_quant import EXACT, REQUANTIZED, pack, quantized

Q = gguf.GGMLQuantizationType
rng = np.random.default_rng(0)


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_pack_writes_mlx_own_bit_layout(bits):
    codes = rng.integers(0, 2**bits, (3, 96))
    words = pack(mx.array(codes.astype(np.uint32)), bits)
    assert words.dtype == mx.uint32 and words.shape == (3, 96 * bits // 32)
    ones, zeros = mx.ones((3, 3)), mx.zeros((3, 3))
    back = mx.dequantize(words, ones, zeros, group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(back), codes)


def random_blocks(name: str, n: int) -> np.ndarray:
    """``n`` blocks of random bytes with finite float16 scales where the type has them."""
    block, size = gguf.GGML_QUANT_SIZES[Q[name]]
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    scale_at = {"Q6_K": [208]}.get(name, [0, 2] if name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else [0])
    for at in scale_at:
        raw[:, at : at + 2] = rng.uniform(-0.05, 0.05, (n, 1)).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("name", sorted(EXACT))
def test_types_that_mlx_groups_hold_stay_quantized_with_their_exact_values(name):
    block, _ = gguf.GGML_QUANT_SIZES[Q[name]]
    raw = random_blocks(name, 6)
    shape = (2, 3 * block)
    w, scales, biases = quantized(mx.array(raw.reshape(-1)), name, shape)
    assert w.dtype == mx.uint32 and scales.shape == (2, 3 * block // 32)
    got = mx.dequantize(w, scales, biases, group_size=32, bits=EXACT[name][0])
    want = numpy_dequantize(raw.reshape(2, -1), Q[name])
    np.testing.assert_allclose(np.array(got), want, rtol=1e-6, atol=1e-7)


def test_q6_k_becomes_8_bits_exact_for_the_larger_scale_sub_block_and_within_an_eighth_step_elsewhere():
    raw = random_blocks("Q6_K", 64)
    raw[:4, 192:208] = np.tile(np.array([5, -5, 7, 7, -3, 6, 0, 0], np.int8), 2).view(
        np.uint8
    )  # r = -1, 1, -1/2, 0/0
    w, scales, biases = quantized(mx.array(raw.reshape(-1)), "Q6_K", (16, 1024))
    got = np.array(mx.dequantize(w, scales, biases, group_size=32, bits=REQUANTIZED["Q6_K"])).reshape(
        -1, 8, 2, 16
    )
    want = numpy_dequantize(raw.reshape(16, -1), Q.Q6_K).reshape(-1, 8, 2, 16)
    d = raw[:, 208:210].copy().view(np.float16).astype(np.float32)
    step = np.abs(d * raw[:, 192:208].view(np.int8)).reshape(-1, 8, 2)  # each sub-block's Q6_K step
    big = step.argmax(-1)[..., None, None] == np.arange(2)[:, None]
    err = np.abs(got - want)
    tol = 1e-6 * np.abs(want).max()
    assert np.all(err[np.broadcast_to(big, err.shape)] <= tol)  # the larger-scale sub-block: exact
    bound = step.max(-1)[..., None, None] / 8
    corner = err > bound + tol  # only the clipped code 256: r = -1 at q = 0, a quarter step
    assert np.all(err[corner] <= 2 * np.broadcast_to(bound, err.shape)[corner] + tol)
    assert 0 < corner.sum() < 0.01 * err.size


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_the_test_encoder_writes_blocks_the_gguf_package_reads_back_close(name):
    a = rng.normal(0, 0.05, (4, 512)).astype(np.float32)
    back = numpy_dequantize(kquantize(a, name), Q[name])
    levels = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 63}[name]
    assert np.abs(back - a).max() <= 2.5 * np.ptp(a) / levels


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory):
    from gguf_export import export

    path = tmp_path_factory.mktemp("kq") / "wide.gguf"
    kinds = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q5_K", "gate_proj": "Q4_K",
             "up_proj": "Q5_K", "down_proj": "Q6_K", "embed_tokens": "Q4_K", "lm_head": "Q6_K"}  # fmt: skip
    export(path, "llama-wide", qtype=lambda pname: Q[kinds.get(pname.rsplit(".", 2)[-2], "F32")])
    return path


def test_a_k_quant_model_loaded_kept_has_quantized_layers_and_the_float_models_logits(kquant_file):
    kept = hf2q_py.load(kquant_file, dtype="keep")
    floats = hf2q_py.load(kquant_file, dtype="float32")
    layers = dict(kept.model.named_modules())
    attn = layers["model.layers.0.self_attn.q_proj"]
    assert isinstance(attn, nn.QuantizedLinear) and attn.bits == 4 and attn.group_size == 32
    assert layers["model.layers.0.mlp.up_proj"].bits == 5
    assert layers["model.layers.0.mlp.down_proj"].bits == 8  # Q6_K, requantized
    assert isinstance(layers["model.embed_tokens"], nn.QuantizedEmbedding)
    prompt = mx.array([[1, 5, 9, 14, 200, 33]])
    a, b = kept.model(prompt), floats.model(prompt)
    scale = float(mx.abs(b).max())
    assert float(mx.abs(a - b).max()) < 2e-2 * scale  # Q6_K's 8-bit requantization, nothing else
    ids = [1, 5, 9, 14, 200, 33]
    assert (
        hf2q_py.generate(kept, ids, max_tokens=8, method="baseline").tokens
        == hf2q_py.generate(floats, ids, max_tokens=8, method="baseline").tokens
    )


def test_a_model_without_q6_k_kept_quantized_equals_the_float_model(tmp_path):
    from gguf_export import export

    path = tmp_path / "q45.gguf"
    export(path, "llama-wide", qtype=lambda pname: Q.Q5_K if "mlp" in pname else Q.Q4_K)
    kept, floats = hf2q_py.load(path, dtype="keep"), hf2q_py.load(path, dtype="float32")
    prompt = mx.array([[1, 5, 9, 14, 200, 33]])
    a, b = kept.model(prompt), floats.model(prompt)
    assert float(mx.abs(a - b).max()) < 1e-4 * float(mx.abs(b).max())


def test_mixture_of_experts_k_quants_stay_quantized_and_compute_the_float_model(tmp_path):
    from gguf_export import export
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    path = tmp_path / "moe.gguf"
    export(path, "qwen3moe-wide", qtype=lambda pname: Q.Q5_K if "down_proj" in pname else Q.Q4_K)
    kept, floats = hf2q_py.load(path, dtype="keep"), hf2q_py.load(path, dtype="float32")
    layers = dict(kept.model.named_modules())
    experts = layers["model.layers.0.mlp.switch_mlp.gate_proj"]
    assert isinstance(experts, QuantizedSwitchLinear) and experts.bits == 4
    assert layers["model.layers.1.mlp.switch_mlp.down_proj"].bits == 5
    prompt = mx.array([[1, 5, 9, 14, 200, 33]])
    a, b = kept.model(prompt), floats.model(prompt)
    assert float(mx.abs(a - b).max()) < 1e-4 * float(mx.abs(b).max())


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_a_tensor_kept_in_row_chunks_equals_it_converted_whole(name, monkeypatch):
    from hf2q_py.loaders import gguf_tensors

    block, _ = gguf.GGML_QUANT_SIZES[Q[name]]
    raw = random_blocks(name, 2 * 7)  # 7 rows of 2 blocks
    whole = quantized(mx.array(raw.reshape(-1)), name, (7, 2 * block))
    monkeypatch.setattr(gguf_tensors, "CHUNK_WEIGHTS", 3 * 2 * block)  # 3 rows a chunk: 3 + 3 + 1
    chunked = gguf_tensors._kept(raw.reshape(-1), name, (7, 2 * block))
    for a, b in zip(whole, chunked, strict=True):
        assert a.shape == b.shape and mx.array_equal(a, b).item()
