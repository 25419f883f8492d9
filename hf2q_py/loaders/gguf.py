"""GGUF files (llama.cpp) as mlx-lm models.

Everything that can refuse a file (architecture, tokenizer kind, required
metadata, tensor names, shapes and types) is checked from the header alone,
before any tensor data is read. With ``dtype="keep"`` quantized tensors stay
quantized as MLX affine groups of 32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and
Q5_K exactly, Q6_K re-quantized to 8 bits (``gguf_quant``); other types, and
every type under a float dtype, are dequantized.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import ModelLoadError, one_line
from ..target import Target
from .convert import to_dtype
from .split import Split
from .gguf_arch import (
    ArchSpec,
    apply_rope_freqs,
    arch_spec,
    check_tensor_names,
    convert_weights,
    gguf_config,
    mlx_name,
    rope_config,
    used,
)
from .gguf_dequant import check_tensor_types
from .gguf_file import GGUFHeader, read_header
from .gguf_tensors import read_tensors
from .progress import evaluate

GROUP = 32


def plan_gguf(path: Path) -> tuple[GGUFHeader, ArchSpec, dict[str, Any]]:
    """Read the header and refuse anything unsupported (no tensor data read)."""
    from .gguf_tokenizer import check_tokenizer

    header = read_header(path)
    spec = arch_spec(header)
    check_tokenizer(header)
    cfg = gguf_config(header)
    check_tensor_names(header, spec, cfg)
    check_tensor_types(header)
    _check_shapes(header, spec, cfg)
    return header, spec, cfg


def _skeleton(cfg: dict[str, Any]):
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(cfg)
    return model_cls(args_cls.from_dict(cfg))


def _check_shapes(header: GGUFHeader, spec: ArchSpec, cfg: dict[str, Any]) -> None:
    """The tensor directory must fill the model built from the config exactly."""
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(_skeleton(cfg).parameters()))
    if cfg.get("tie_word_embeddings", True):
        params.pop("lm_head.weight", None)
    have = {}
    for info in header.tensors.values():
        name = mlx_name(info.name, spec) if used(info.name, cfg, spec) else None
        if name is not None:
            have.update(_halves(name, info.shape, spec))
    missing = sorted(set(params) - set(have))
    if missing:
        raise ModelLoadError(f"{header.path.name}: GGUF lacks tensors for {', '.join(missing[:3])}")
    for name, shape in have.items():
        want = tuple(params[name].shape) if name in params else None
        if want != shape:
            raise ModelLoadError(
                f"{header.path.name}: tensor {name} has shape {shape}, the {spec.model_type} "
                f"config expects {want}"
            )


def _halves(name: str, shape: tuple[int, ...], spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    """A tensor's mlx-lm name and shape, or a fused one's two halves."""
    layer, _, kind = name.rpartition(".")
    for fused, parts in spec.fused.items():
        if layer.endswith(fused):
            half = (*shape[:-2], shape[-2] // 2, shape[-1])
            return {f"{layer[: -len(fused)]}{p}.{kind}": half for p in parts}
    return {name: shape}


def _build(cfg: dict[str, Any], weights: dict[str, mx.array], bits: dict[str, int]):
    model = _skeleton(cfg)
    if bits:
        nn.quantize(
            model,
            class_predicate=lambda p, m: {"group_size": GROUP, "bits": bits[p]} if p in bits else False,
        )
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"GGUF tensors do not fit the {cfg['model_type']} model: {one_line(e)}") from e
    return model


def _dequantize_all(
    weights: dict[str, mx.array], bits: dict[str, int], dtype: mx.Dtype
) -> dict[str, mx.array]:
    out = {}
    for name, value in weights.items():
        layer, _, kind = name.rpartition(".")
        if layer in bits and kind in ("scales", "biases"):
            continue
        if layer in bits and kind == "weight":
            value = mx.dequantize(
                value,
                weights[f"{layer}.scales"].astype(mx.float32),
                weights[f"{layer}.biases"].astype(mx.float32),
                group_size=GROUP,
                bits=bits[layer],
            )
        out[name] = value.astype(dtype)
    return out


def scale_dtype() -> mx.Dtype:
    """The dtype of kept quantized layers' scales and biases: float16 (2 bytes
    per group of 32 each: the file's size), but float32 on the CPU, where
    MLX's quantized matmul is ~30x slower with float16 scales. float32 holds
    every type's exact values; float16 rounds a K-quant sub-block's
    ``d * sc`` and ``dmin * m`` (at most half a float16 unit, 2**-11 relative);
    the other types' are float16 values times powers of two."""
    return mx.float32 if mx.default_device() == mx.cpu else mx.float16


def _scales_as(weights: dict[str, mx.array], bits: dict[str, int], dtype: mx.Dtype) -> dict[str, mx.array]:
    def cast(name: str, value: mx.array) -> mx.array:
        layer, _, kind = name.rpartition(".")
        return value.astype(dtype) if layer in bits and kind in ("scales", "biases") else value

    return {n: cast(n, v) for n, v in weights.items()}


def _load_model(
    header: GGUFHeader, spec: ArchSpec, cfg: dict[str, Any], dtype: mx.Dtype | None, progress: bool = False
):
    tensors = read_tensors(header, keep_quantized=dtype is None, progress=progress)
    cfg = rope_config(cfg, tensors)
    weights, bits = convert_weights(tensors, cfg, spec)
    if dtype is not None or not bits:
        weights = _dequantize_all(weights, bits, dtype or mx.float16)
        bits = {}
    else:
        weights = _scales_as(weights, bits, scale_dtype())
        if mx.default_device() == mx.cpu:  # float16 arithmetic is slow on the CPU
            weights = {n: v.astype(mx.float32) if v.dtype == mx.float16 else v for n, v in weights.items()}
    model = _build(cfg, weights, bits)
    apply_rope_freqs(model, tensors, cfg)
    return model


def load_gguf(
    path: Path, dtype: mx.Dtype | None, split: Split | None = None, progress: bool = False
) -> Target:
    """Load a GGUF file (any part of a split GGUF loads all of them); ``dtype``
    None keeps 4/8-bit weights quantized; ``split`` shards the model (every
    rank reads the file and keeps its part); ``progress`` shows the reading
    and converting on bars."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file")
    header, spec, cfg = plan_gguf(path)
    if split is not None:
        split.plan(cfg)
    from .gguf_tokenizer import tokenizer_from_gguf

    # The tokenizer (Python and Rust) builds while MLX reads and converts the tensors.
    with ThreadPoolExecutor(max_workers=1) as pool:
        tokenizer_job = pool.submit(tokenizer_from_gguf, header.metadata)
        model = _load_model(header, spec, cfg, dtype, progress)
        sharding = split.apply(model, cfg) if split is not None else None
        model = to_dtype(model, dtype, evaluate=False)
        evaluate(model.parameters(), f"Converting {header.path.name}", progress)  # a rank's own part
        tokenizer = tokenizer_job.result()
    return Target(model, tokenizer, source=str(header.path), sharding=sharding)
