"""The method-spec syntax every command accepts: ``name[:key=value,flag,...]``.

    ngram                          the method with its defaults
    ngram:k=8,fixed                k = 8, adaptive off (``fixed`` is ``adaptive=false``)
    ngram:ngram_proposer=lookup,adaptive=no,memory=0
    layerskip:skip_layers=[3,5,7]  a list: integers in brackets
    layerskip:skip_layers=middle:6
    draft:draft=small.gguf,draft_p_min=0.2

Keys are the method's options in the method table (``hf2q_py.methods``),
``-`` or ``_`` alike; values are parsed by the option's kind (integer,
number, boolean: yes/no/true/false/on/off/1/0, a choice, text, a layer
list). Several methods are separated by ``;`` (or by ``,`` when none has
options: ``ngram,layerskip``). Anything else is an ``Hf2qError`` naming the
key and the keys the method takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import Hf2qError
from .methods import OPTIONS, METHODS, Method, Option, allowed, foreign_option, method_named

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
#: Sampling is one setting for all methods, not a method option.
SAMPLING_KEYS = ("temperature", "temp", "top_p", "top_k", "min_p", "seed", "repetition_penalty")
#: Bare words that set an option: ``fixed`` is ``adaptive=false``.
_WORDS = {word: (o, value) for o in OPTIONS.values() for word, value in o.words.items()}


@dataclass
class MethodSpec:
    """A parsed method spec: ``label`` as written, ``options`` the
    ``SpecConfig`` fields it sets (``method`` included), typed."""

    label: str
    options: dict[str, Any]

    @property
    def method(self) -> str:
        return self.options["method"]


def parse_methods(text: str) -> list[MethodSpec]:
    """Several method specs: separated by ``;``, or by ``,`` when none has options."""
    return [parse_method(part) for part in split_methods(text)]


def split_methods(text: str) -> list[str]:
    """``a;b:k=2,fixed`` or ``a,b`` (the latter only when no method has options)."""
    sep = ";" if ";" in text or ":" in text else ","
    return [m for m in (x.strip() for x in text.split(sep)) if m]


def parse_method(text: str) -> MethodSpec:
    """One method spec, every key and value checked against the method table."""
    name, _, rest = text.strip().partition(":")
    name = name.strip()
    if name not in METHODS:
        raise Hf2qError(f"unknown method {name!r} in {text!r}; choose one of {', '.join(METHODS)}")
    method = method_named(name)
    options: dict[str, Any] = {"method": name}
    for item in _split_items(rest, text):
        key, value = parse_item(method, item, text)
        if key in options:
            raise Hf2qError(f"{key} is given twice in {text!r}")
        options[key] = value
    return MethodSpec(text.strip(), options)


def parse_item(method: Method, item: str, text: str = "") -> tuple[str, Any]:
    """``key=value`` or a bare word (``fixed``, or a boolean's name for true)
    of ``method``: the ``SpecConfig`` field and its typed, range-checked value."""
    text = text or item
    key, eq, value = (x.strip() for x in item.partition("="))
    key = key.replace("-", "_")
    word = _WORDS.get(key)
    option = OPTIONS.get(key) or (word[0] if word else None)
    if option is None:
        hint = (
            " (sampling is one setting for all methods: --temp, --seed, ...)" if key in SAMPLING_KEYS else ""
        )
        raise Hf2qError(
            f"unknown method option {key!r} in {text!r}; {method.name} takes {allowed(method)}{hint}"
        )
    if option.name not in method.options:
        raise Hf2qError(f"{foreign_option(option.name, method)} (in {text!r})")
    if word is not None and key not in OPTIONS:
        if eq:
            raise Hf2qError(f"{key} is a flag, not key=value, in {text!r}")
        return option.name, word[1]
    if not eq:
        if option.kind != "bool":
            raise Hf2qError(f"{key} needs a value ({key}=...) in {text!r}")
        value = "true"
    parsed = parse_value(option, value, text)
    try:
        option.check(parsed)
    except Hf2qError as e:
        raise Hf2qError(f"{e} (in {text!r})") from None
    return option.name, parsed


def parse_value(option: Option, value: str, text: str = "") -> Any:
    """A value written as text, by the option's kind (its range is not checked here)."""
    lowered = value.strip().lower()
    try:
        if option.kind == "int":
            return int(value)
        if option.kind == "float":
            return float(value)
        if option.kind == "bool":
            if lowered in _TRUE + _FALSE:
                return lowered in _TRUE
            raise ValueError
        if option.kind == "choice":
            if value.strip() in option.choices:
                return value.strip()
            raise ValueError
        if option.kind == "layers" and value.strip().startswith("["):
            return _layer_list(value)
        if value.strip():
            return value.strip()
        raise ValueError
    except ValueError:
        where = f" in {text!r}" if text else ""
        raise Hf2qError(f"bad value for {option.name}{where}: {value!r} ({_expected(option)})") from None


def _layer_list(value: str) -> list[int]:
    inner = value.strip()
    if not inner.endswith("]"):
        raise ValueError
    items = [x.strip() for x in inner[1:-1].split(",")]
    if not items or not all(x.isascii() and x.isdigit() for x in items):
        raise ValueError
    return [int(x) for x in items]


def _expected(option: Option) -> str:
    return {
        "int": "an integer",
        "float": "a number",
        "bool": "yes/no, true/false, on/off or 1/0",
        "choice": "one of " + ", ".join(option.choices),
        "layers": "a recipe (auto, alternate, early:N, middle:N) or a list like [3,5,7]",
    }.get(option.kind, "not empty")


def _split_items(rest: str, text: str) -> list[str]:
    """Split at commas outside brackets (``skip_layers=[3,5,7],k=4``)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(rest):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0:
            raise Hf2qError(f"unbalanced ']' in {text!r}")
        if ch == "," and depth == 0:
            items.append(rest[start:i])
            start = i + 1
    if depth:
        raise Hf2qError(f"unbalanced '[' in {text!r}")
    items.append(rest[start:])
    return [x.strip() for x in items if x.strip()]


def fill_options(
    specs: list[MethodSpec], given: dict[str, Any], defaults: dict[str, Any] | None = None
) -> list[MethodSpec]:
    """Options given once for all methods (command-line flags such as ``--k``,
    then a command's own ``defaults``) fill in each spec's options of that
    name that the spec leaves out; an option in the spec wins. A given
    option that none of the methods takes is an error."""
    for name in given:
        if not any(name in method_named(s.method).options for s in specs):
            owners = ", ".join(m.name for m in METHODS.values() if name in m.options)
            used = ", ".join(s.method for s in specs) or "no method"
            raise Hf2qError(f"{OPTIONS[name].cli_flag} is an option of {owners}; the methods here: {used}")
    for s in specs:
        method = method_named(s.method)
        for name, value in {**(defaults or {}), **given}.items():
            if name in method.options:
                s.options.setdefault(name, value)
    return specs
