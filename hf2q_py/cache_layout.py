"""The layout of a model's saved states (``LayerState``s), as the prompt
cache on disk keys and checks them: per layer its kind, its other fixed
fields (the window, any quantization) and its arrays' structure, each array's
dtype and shape with the token axis left open.

A layer's ``arrays`` may nest (a quantized key is ``(packed, scales,
biases)``) and may hold None (a recurrent state not yet written); leaves
are named by their path, ``"0"``, ``"1.2"``, as ``mlx.utils.tree_flatten``
names them. In attention layers (kinds ``kv`` and ``window``) every array's
token axis is its second to last.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import mlx.core as mx

from .cache import LayerState
from .cache_file import dtype_name

#: LayerState fields that change with the tokens held; the others are layout.
VARYING = ("arrays", "offset", "nbytes", "start")
TOKEN_AXIS = -2
ATTENTION = ("kv", "window")

Layout = list[dict[str, Any]]


def layer_layout(state: LayerState) -> dict[str, Any]:
    """One layer's layout: its fixed fields and its arrays' structure."""
    fields = {
        f.name: _json(getattr(state, f.name)) for f in dataclasses.fields(state) if f.name not in VARYING
    }
    tokens = state.kind in ATTENTION
    return {**fields, "leaves": _structure(state.arrays, tokens)}


def layout_of(layers: tuple[LayerState, ...] | list[LayerState]) -> Layout:
    return [layer_layout(s) for s in layers]


def digest(layout: Layout) -> str:
    return hashlib.blake2b(json.dumps(layout, sort_keys=True).encode(), digest_size=16).hexdigest()


def leaves(arrays: Any, prefix: str = "") -> list[tuple[str, mx.array]]:
    """The arrays nested in ``arrays`` with their paths (None skipped)."""
    out = []
    for i, a in enumerate(arrays):
        path = f"{prefix}{i}"
        if isinstance(a, (tuple, list)):
            out.extend(leaves(a, path + "."))
        elif a is not None:
            out.append((path, a))
    return out


def leaf_paths(structure: Any, prefix: str = "") -> list[tuple[str, dict[str, Any]]]:
    """The leaves a layout's structure names, with their descriptions."""
    out = []
    for i, s in enumerate(structure):
        path = f"{prefix}{i}"
        if isinstance(s, list):
            out.extend(leaf_paths(s, path + "."))
        elif s is not None:
            out.append((path, s))
    return out


def rebuild(structure: Any, found: dict[str, Any], prefix: str = "") -> tuple[Any, ...]:
    """The nested arrays of ``structure`` from leaves by path."""
    out = []
    for i, s in enumerate(structure):
        path = f"{prefix}{i}"
        if isinstance(s, list):
            out.append(rebuild(s, found, path + "."))
        else:
            out.append(None if s is None else found[path])
    return tuple(out)


def fixed_fields(layer: dict[str, Any]) -> dict[str, Any]:
    """A layer layout's fields as ``LayerState`` takes them."""
    names = {f.name for f in dataclasses.fields(LayerState)}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in layer.items() if k in names}


def shape_fits(desc: dict[str, Any], dtype: str, shape: tuple[int, ...]) -> bool:
    """Whether an array of ``dtype`` and ``shape`` fits a leaf description
    (any length along an open axis)."""
    want = desc["shape"]
    return (
        desc["dtype"] == dtype
        and len(want) == len(shape)
        and all(w is None or w == s for w, s in zip(want, shape))
    )


def _structure(arrays: Any, tokens: bool) -> list[Any]:
    out: list[Any] = []
    for a in arrays:
        if isinstance(a, (tuple, list)):
            out.append(_structure(a, tokens))
        elif a is None:
            out.append(None)
        else:
            shape: list[int | None] = list(a.shape)
            if tokens and len(shape) >= 2:
                shape[TOKEN_AXIS] = None
            out.append({"dtype": dtype_name(a), "shape": shape})
    return out


def _json(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str, list, dict)):
        return value
    return str(value)
