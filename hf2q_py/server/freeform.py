"""Freeform tools (OpenAI's ``custom`` tools): a tool whose call carries one
text, not JSON arguments.

The model is offered such a tool as a function with one string argument,
``input`` (the chat template writes it like any function), and its call is
read back as that argument's text (:func:`call_input`; streamed by
:class:`InputDeltas`). When the tool carries a grammar (Lark, as Codex's
``apply_patch`` does, or a regular expression), the call's input is
constrained by it while the answer is generated and speculated: the answer
as a whole is given a grammar (:func:`answer_constraint`) that allows free
text and calls in the model's call syntax (:class:`CallSyntax`), a call of a
freeform tool with a grammar having its input follow that grammar (as the
syntax writes the input: inside a JSON string, or raw), calls of other tools
anything up to the call's end. So the grammar engine masks only the tokens
of those inputs, and drafts that break an input's grammar are cut before
they are verified, like any structured output. The syntaxes known are the
``<tool_call>`` formats: JSON inside the tags (Hermes, Qwen2.5, Qwen3) and
Qwen3-Coder's XML; under other formats the tool is offered and read the same
way, its input unconstrained.

A request's own output constraint (``text.format``) joins the same grammar
when tools are given: the answer is then calls, or the constrained text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from ..constraints import JSON_OPTIONS, ConstraintSpec
from ..errors import Hf2qError
from ..grammar_quote import embed_lark, embed_regex
from .tool_calls import ToolUse

#: The one argument a freeform tool is offered with.
INPUT = "input"


def function_definition(name: str, description: str | None, grammar: ConstraintSpec | None) -> dict[str, Any]:
    """A freeform tool as the OpenAI function definition templates take: one
    string argument ``input``, described with the grammar it follows."""
    about = "The tool's input, as free text (not JSON)."
    if grammar is not None:
        kind = "Lark grammar" if grammar.kind == "grammar" else "regular expression"
        about += f" It follows this {kind}:\n{grammar.text}"
    fn: dict[str, Any] = {
        "name": name,
        "parameters": {
            "type": "object",
            "properties": {INPUT: {"type": "string", "description": about}},
            "required": [INPUT],
        },
    }
    if description:
        fn["description"] = description
    return {"type": "function", "function": fn}


def check_grammar(grammar: ConstraintSpec) -> str | None:
    """What keeps a freeform tool's grammar from constraining its input, or None."""
    problem = grammar.problem()
    if problem is not None:
        return problem
    try:
        for quote in (True, False):
            _embedded(grammar, "t0_", quote)
    except Hf2qError as e:
        return str(e)
    return None


def _embedded(grammar: ConstraintSpec, prefix: str, quote: bool) -> tuple[str, str]:
    if grammar.kind == "grammar":
        return embed_lark(grammar.text, prefix, quote)
    return embed_regex(grammar.text, prefix, quote)


