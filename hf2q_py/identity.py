"""A model's identity for the prompt cache on disk: a digest that differs
when the model, its weights or what computes its states differ.

It covers the model's configuration, every parameter's name, shape and
dtype and 16 of its values spread over it, the MLX version and the device
(other kernels give other floating-point states). Reading the samples is one
small evaluation; a Target computes it once (``Target.identity``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

SAMPLES = 16


def model_identity(model: Any, text_model: Any = None) -> str:
    """The identity digest (32 hex digits) of ``model`` (``text_model``: the
    language model inside a multimodal wrapper, whose config counts too)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"mlx {mx.__version__} on {mx.default_device()}\n".encode())
    for m in (model, text_model):
        config = getattr(m, "args", None) or getattr(m, "config", None)
        h.update(json.dumps(_plain(config), sort_keys=True).encode() + b"\n")
    params = sorted(tree_flatten(model.parameters()), key=lambda item: item[0])
    samples = [_sample(a) for _, a in params]
    mx.eval(samples)
    for (name, a), s in zip(params, samples):
        h.update(f"{name} {tuple(a.shape)} {a.dtype}\n".encode())
        h.update(np.array(s).tobytes())
    return h.hexdigest()


def _sample(a: mx.array) -> mx.array:
    """Up to ``SAMPLES`` values of ``a``, spread evenly, as raw bits where
    numpy has no such dtype."""
    flat = a.reshape(-1)
    n = flat.size
    if n == 0:
        return mx.zeros((0,), mx.uint8)
    idx = sorted({i * (n - 1) // max(1, SAMPLES - 1) for i in range(SAMPLES)})
    s = flat[mx.array(idx)]
    return s.view(mx.uint16) if s.dtype == mx.bfloat16 else s


def _plain(x: Any, depth: int = 0) -> Any:
    """``x`` as JSON values (dataclasses and objects by their fields; what
    cannot be written, such as functions, by its type's name: never an address)."""
    if depth > 8:
        return type(x).__name__
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, dict):
        return {str(k): _plain(v, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v, depth + 1) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name), depth + 1) for f in dataclasses.fields(x)}
    if hasattr(x, "__dict__") and not callable(x):
        return {k: _plain(v, depth + 1) for k, v in vars(x).items() if not k.startswith("_")}
    return type(x).__name__
