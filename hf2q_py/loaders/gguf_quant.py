"""GGUF blocks as MLX quantized arrays, without going through floats.

MLX's affine quantization stores, per group of 32 values along a row,
``value = scale * code + bias`` with b-bit unsigned codes packed as a
little-endian bit stream into uint32 words (32 codes of b bits fill b
words). Most llama.cpp block types are that form exactly:

- Q8_0: ``d * q`` (int8 q): codes ``q + 128``, scale ``d``, bias ``-128 d``; 8 bits.
- Q4_0 / Q5_0: ``d * (q - 8)`` / ``d * (q - 16)``: 4 / 5 bits.
- Q4_1 / Q5_1: ``d * q + m``: 4 / 5 bits.
- Q4_K / Q5_K: per 32-value sub-block ``d * sc * q - dmin * m`` (6-bit sc, m):
  scale ``d * sc``, bias ``-dmin * m``; 4 / 5 bits.

Q6_K's 16-value sub-blocks each have their own scale, which no MLX group
size holds (32 is the smallest): each group of 32 becomes 8 bits with the
step of its larger-scale sub-block / 4, exact for that sub-block and within
an eighth of its Q6_K step for the other (``q6_k_as_8_bits``).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from .gguf_dequant import DECODERS, _f16, _k_chunks, _k_scales, _nibbles, q5_codes, q5_k_codes, q6_k_parts

GROUP = 32

Split = tuple[mx.array, mx.array, mx.array]  # codes (blocks, values), scales, biases (blocks, groups)


def pack(codes: mx.array, bits: int) -> mx.array:
    """Codes (..., n) with n a multiple of 32, each < 2**bits, as MLX's packed
    uint32 words (..., n * bits / 32): a little-endian bit stream."""
    lead, n = codes.shape[:-1], codes.shape[-1]
    if bits == 8:
        stream = codes.astype(mx.uint8)
    elif bits == 4:
        c = codes.astype(mx.uint8).reshape(*lead, n // 2, 2)
        stream = c[..., 0] | (c[..., 1] << 4)
    else:  # 8 codes of b bits are b bytes: byte j holds bits [8 j, 8 j + 8) of the stream
        c = codes.astype(mx.uint16).reshape(*lead, n // 8, 8)
        out = []
        for j in range(bits):
            byte = None
            for i in range((8 * j) // bits, min(8, (8 * j + 7) // bits + 1)):
                shift = bits * i - 8 * j
                part = c[..., i] << shift if shift >= 0 else c[..., i] >> -shift
                byte = part if byte is None else byte | part
            out.append((byte & 255).astype(mx.uint8))
        stream = mx.stack(out, axis=-1)
    return mx.view(mx.contiguous(stream).reshape(*lead, n * bits // 8), mx.uint32)


def _q8_0(b: mx.array) -> Split:
    d = _f16(b, 0)
    codes = (mx.view(b[:, 2:], mx.int8).astype(mx.int16) + 128).astype(mx.uint8)
    return codes, d, -128 * d


def _q4_0(b: mx.array) -> Split:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:]), d, -8 * d


def _q4_1(b: mx.array) -> Split:
    return _nibbles(b[:, 4:]), _f16(b, 0), _f16(b, 2)


def _q5_0(b: mx.array) -> Split:
    d = _f16(b, 0)
    return q5_codes(b, 2), d, -16 * d


def _q5_1(b: mx.array) -> Split:
    return q5_codes(b, 4), _f16(b, 0), _f16(b, 2)


def _k(b: mx.array, codes: mx.array) -> Split:
    scales, mins = _k_scales(b[:, 4:16])
    d, dmin = _f16(b, 0), _f16(b, 2)
    return codes.reshape(b.shape[0], 256), d * scales, -(dmin * mins)


def _q4_k(b: mx.array) -> Split:
    return _k(b, _k_chunks(b[:, 16:144]))


def _q5_k(b: mx.array) -> Split:
    return _k(b, q5_k_codes(b))


#: type name -> (bits, splitter from blocks to codes, scales, biases)
EXACT: dict[str, tuple[int, Callable[[mx.array], Split]]] = {
    "Q8_0": (8, _q8_0),
    "Q4_0": (4, _q4_0),
    "Q4_1": (4, _q4_1),
    "Q5_0": (5, _q5_0),
    "Q5_1": (5, _q5_1),
    "Q4_K": (4, _q4_k),
    "Q5_K": (5, _q5_k),
}
#: Types kept quantized by re-quantizing their values: name -> bits.
REQUANTIZED = {"Q6_K": 8}


def quantized(raw: mx.array, type_name: str, shape: tuple[int, ...]) -> tuple[mx.array, mx.array, mx.array]:
    """The MLX (weight, scales, biases) of one tensor's raw blocks (lazy);
    ``shape`` is the tensor's (rows, ..., columns)."""
    size = DECODERS[type_name][0]
    blocks = raw.reshape(-1, size)
    rows, cols = shape[:-1], shape[-1]
    if type_name == "Q6_K":
        w, scales, biases = q6_k_as_8_bits(blocks)
        groups = (*rows, cols // GROUP)
        return w.reshape(*rows, cols // 4), scales.reshape(groups), biases.reshape(groups)
    bits, split = EXACT[type_name]
    codes, scales, biases = split(blocks)  # scales, biases: float32, one per group of 32
    groups = (*rows, cols // GROUP)
    return pack(codes.reshape(*rows, cols), bits), scales.reshape(groups), biases.reshape(groups)


def q6_k_as_8_bits(blocks: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Q6_K blocks as 8-bit groups of 32 (two 16-value sub-blocks each).

    A group's step is ``d * S / 4``, ``S`` the sub-block scale of larger
    magnitude: that sub-block's values ``d * S * (q - 32)`` are the codes
    ``4 q`` exactly; the other sub-block's (scale ``sc = r * S``, ``|r| <=
    1``) round ``128 + 4 r (q - 32)``, within half a step (an eighth of the
    group's largest Q6_K step), except the value at ``q = 0`` when ``r = -1``
    (code 256), clipped to 255: a quarter of that step."""
    q, sc, d = q6_k_parts(blocks)
    n = blocks.shape[0]
    sc = sc.astype(mx.float32).reshape(n, 8, 2)
    big = mx.where(mx.abs(sc[..., :1]) >= mx.abs(sc[..., 1:]), sc[..., :1], sc[..., 1:])
    big = mx.where(big == 0, 1.0, big)
    r = (sc / big)[..., None]  # (n, 8, 2, 1)
    x = q.reshape(n, 8, 2, 16).astype(mx.float32)
    codes = mx.minimum(mx.round(4 * r * x + 128 * (1 - r)), 255).astype(mx.uint8)
    step = d * big[..., 0] / 4
    return pack(codes.reshape(n, 256), 8), step, -128 * step


def keeps(type_name: str) -> bool:
    """Whether tensors of this type stay quantized."""
    return type_name in EXACT or type_name in REQUANTIZED
