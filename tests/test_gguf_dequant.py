"""K-quant tensors read back as the values their blocks encode. Each block is
packed here by hand from chosen scales and quants, following ggml's block
layouts, so the check does not rest on the decoder under test."""

import gguf
import numpy as np
import pytest

from hf2q_py.loaders.gguf_file import read_header
from hf2q_py.loaders.gguf_tensors import read_tensors

Q = gguf.GGMLQuantizationType
rng = np.random.default_rng(0)


def q4_k_block() -> tuple[bytes, np.ndarray]:
    """One Q4_K block (256 values): 8 sub-blocks of 32, each d*scale*q - dmin*min
    with 6-bit scale/min and 4-bit q."""
    d, dmin = np.float16(0.013), np.float16(0.021)
    sc, mn = rng.integers(0, 64, 8), rng.integers(0, 64, 8)
    q = rng.integers(0, 16, 256)
    packed = bytearray(12)
    for j in range(4):
        packed[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6)
        packed[j + 4] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6)
        packed[j + 8] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4)
    qs = bytearray(128)
    for chunk in range(4):  # 64 values: low nibbles first, then high nibbles
        for l in range(32):
            qs[32 * chunk + l] = q[64 * chunk + l] | (q[64 * chunk + 32 + l] << 4)
    raw = d.tobytes() + dmin.tobytes() + bytes(packed) + bytes(qs)
    sub = np.arange(256) // 32
    want = np.float32(d) * sc[sub].astype(np.float32) * q - np.float32(dmin) * mn[sub].astype(np.float32)
    return raw, want.astype(np.float32)


def q6_k_block() -> tuple[bytes, np.ndarray]:
    """One Q6_K block: 16 sub-blocks of 16, each d*scale*(q - 32), int8 scale, 6-bit q."""
    d = np.float16(0.007)
    sc = rng.integers(-128, 128, 16)
    q = rng.integers(0, 64, 256)
    ql, qh = bytearray(128), bytearray(64)
    for half in range(2):  # 128 values: four runs of 32 share ql/qh bytes
        v = [q[128 * half + 32 * k : 128 * half + 32 * (k + 1)] for k in range(4)]
        for l in range(32):
            ql[64 * half + l] = (v[0][l] & 15) | ((v[2][l] & 15) << 4)
            ql[64 * half + 32 + l] = (v[1][l] & 15) | ((v[3][l] & 15) << 4)
            qh[32 * half + l] = (
                (v[0][l] >> 4) | ((v[1][l] >> 4) << 2) | ((v[2][l] >> 4) << 4) | ((v[3][l] >> 4) << 6)
            )
    raw = bytes(ql) + bytes(qh) + sc.astype(np.int8).tobytes() + d.tobytes()
    want = np.float32(d) * sc[np.arange(256) // 16].astype(np.float32) * (q - 32)
    return raw, want.astype(np.float32)


@pytest.mark.parametrize("qtype,make", [(Q.Q4_K, q4_k_block), (Q.Q6_K, q6_k_block)], ids=["Q4_K", "Q6_K"])
def test_k_quant_blocks_read_as_their_encoded_values(tmp_path, qtype, make):
    blocks = [make() for _ in range(4)]  # a 2 x 512 tensor: two blocks per row
    raw = np.frombuffer(b"".join(b for b, _ in blocks), np.uint8).reshape(2, -1)
    want = np.concatenate([w for _, w in blocks]).reshape(2, 512)
    path = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=qtype)
    w.add_tensor("output_norm.weight", np.ones(512, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    header = read_header(path)
    assert header.tensors["blk.0.ffn_down.weight"].shape == (2, 512)
    got = np.array(read_tensors(header)["blk.0.ffn_down.weight"])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_mlx_decoders_equal_the_gguf_packages_numpy_ones(name):
    """Random blocks (with finite float16 scales) decode alike in both."""
    from gguf.quants import dequantize as numpy_dequantize

    from hf2q_py.loaders.gguf_dequant import DECODERS
    from hf2q_py.loaders.gguf_file import TensorInfo

    qtype = Q[name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (6, size), dtype=np.uint8)
    scale_at = {"Q6_K": [208]}.get(name, [0, 2] if name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else [0])
    for at in scale_at:
        raw[:, at : at + 2] = rng.uniform(-0.05, 0.05, (6, 1)).astype(np.float16).view(np.uint8)
    info = TensorInfo("t", (2, 3 * block), int(qtype), 0, raw.size)
    from hf2q_py.loaders.gguf_dequant import dequantize

    got = np.array(dequantize(raw.reshape(-1), info))
    want = numpy_dequantize(raw.reshape(2, -1), qtype)
    assert name in DECODERS
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
