"""Type and range checks for options: a wrongly typed or out-of-range value
is an ``Hf2qError`` naming the option, never a ``TypeError`` later on."""

from __future__ import annotations

import math
from typing import Any

from .errors import Hf2qError


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """An integer (not a bool) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise Hf2qError(f"{name} must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise Hf2qError(f"{name} must be {_range(lo, hi)}, got {value}")
    return value


def check_float(
    name: str,
    value: Any,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    """A finite real number in the range (``lo_open``/``hi_open``: bound excluded)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Hf2qError(f"{name} must be a number, got {value!r}")
    try:
        v = float(value)
    except OverflowError:  # an int too large for a float
        v = math.inf
    bad = not math.isfinite(v)
    bad = bad or (lo is not None and (v <= lo if lo_open else v < lo))
    bad = bad or (hi is not None and (v >= hi if hi_open else v > hi))
    if bad:
        if lo is not None and hi is not None:
            where = f" in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        elif lo is not None:
            where = f" {'>' if lo_open else '>='} {lo:g}"
        elif hi is not None:
            where = f" {'<' if hi_open else '<='} {hi:g}"
        else:
            where = ""
        raise Hf2qError(f"{name} must be a finite number{where}, got {value!r}")
    return v


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise Hf2qError(f"{name} must be True or False, got {value!r}")
    return value


def _range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"in [{lo}, {hi}]"
    return f">= {lo}" if lo is not None else f"<= {hi}"


def check_unicode(text: str, what: str = "the prompt") -> None:
    """Refuse text that cannot be encoded as UTF-8: lone surrogates, as from
    undecodable command-line bytes or a JSON escape like ``"\\ud800"``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Hf2qError(
            f"{what} is not valid Unicode text (lone surrogate {text[e.start]!r} at character {e.start})"
        ) from None


SKIP_RECIPES = "auto, alternate, early:N, middle:N or a list like 3,5,7"


def _is_number(text: str) -> bool:
    text = text.strip()
    return text.isascii() and text.isdigit()


def check_skip_layers(spec: Any) -> None:
    """The layer-skip set's form (its range needs the model: checked at build)."""
    if isinstance(spec, str):
        name, colon, arg = spec.partition(":")
        if spec in ("auto", "alternate"):
            return
        if name in ("early", "middle") and colon:
            if not _is_number(arg) or int(arg) < 1:
                raise Hf2qError(f"skip recipe {spec!r} needs a layer count >= 1, e.g. {name}:8")
            return
        items = [x.strip() for x in spec.split(",") if x.strip()]
        if not items or not all(_is_number(x) for x in items):
            raise Hf2qError(f"bad skip layers {spec!r}: use {SKIP_RECIPES}")
        return
    if (
        isinstance(spec, (list, tuple))
        and spec
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in spec)
    ):
        return
    raise Hf2qError(f"skip layers must be {SKIP_RECIPES} (or a list of layer ids), got {spec!r}")
