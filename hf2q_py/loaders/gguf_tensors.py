"""GGUF tensor data, each tensor read once: through ``mx.load`` when it reads
every type of the file, otherwise memory-mapped and copied, then dequantized
(``gguf_dequant``) or kept quantized as MLX groups (``gguf_quant``)."""

from __future__ import annotations

import mmap
from contextlib import ExitStack

import mlx.core as mx
import numpy as np

from ..errors import ModelLoadError
from .gguf_dequant import dequantize
from .gguf_file import GGUFHeader, TensorInfo
from .gguf_quant import keeps, quantized
from .progress import counted

#: Tensor types that ``mx.load`` reads correctly (quantized ones as MLX affine
#: weight/scales/biases, group 32). It also *accepts* some K-quant files but
#: returns wrong values for them, so any other type goes through numpy.
MX_LOAD_TYPES = {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}
_FLOAT_TYPES = {"F32": "<f4", "F16": "<f2"}
#: Weights converted at a time when a tensor stays quantized: bounds the
#: float temporaries (Q6_K's) to ~64 MiB whatever the tensor's size.
CHUNK_WEIGHTS = 1 << 24


def read_tensors(
    header: GGUFHeader, keep_quantized: bool = False, progress: bool = False
) -> dict[str, mx.array]:
    """Every tensor, each read once: through ``mx.load`` when it reads all of
    the file's types (quantized ones stay quantized), otherwise memory-mapped
    and copied. Quantized tensors then become floats (float32, lazily, by MLX
    where it can), or with ``keep_quantized`` MLX quantized triples
    (``NAME.weight``, ``NAME.scales``, ``NAME.biases``) where
    ``gguf_quant`` can hold their type (the others still become floats).
    Every part of a split GGUF is read; ``progress`` counts the tensors
    copied on a bar."""
    types = {t.type_name for t in header.tensors.values()}
    if types <= MX_LOAD_TYPES:
        out: dict[str, mx.array] = {}
        for path in header.parts:
            try:
                out.update(mx.load(str(path)))
            except Exception as e:
                raise ModelLoadError(f"{path}: cannot read its tensors ({e})") from e
        return out
    out = {}
    infos = counted(header.tensors.values(), len(header.tensors), f"Reading {header.path.name}", progress)
    with ExitStack() as stack:
        maps = {}
        for info in infos:
            path = info.file or header.path
            if path not in maps:
                f = stack.enter_context(open(path, "rb"))
                maps[path] = stack.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            raw = np.frombuffer(maps[path], np.uint8, info.nbytes, info.offset)
            _read_one(out, raw, info, keep_quantized)
            del raw
    return out


def _read_one(out: dict[str, mx.array], raw: np.ndarray, info: TensorInfo, keep_quantized: bool) -> None:
    """One tensor's values (or quantized triple) from its raw bytes into ``out``."""
    if info.type_name in _FLOAT_TYPES:
        out[info.name] = mx.array(
            raw.view(_FLOAT_TYPES[info.type_name]).reshape(info.shape), dtype=mx.float32
        )
    elif keep_quantized and keeps(info.type_name) and info.name.endswith(".weight"):
        stem = info.name.removesuffix(".weight")
        triple = _kept(raw, info.type_name, info.shape)
        for kind, value in zip(("weight", "scales", "biases"), triple):
            out[f"{stem}.{kind}"] = value
    else:
        out[info.name] = dequantize(raw, info)


def _kept(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> tuple[mx.array, ...]:
    """One tensor's MLX quantized triple, evaluated: its rows converted
    ``CHUNK_WEIGHTS`` at a time, so that loading holds the result and one
    chunk's temporaries, not a whole file's."""
    rows = int(np.prod(shape[:-1]))
    step = max(1, CHUNK_WEIGHTS // shape[-1])
    per_row = raw.size // rows
    parts = []
    for start in range(0, rows, step):
        n = min(step, rows - start)
        part = quantized(mx.array(raw[start * per_row : (start + n) * per_row]), type_name, (n, shape[-1]))
        mx.eval(part)
        parts.append(part)
    lead = tuple(shape[:-1])
    if len(parts) == 1:
        return tuple(p.reshape(*lead, -1) for p in parts[0])
    whole = tuple(mx.concatenate(p, axis=0).reshape(*lead, -1) for p in zip(*parts, strict=True))
    del parts
    mx.eval(whole)
    return whole
