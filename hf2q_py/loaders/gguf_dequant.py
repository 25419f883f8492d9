"""Dequantizing GGUF tensor data that ``mx.load`` cannot read (K-quants,
Q5_0, I-quants, ...), with the ``gguf`` package's block formats."""

from __future__ import annotations

import numpy as np

from ..errors import UnsupportedModelError
from .gguf_file import GGUFHeader, TensorInfo


def readable_types() -> set[str]:
    """Names of the tensor types this loader can turn into floats."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    return {"F32", "F16"} | {t.name for t in GGMLQuantizationType if t in _type_traits}


def check_tensor_types(header: GGUFHeader) -> None:
    """Refuse, before reading, a file holding a tensor type nothing here reads."""
    ok = readable_types()
    for info in header.tensors.values():
        if info.type_name not in ok:
            raise UnsupportedModelError(
                f"{header.path.name}: tensor {info.name!r} has GGUF type {info.type_name}, "
                "which hf2q-py cannot read"
            )


def dequantize(raw: np.ndarray, info: TensorInfo) -> np.ndarray:
    """float32 values of one quantized tensor from its raw bytes (numpy shape)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
    out = gguf_dequantize(raw.reshape(rows, -1), GGMLQuantizationType(info.ggml_type))
    return out.reshape(info.shape).astype(np.float32, copy=False)
