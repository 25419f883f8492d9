"""Weight dtypes: keep quantization, or dequantize/cast to a float type."""

from __future__ import annotations

from typing import Any


import mlx.core as mx
import mlx.nn as nn

from ..errors import Hf2qError

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def parse_dtype(name: str | None) -> mx.Dtype | None:
    """None keeps the stored weights. ``"auto"`` (the default) is float32 on the
    CPU, where only fp32 matmuls are fast, and keeps the weights on a GPU."""
    if name is None or name == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else None
    if name == "keep":
        return None
    key = {"fp32": "float32", "f32": "float32", "fp16": "float16", "f16": "float16", "bf16": "bfloat16"}.get(
        name, name
    )
    if key not in DTYPES:
        raise Hf2qError(f"unknown dtype {name!r}: use auto, keep, float32, float16 or bfloat16")
    return DTYPES[key]


def to_dtype(model: Any, dtype: mx.Dtype | None, *, evaluate: bool = True) -> Any:
    """Dequantize quantized layers and cast float weights to ``dtype`` (in
    place); ``evaluate``: and evaluate the weights (else they stay lazy)."""
    if dtype is not None:
        from mlx_lm.utils import dequantize_model

        if any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules()):
            model = dequantize_model(model)
        model.set_dtype(dtype, lambda x: mx.issubdtype(x, mx.floating))
    if evaluate:
        mx.eval(model.parameters())
    return model
