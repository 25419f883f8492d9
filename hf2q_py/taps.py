"""Forward-pass taps on an mlx-lm model: capture hidden states, skip layers.

mlx-lm models are plain ``nn.Module`` trees whose decoder keeps its layers in
a list and ends with a final norm. For the length of one forward call we swap
list entries (and the norm) for thin wrappers, then put the originals back:
the model itself is never modified between calls, and the wrappers only add
graph nodes that MLX evaluates lazily with the rest.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterator, Sequence


import mlx.core as mx
import mlx.nn as nn

from .errors import UnsupportedModelError


def language_model(model: Any) -> Any:
    """The text model inside a multimodal wrapper (its ``language_model``), else ``model``."""
    lm = getattr(model, "language_model", None)
    return lm if isinstance(lm, nn.Module) else model


#: Attribute names of a decoder's final norm and token embedding in mlx-lm models.
FINAL_NORMS = ("norm", "norm_f", "embedding_norm")
EMBEDDINGS = ("embed_tokens", "embeddings")


def final_norm_name(decoder: Any) -> str | None:
    """The attribute holding ``decoder``'s final norm (LFM2: ``embedding_norm``, Nemotron-H: ``norm_f``)."""
    return next((n for n in FINAL_NORMS if isinstance(getattr(decoder, n, None), nn.Module)), None)


def embedding(decoder: Any) -> Any:
    """``decoder``'s token embedding, or None."""
    return next((e for n in EMBEDDINGS if (e := getattr(decoder, n, None)) is not None), None)


def find_decoder(model: Any) -> Any:
    """The inner module holding ``layers`` (a list) and the final norm."""
    candidates = [model]
    for name in ("model", "language_model", "backbone"):
        sub = getattr(model, name, None)
        if sub is not None:
            candidates.append(sub)
            inner = getattr(sub, "model", None)
            if inner is not None:
                candidates.append(inner)
    for c in reversed(candidates):
        if isinstance(getattr(c, "layers", None), list) and final_norm_name(c) is not None:
            return c
    return None


@dataclass
class Recorder:
    """Hidden states recorded during one forward call (lazy arrays)."""

    layers: dict[int, mx.array] = field(default_factory=dict)
    final: mx.array | None = None


class StandIn(nn.Module):
    """A module standing in for another (its child named by ``wrapped``):
    attribute reads it does not answer itself go to the wrapped module."""

    wrapped = ""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.get(type(self).wrapped)
            if inner is None:
                raise
            return getattr(inner, name)


class _Tap(StandIn):
    """Stands in for one decoder layer: runs it (or skips it, passing the
    hidden state through) and records its output. Attribute reads such as
    ``use_sliding`` or ``layer_type`` go to the wrapped layer."""

    wrapped = "layer"

    def __init__(self, layer: nn.Module, index: int, rec: Recorder | None, skip: bool):
        super().__init__()
        self.layer, self.index, self.rec, self.skip = layer, index, rec, skip

    def __call__(self, x, *args, **kwargs):
        if self.skip:
            # gemma4_text layers also pass on the shared KV and its offset
            out = (x, kwargs["shared_kv"], kwargs.get("offset")) if "shared_kv" in kwargs else x
        else:
            out = self.layer(x, *args, **kwargs)
        if self.rec is not None:
            self.rec.layers[self.index] = out[0] if isinstance(out, tuple) else out
        return out


class _FinalNorm(nn.Module):
    def __init__(self, norm: nn.Module, rec: Recorder | None, keep: slice | mx.array | None):
        super().__init__()
        self.norm, self.rec, self.keep = norm, rec, keep

    def __call__(self, x):
        if isinstance(self.keep, mx.array):
            x = keep_rows(x, self.keep)
        elif self.keep is not None:
            x = x[:, self.keep]
        y = self.norm(x)
        if self.rec is not None:
            self.rec.final = y
        return y


def keep_rows(x: mx.array, positions: mx.array) -> mx.array:
    """Row b's position ``positions[b]`` of ``x`` (B, L, ...), as (B, 1, ...)."""
    index = positions.astype(mx.int32).reshape(-1, 1, *([1] * (x.ndim - 2)))
    return mx.take_along_axis(x, index, axis=1)


def kv_sources(model: Any) -> dict[int, int]:
    """KV-shared layers -> the earlier layer whose KV cache each one reads
    (gemma4_text with ``num_kv_shared_layers > 0``); empty for other models."""
    prev = getattr(find_decoder(model), "previous_kvs", None)
    return {j: i for j, i in enumerate(prev) if i != j} if prev else {}


def check_skippable(model: Any) -> None:
    """Layer skipping needs decoder layers that map hidden -> hidden, with
    the caches belonging to the first layers in order (KV-shared layers last)."""
    dec = find_decoder(model)
    if dec is None:
        raise UnsupportedModelError("cannot find the decoder layers of this model")
    if hasattr(model, "make_cache"):
        n_caches, n_layers = len(model.make_cache()), len(dec.layers)
        if n_caches != n_layers - len(kv_sources(model)):
            raise UnsupportedModelError(
                f"layer skipping needs one cache per layer; {type(language_model(model)).__module__.split('.')[-1]} "
                f"has {n_caches} caches for {n_layers} layers"
            )


def check_skip_set(model: Any, skip: Sequence[int]) -> None:
    """Refuse a skip set that skips a layer whose KV cache a running layer reads."""
    skip = set(skip)
    for shared, source in sorted(kv_sources(model).items()):
        if source in skip and shared not in skip:
            raise UnsupportedModelError(
                f"cannot skip layer {source}: KV-shared layer {shared} reads its cache "
                f"(skip layer {shared} too, or keep layer {source})"
            )


@contextmanager
def tapped(
    model: Any,
    *,
    capture_layers: Sequence[int] = (),
    capture_final: bool = False,
    keep_positions: slice | mx.array | None = None,
    skip_layers: Sequence[int] = (),
) -> Iterator[Recorder]:
    """Run the body's forward call with the requested taps installed.

    ``keep_positions`` slices the sequence before the final norm, so the
    LM head is computed only for those positions (an array: one position
    per row of the batch).
    """
    rec = Recorder()
    if not (capture_layers or capture_final or keep_positions is not None or skip_layers):
        yield rec
        return
    dec = find_decoder(model)
    if dec is None:
        if capture_layers or capture_final or skip_layers:
            raise UnsupportedModelError(
                f"hidden-state capture and layer skipping need a decoder with "
                f"'layers' and a final norm; {type(model).__module__} has none"
            )
        yield rec
        return
    layers: list = dec.layers
    saved = list(layers)
    norm_name = final_norm_name(dec)
    saved_norm = getattr(dec, norm_name)
    try:
        skip, capture = set(skip_layers), set(capture_layers)
        for i in skip | capture:
            layers[i] = _Tap(saved[i], i, rec if i in capture else None, i in skip)
        if capture_final or keep_positions is not None:
            setattr(dec, norm_name, _FinalNorm(saved_norm, rec if capture_final else None, keep_positions))
        yield rec
    finally:
        layers[:] = saved
        setattr(dec, norm_name, saved_norm)
