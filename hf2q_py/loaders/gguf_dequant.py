"""Dequantizing GGUF tensor data that ``mx.load`` cannot read.

The common llama.cpp block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K) are decoded with lazy MLX array operations over all blocks at once;
the rest (Q2_K, Q3_K, I-quants, ...) with the ``gguf`` package's numpy code.
Block layouts follow ggml's ``block_*`` structs (little-endian).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ..errors import UnsupportedModelError
from .gguf_file import GGUFHeader, TensorInfo


def _f16(blocks: mx.array, start: int) -> mx.array:
    """The float16 at byte ``start`` of each block, as a float32 column."""
    return mx.view(blocks[:, start : start + 2], mx.float16).astype(mx.float32)


def _nibbles(qs: mx.array) -> mx.array:
    """Low nibbles of the bytes, then high nibbles: (blocks, 2 * bytes)."""
    return mx.concatenate([qs & 15, qs >> 4], axis=-1)


def _bits32(qh: mx.array) -> mx.array:
    """The 32 bits of 4 little-endian bytes, bit i at column i."""
    shifts = mx.arange(8, dtype=mx.uint8)
    return ((qh[:, :, None] >> shifts) & 1).reshape(qh.shape[0], 32)


def _q8_0(b: mx.array) -> mx.array:  # d, int8 q[32]
    return _f16(b, 0) * mx.view(b[:, 2:], mx.int8).astype(mx.float32)


def _q4_0(b: mx.array) -> mx.array:  # d, q[16] (4-bit, offset 8)
    return _f16(b, 0) * (_nibbles(b[:, 2:]).astype(mx.float32) - 8)


def _q4_1(b: mx.array) -> mx.array:  # d, m, q[16]
    return _f16(b, 0) * _nibbles(b[:, 4:]).astype(mx.float32) + _f16(b, 2)


def q5_codes(b: mx.array, qh: int) -> mx.array:
    """Q5_0/Q5_1 5-bit codes: 4 high bits in ``qh`` (4 bytes at ``qh``), then the nibbles."""
    return _nibbles(b[:, qh + 4 :]) | (_bits32(b[:, qh : qh + 4]) << 4)


def _q5_0(b: mx.array) -> mx.array:  # d, qh[4], q[16] (5-bit, offset 16)
    return _f16(b, 0) * (q5_codes(b, 2).astype(mx.float32) - 16)


def _q5_1(b: mx.array) -> mx.array:  # d, m, qh[4], q[16]
    return _f16(b, 0) * q5_codes(b, 4).astype(mx.float32) + _f16(b, 2)


def _k_scales(s: mx.array) -> tuple[mx.array, mx.array]:
    """The eight 6-bit scales and mins packed in 12 bytes (Q4_K, Q5_K)."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = mx.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1)
    mins = mx.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scales.astype(mx.float32), mins.astype(mx.float32)


def _k_chunks(qs: mx.array) -> mx.array:
    """Q4_K/Q5_K low bits: per 32-byte chunk, low nibbles then high: (blocks, 8, 32)."""
    chunks = qs.reshape(qs.shape[0], 4, 1, 32)
    return mx.concatenate([chunks & 15, chunks >> 4], axis=2).reshape(qs.shape[0], 8, 32)


def _q4_k(b: mx.array) -> mx.array:  # d, dmin, scales[12], qs[128]
    scales, mins = _k_scales(b[:, 4:16])
    q = _k_chunks(b[:, 16:144]).astype(mx.float32)
    d, dmin = _f16(b, 0)[:, :, None], _f16(b, 2)[:, :, None]
    return (d * scales[:, :, None] * q - dmin * mins[:, :, None]).reshape(b.shape[0], 256)


def q5_k_codes(b: mx.array) -> mx.array:
    """Q5_K 5-bit codes (blocks, 8, 32): sub-block s takes bit s of qh[l] as its high bit."""
    shifts = mx.arange(8, dtype=mx.uint8)[:, None]
    high = (b[:, None, 16:48] >> shifts) & 1
    return _k_chunks(b[:, 48:176]) | (high << 4)


def _q5_k(b: mx.array) -> mx.array:  # d, dmin, scales[12], qh[32], qs[128]
    scales, mins = _k_scales(b[:, 4:16])
    q = q5_k_codes(b).astype(mx.float32)
    d, dmin = _f16(b, 0)[:, :, None], _f16(b, 2)[:, :, None]
    return (d * scales[:, :, None] * q - dmin * mins[:, :, None]).reshape(b.shape[0], 256)


def q6_k_parts(b: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Q6_K as ``d * sc * (q - 32)``: the 6-bit ``q`` (uint8, (blocks, 16,
    16): 16-value sub-blocks in value order), ``sc`` (int8, (blocks, 16)) and
    ``d`` (float32, (blocks, 1))."""
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 1, 2, 32)  # half, nibble, ql run (0-31 / 32-63), l
    low = mx.concatenate([ql & 15, ql >> 4], axis=2).reshape(n, 2, 4, 32)
    shifts = mx.array([0, 2, 4, 6], dtype=mx.uint8)[:, None]
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3
    q = (low | (high << 4)).reshape(n, 16, 16)
    return q, mx.view(b[:, 192:208], mx.int8), _f16(b, 208)


def _q6_k(b: mx.array) -> mx.array:  # ql[128], qh[64], int8 scales[16], d
    q, sc, d = q6_k_parts(b)
    values = sc.astype(mx.float32)[:, :, None] * (q.astype(mx.float32) - 32)
    return d * values.reshape(b.shape[0], 256)


#: type name -> (bytes per block, decoder to (blocks, values per block))
DECODERS: dict[str, tuple[int, Callable[[mx.array], mx.array]]] = {
    "Q8_0": (34, _q8_0),
    "Q4_0": (18, _q4_0),
    "Q4_1": (20, _q4_1),
    "Q5_0": (22, _q5_0),
    "Q5_1": (24, _q5_1),
    "Q4_K": (144, _q4_k),
    "Q5_K": (176, _q5_k),
    "Q6_K": (210, _q6_k),
}


def readable_types() -> set[str]:
    """Names of the tensor types this loader can turn into floats."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    return {"F32", "F16"} | set(DECODERS) | {t.name for t in GGMLQuantizationType if t in _type_traits}


def check_tensor_types(header: GGUFHeader) -> None:
    """Refuse, before reading, a file holding a tensor type nothing here reads."""
    ok = readable_types()
    for info in header.tensors.values():
        if info.type_name not in ok:
            raise UnsupportedModelError(
                f"{header.path.name}: tensor {info.name!r} has GGUF type {info.type_name}, "
                "which hf2q-py cannot read"
            )


def dequantize(raw: np.ndarray, info: TensorInfo) -> mx.array:
    """float32 values (lazy) of one quantized tensor from its raw bytes."""
    if info.type_name in DECODERS:
        size, decode = DECODERS[info.type_name]
        blocks = mx.array(raw).reshape(-1, size)
        return decode(blocks).reshape(info.shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
    out = gguf_dequantize(raw.reshape(rows, -1), GGMLQuantizationType(info.ggml_type))
    return mx.array(out.reshape(info.shape).astype(np.float32, copy=False))
