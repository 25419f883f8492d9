"""A plain K-quant encoder for tests (the ``gguf`` package decodes K-quants
but does not encode them): each block's scales from its sub-blocks' ranges,
then rounded codes, laid out as ggml's ``block_q4_K``, ``block_q5_K`` and
``block_q6_K``. Not llama.cpp's optimised search, but valid blocks."""

from __future__ import annotations

import numpy as np

_TINY = 1e-8


def _f16(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, _TINY).astype(np.float16)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins in 12 bytes per block (ggml's get_scale_min_k4)."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    for j in range(4):
        out[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        out[:, j + 4] = (mn[:, j] & 63) | ((mn[:, j + 4] >> 4) << 6)
        out[:, j + 8] = (sc[:, j + 4] & 15) | ((mn[:, j + 4] & 15) << 4)
    return out


def _affine_k(x: np.ndarray, levels: int):
    """Q4_K/Q5_K: per 32-value sub-block d*sc*q - dmin*m; returns d, dmin, sc, m, q."""
    lo = np.minimum(x.min(-1), 0.0)
    step = np.maximum(x.max(-1) - lo, _TINY) / levels
    d, dmin = _f16(step.max(-1) / 63), _f16((-lo).max(-1) / 63)
    sc = np.clip(np.round(step / d.astype(np.float32)[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / dmin.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32)[:, None] * sc
    bias = dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.round((x + bias[..., None]) / scale[..., None]), 0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q.reshape(x.shape[0], 256)


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """qs bytes: per 64 values, the first 32 in low nibbles, the next 32 in high."""
    c = (q & 15).reshape(-1, 4, 2, 32)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(-1, 128).astype(np.uint8)


def q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine_k(x.reshape(-1, 8, 32), 15)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                           _pack_scales(sc, mn), _low_nibbles(q)], axis=1)  # fmt: skip


def q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine_k(x.reshape(-1, 8, 32), 31)
    high = (q >> 4).reshape(-1, 8, 32)  # sub-block s: bit s of qh[l]
    qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                           _pack_scales(sc, mn), qh, _low_nibbles(q)], axis=1)  # fmt: skip


def q6_k(x: np.ndarray) -> np.ndarray:
    x = x.reshape(-1, 16, 16)
    step = np.maximum(np.abs(x).max(-1), _TINY) / 31.5
    d = _f16(step.max(-1) / 127)
    sc = np.clip(np.round(step / d.astype(np.float32)[:, None]), 1, 127).astype(np.int8)
    scale = d.astype(np.float32)[:, None] * sc
    q = (np.clip(np.round(x / scale[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                         (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=2)  # fmt: skip
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                           d.view(np.uint8).reshape(-1, 2)], axis=1)  # fmt: skip


ENCODERS = {"Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}


def quantize(a: np.ndarray, name: str) -> np.ndarray:
    """Rows of ``a`` (columns a multiple of 256) as K-quant bytes: (..., rows, bytes per row)."""
    return ENCODERS[name](a.astype(np.float32).reshape(-1, 256)).reshape(*a.shape[:-1], -1)