def call_input(arguments: str) -> str:
    """A freeform call's input from its arguments (JSON text): the ``input``
    string; else the one string value given; else the arguments as written."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict):
        if isinstance(value.get(INPUT), str):
            return value[INPUT]
        strings = [v for v in value.values() if isinstance(v, str)]
        if len(value) == 1 and strings:
            return strings[0]
    return arguments


class InputDeltas:
    """A freeform call's input decoded as its arguments stream in: the
    ``input`` string's characters as soon as they are read (arguments that
    do not open with it give the input whole at the end)."""

    OPENING = re.compile(r'\s*\{\s*"' + INPUT + r'"\s*:\s*"')

    def __init__(self):
        self.raw = ""  # the arguments so far
        self.at: int | None = None  # where the undecoded part of the string begins
        self.given = ""  # the input given out
        self.closed = False

    def feed(self, arguments: str) -> str:
        """The input text newly readable after ``arguments`` (more of the arguments)."""
        self.raw += arguments
        if self.at is None:
            m = self.OPENING.match(self.raw)
            if m is None:
                return ""
            self.at = m.end()
        out = []
        while not self.closed and self.at < len(self.raw):
            m = _PIECE.match(self.raw, self.at)
            if m is None or (_HIGH.fullmatch(m.group()) and len(self.raw) - m.end() < 6):
                break  # an escape not whole yet, or half of a pair whose other half may follow
            text = m.group()
            self.at = m.end()
            if text == '"':
                self.closed = True
            else:
                out.append(text if text[0] != "\\" else json.loads(f'"{text}"'))
        piece = "".join(out)
        self.given += piece
        return piece

    def finish(self, arguments: str) -> str:
        """The rest of the input once the call ended with ``arguments`` (all of them)."""
        whole = call_input(arguments)
        return whole[len(self.given) :] if whole.startswith(self.given) else ""


#: The pieces a JSON string's text is read in: plain characters, an escape (a surrogate pair whole), its end.
_PIECE = re.compile(
    r'[^"\\]+|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|\\[^u]|"'
)
_HIGH = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}")


# -- the answer's grammar ---------------------------------------------------------------------
@dataclass(frozen=True)
class CallSyntax:
    """How a tool-call format writes a freeform call: between ``marker`` and
    ``end``, ``head`` (a Rust regex, ``{name}`` the tool's name) before the
    input and ``tail`` after it, ``quote``: the input inside a JSON string;
    ``other``: the opening that names a tool (``{names}``: alternatives)."""

    marker: str
    end: str
    head: str
    tail: str
    quote: bool
    other: str


SYNTAXES = {
    "json_tools": CallSyntax(
        "<tool_call>", "</tool_call>",
        r'\s*\{\s*"name"\s*:\s*"{name}"\s*,\s*"arguments"\s*:\s*\{\s*"input"\s*:\s*"',
        r'"\s*\}\s*\}\s*', True, r'\s*\{\s*"name"\s*:\s*"({names})"',
    ),
    "qwen3_coder": CallSyntax(
        "<tool_call>", "</tool_call>",
        r"\s*<function={name}>\s*<parameter=input>\n", r"\n</parameter>\s*</function>\s*", False,
        r"\s*<function=({names})>",
    ),
}  # fmt: skip


def answer_constraint(
    use: ToolUse | None,
    freeform: dict[str, ConstraintSpec | None],
    text: ConstraintSpec | None,
    special: Callable[[list[str]], dict[str, int]] = lambda texts: {},
) -> ConstraintSpec | None:
    """The constraint of a whole answer: ``text`` (the request's own) alone,
    or, with tools whose calls the grammar can read (freeform tools with a
    grammar, or tools beside a JSON ``text``), one grammar of free text (or
    the ``text``) and calls, each freeform input following its grammar.
    ``special``: which of the call syntax's markers are one token the grammar
    engine reads as special (:func:`~hf2q_py.constraints.special_tokens`),
    named by id in the grammar."""
    if use is None:
        return text
    syntax = SYNTAXES.get(use.format.name) if use.format is not None else None
    grammars = {n: g for n, g in freeform.items() if g is not None and n in use.names}
    json_text = text is not None and text.kind in ("json_object", "json_schema")
    if syntax is None or not (grammars or json_text) or (text is not None and not json_text):
        return text
    lark = _answer_grammar(syntax, grammars, text, special([syntax.marker, syntax.end]))
    return ConstraintSpec("grammar", lark, after=use.prefix)


def _answer_grammar(
    syntax: CallSyntax,
    grammars: dict[str, ConstraintSpec],
    text: ConstraintSpec | None,
    special: dict[str, int],
) -> str:
    """Free text (or ``text``) and calls; a marker that is a special token is
    a lexeme of its own, one written as text ends the terminal before it."""
    no_marker = f"~/(?s:.*){_lark_regex(syntax.marker)}(?s:.*)/"
    lines = [
        "%llguidance {}",
        "answer: " + (f"%json {json.dumps(_schema(text))}" if text is not None else "TAIL"),
    ]
    if syntax.marker in special:
        mark = f"<[{special[syntax.marker]}]>"
        lines += ["start: turn* answer?" if text is None else "start: turn+ SPACE? | answer",
                  f"turn: {'TAIL' if text is None else 'SPACE'}? {mark} body",
                  f"TAIL: /(?s:.+)/ & {no_marker}", "SPACE: /\\s+/"]  # fmt: skip
    else:
        lines += ["start: turn* answer" if text is None else "start: turn+ SPACE | answer", "turn: HEAD body",
                  f"FREE: /(?s:.*)/ & {no_marker}", f"HEAD: {'FREE' if text is None else 'SPACE'} {json.dumps(syntax.marker)}",
                  "TAIL: FREE", "SPACE: /\\s*/"]  # fmt: skip
    names = "|".join(re.escape(n) for n in grammars)
    other = f" & ~/{_slashed(syntax.other.replace('{names}', names))}(?s:.*)/" if names else ""
    no_end = f"~/(?s:.*){_lark_regex(syntax.end)}(?s:.*)/"
    calls = [f"call{i}" for i in range(len(grammars))]
    if syntax.end in special:
        lines += [f"body: ({' | '.join(['OTHER', *calls])}) <[{special[syntax.end]}]>",
                  f"OTHER: /(?s:.+)/ & {no_end}{other}", f"CLOSE: /{_slashed(syntax.tail)}/"]  # fmt: skip
    else:
        lines += [f"body: {' | '.join(['OTHER', *calls])}", f"OTHER: (/(?s:.*)/ & {no_end}{other}) {json.dumps(syntax.end)}",
                  f"CLOSE: /{_slashed(syntax.tail)}{_lark_regex(syntax.end)}/"]  # fmt: skip
    for i, (name, grammar) in enumerate(grammars.items()):
        rules, start = _embedded(grammar, f"t{i}_", syntax.quote)
        head = _slashed(syntax.head.replace("{name}", re.escape(name)))
        lines += [f"call{i}: OPEN{i} {start} CLOSE", f"OPEN{i}: /{head}/", rules]
    return "\n".join(lines) + "\n"


def _slashed(regex: str) -> str:
    """A regular expression's text inside a Lark ``/.../``."""
    return regex.replace("/", "\\/")


def _lark_regex(literal: str) -> str:
    """``literal`` as regular-expression text inside a Lark ``/.../``."""
    return re.escape(literal).replace("/", "\\/")


def _schema(text: ConstraintSpec) -> dict[str, Any]:
    """The JSON schema of a JSON ``text`` constraint, written as the server writes JSON."""
    schema = {"type": "object"} if text.kind == "json_object" else json.loads(text.text)
    return {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
