"""A tool's input grammar embedded in a grammar for a whole answer, as the
answer writes the input: raw, or inside a JSON string.

A freeform tool's input (a Lark grammar or a regular expression, as OpenAI's
``custom`` tools carry them) becomes rules of a larger grammar
(:func:`embed_lark`, :func:`embed_regex`): its rule and terminal names get a
prefix of their own, and ``%import common.X`` is replaced by X's definition.
With ``quote`` the grammar is rewritten to match what the same text is inside
a JSON string. JSON escaping replaces each character by a fixed text (``"``
by ``\\"``, ``\\`` by ``\\\\``, a line break by ``\\n``, ...), so rewriting the
literals and regular expressions alone turns the grammar's language into
exactly the language of the escaped texts: a string the rewritten grammar
accepts decodes (``json.loads``) to one the original accepts, and every
string the original accepts, escaped as ``json.dumps`` writes it, is
accepted. The escapes allowed are the short ones (``\\"``, ``\\\\``, ``\\n``,
``\\r``, ``\\t``, ``\\b``, ``\\f``) and ``\\u00XX`` for the other control
characters; every other character is written as itself.

The grammar engine (llguidance) splits the text into lexemes greedily, one
byte of look-ahead deciding where a lexeme ends; an escape starts with ``\\``
whichever character it stands for, so a lexeme that may go on with an
escape could not tell it from the next lexeme's. The rewrite therefore makes
every escape a lexeme of its own: the tool's terminals become rules,
expressions whose texts hold no escaped character stay one lexeme each, and
an expression that may hold one is written character by character (a
repeated class at the end of the expression as runs of its plain characters
between escapes). Lexemes then end where the original grammar's did.

The grammars are llguidance's Lark dialect (JSON string literals, Rust
regular expressions, ``#`` and ``//`` comments). Refused, with a message
naming the feature: ``%ignore`` and the other directives besides
``%import common``, lexeme options, special tokens, case-insensitive
literals and regex flags, and anchors, look-arounds and lazy repetitions in
regular expressions.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .errors import Hf2qError

#: The characters JSON escapes with a short escape, and the letter after the backslash.
_SHORT = {'"': '"', "\\": "\\", "\n": "n", "\r": "r", "\t": "t", "\b": "b", "\f": "f"}
#: Every character JSON escapes.
ESCAPED = frozenset([*(chr(c) for c in range(32)), '"', "\\"])
#: The class of the characters JSON escapes (Rust syntax).
ESCAPED_CLASS = r'[\x00-\x1F"\\]'

#: Definitions of Lark's ``common`` terminals a tool grammar may import.
COMMON = {
    "LF": r"/\n/",
    "CR": r"/\r/",
    "NEWLINE": r"/(\r?\n)+/",
    "WS": r"/[ \t\f\r\n]+/",
    "WS_INLINE": r"/[ \t]+/",
    "DIGIT": r"/[0-9]/",
    "HEXDIGIT": r"/[0-9a-fA-F]/",
    "INT": r"/[0-9]+/",
    "SIGNED_INT": r"/[+-]?[0-9]+/",
    "DECIMAL": r"/[0-9]+\.[0-9]*|\.[0-9]+/",
    "FLOAT": r"/([0-9]+(\.[0-9]*)?|\.[0-9]+)[eE][+-]?[0-9]+|[0-9]+\.[0-9]*|\.[0-9]+/",
    "NUMBER": r"/([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?/",
    "SIGNED_NUMBER": r"/[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?/",
    "LCASE_LETTER": r"/[a-z]/",
    "UCASE_LETTER": r"/[A-Z]/",
    "LETTER": r"/[a-zA-Z]/",
    "WORD": r"/[a-zA-Z]+/",
    "CNAME": r"/[_a-zA-Z][_a-zA-Z0-9]*/",
    "ESCAPED_STRING": r'/"([^"\\\n]|\\.)*"/',
}

# -- Lark ------------------------------------------------------------------------------------
_TOKEN = re.compile(
    r"""(?P<space>[ \t\r\n]+)
      | (?P<comment>(\#|//)[^\n]*)
      | (?P<string>"(\\(["\\/bfnrt]|u[a-fA-F0-9]{4}|x[a-fA-F0-9]{2})|[^"\\\x00-\x1F\x7F])*"i?)
      | (?P<regex>/(\\.|[^/\\\n])+/[a-z]*)
      | (?P<directive>%[a-z]+)
      | (?P<special><[^<>\s]+>)
      | (?P<ref>@[A-Za-z0-9_\-]+)
      | (?P<name>[!?]?_?[A-Za-z][A-Za-z0-9_\-]*)
      | (?P<other>->|\.\.|.)""",
    re.X,
)
_REFUSED = {
    "directive": "the {} directive",
    "special": "the special token {}",
    "ref": "the grammar reference {}",
}


def embed_lark(grammar: str, prefix: str, quote: bool) -> tuple[str, str]:
    """The Lark ``grammar``'s rules renamed with ``prefix`` (``quote``: rewritten
    for the inside of a JSON string, its terminals made rules) and the name
    of its start rule. Hf2qError names what cannot be embedded."""
    tokens = _lark_tokens(_inline_imports(grammar))
    if ("name", "start") not in tokens:
        raise Hf2qError("the grammar has no start rule")
    out: list[str] = []
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        if kind in _REFUSED:
            raise Hf2qError(f"{_REFUSED[kind].format(text)} is not supported in a tool's grammar")
        if kind == "name" and tokens[i + 1 : i + 2] == [("other", "[")] and _at_definition(tokens, i):
            raise Hf2qError(f"lexeme options ({text}[...]) are not supported in a tool's grammar")
        if kind == "string" and tokens[i + 1 : i + 2] == [("other", "..")] and i + 2 < len(tokens):
            out.append(_range(text, tokens[i + 2][1], quote))
            i += 3
            continue
        out.append(_token(kind, text, prefix, quote))
        i += 1
    return "".join(out), f"{prefix}start"


def _lark_tokens(grammar: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(grammar):
        m = _TOKEN.match(grammar, pos)
        out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


def _at_definition(tokens: list[tuple[str, str]], i: int) -> bool:
    """Whether the name at ``i`` begins a line (a definition, not a use)."""
    j = i - 1
    while j >= 0 and tokens[j][0] in ("space", "comment") and "\n" not in tokens[j][1]:
        j -= 1
    return j < 0 or "\n" in tokens[j][1]


def _inline_imports(grammar: str) -> str:
    """``%import common.X`` (``-> ALIAS``, or ``common (X, Y)``) replaced by definitions."""

    def define(m: re.Match) -> str:
        pairs = [(m.group(1), m.group(2) or m.group(1))] if m.group(1) else [
            (n.strip(), n.strip()) for n in m.group(3).split(",") if n.strip()
        ]  # fmt: skip
        for name, _ in pairs:
            if name not in COMMON:
                raise Hf2qError(f"%import common.{name}: not one of the common terminals this server knows")
        return "\n".join(f"{alias}: {COMMON[name]}" for name, alias in pairs)

    return re.sub(
        r"^[ \t]*%import[ \t]+common(?:\.([A-Z_][A-Z0-9_]*)(?:[ \t]*->[ \t]*([A-Z_][A-Z0-9_]*))?"
        r"|[ \t]*\(([^)]*)\))[ \t]*$",
        define,
        grammar,
        flags=re.M,
    )


def _token(kind: str, text: str, prefix: str, quote: bool) -> str:
    if kind == "name":
        return _renamed(text, prefix, quote)
    if kind == "string" and quote:
        return _quoted_string(text)
    if kind == "regex" and quote:
        body, flags = text[1:].rsplit("/", 1)
        return quoted_regex(body.replace("\\/", "/"), flags)
    return text


def _renamed(name: str, prefix: str, quote: bool) -> str:
    """``name`` with ``prefix`` after its sigils (``?``, ``!``, ``_``); a
    terminal's prefix in upper case, or (``quote``) the terminal made a rule
    named ``{prefix}_{name}`` in lower case."""
    sigils = re.match(r"[!?]?_?", name).group()
    bare = name[len(sigils) :]
    if not bare[0].isupper():
        return sigils + prefix + bare
    return sigils + (f"{prefix}_{bare.lower()}" if quote else prefix.upper() + bare)


def _decoded(literal: str) -> str:
    """A Lark string literal's text (JSON syntax, plus ``\\xHH``)."""
    return json.loads(re.sub(r"\\x([0-9a-fA-F]{2})", r"\\u00\1", literal))


def _quoted_string(literal: str) -> str:
    """A string literal as the same text escaped inside a JSON string (one
    lexeme, or a sequence when a control character's hex digits may be
    written in either case)."""
    insensitive = literal.endswith("i")
    value = _decoded(literal[:-1] if insensitive else literal)
    escaped = json.dumps(value, ensure_ascii=False)[1:-1]
    if escaped == value:
        return literal
    if insensitive:
        raise Hf2qError(f"the case-insensitive literal {literal} holds characters JSON escapes")
    if not any(c in ESCAPED and c not in _SHORT for c in value):
        return json.dumps(escaped)
    return "(" + " ".join(_unit(c) for c in value) + ")"


def _range(first: str, last: str, quote: bool) -> str:
    """A literal range ``"a".."z"``; quoted, the class of its characters."""
    a, b = _decoded(first), _decoded(last)
    if len(a) != 1 or len(b) != 1:
        raise Hf2qError(f"the range {first}..{last} must be of single characters")
    if not quote:
        return f"{first}..{last}"
    return _set_unit(f"[\\x{{{ord(a):X}}}-\\x{{{ord(b):X}}}]", run=False)


def embed_regex(regex: str, prefix: str, quote: bool) -> tuple[str, str]:
    """A regular expression as a one-rule Lark grammar named with ``prefix``
    (``quote``: rewritten for the inside of a JSON string) and its rule's name."""
    body = regex.replace("\\/", "/")
    expr = quoted_regex(body, "") if quote else f"/{body.replace('/', chr(92) + '/')}/"
    return f"{prefix}start: {expr}\n", f"{prefix}start"


# -- units: one character, as a lexeme of the quoted grammar ------------------------------------
def _escape_regex(c: str) -> str:
    """Rust regular-expression text matching ``c`` as JSON escapes it."""
    if c in _SHORT:
        return "\\\\" + ("\\" + _SHORT[c] if _SHORT[c] in '\\"' else _SHORT[c])
    hi, lo = f"{ord(c):04x}"[:3], f"{ord(c):04x}"[3]
    return "\\\\u" + hi + (f"[{lo}{lo.upper()}]" if lo.isalpha() else lo)


def _unit(c: str) -> str:
    """A lexeme matching the one character ``c`` as written inside a JSON string."""
    if c in _SHORT:
        return json.dumps("\\" + _SHORT[c])
    if c in ESCAPED:
        return f"/{_escape_regex(c)}/"
    return json.dumps(c)


def _set_unit(text: str, run: bool) -> str:
    """One character of the Rust class ``text`` (``run``: a run of its plain
    characters) as written inside a JSON string: its plain characters as one
    lexeme, or each escaped character's escape."""
    members = sorted(c for c in ESCAPED if _in_class(text, c))
    plain = "/" + f"[{text}--{ESCAPED_CLASS}]{'+' if run else ''}".replace("/", "\\/") + "/"
    if not members:
        return plain
    return "(" + " | ".join([plain, *(_unit(c) for c in members)]) + ")"


# -- regular expressions -----------------------------------------------------------------------
@dataclass
class _Lit:
    char: str


@dataclass
class _Set:
    text: str  # a Rust class: bracketed, or a class escape


@dataclass
class _Seq:
    items: list


@dataclass
class _Alt:
    branches: list


@dataclass
class _Rep:
    node: object
    quantifier: str  # *, +, ? or {n}, {n,}, {n,m}


def quoted_regex(src: str, flags: str = "") -> str:
    """The Rust regular expression ``src`` (Lark ``flags``: ``s``, ``m`` and
    ``u`` taken) as a Lark expression matching its texts as written inside a
    JSON string: itself when none of its texts holds an escaped character."""
    bad = set(flags) - set("smu")
    if bad:
        raise Hf2qError(
            f"the regular expression flag {''.join(sorted(bad))!r} is not supported in a tool's grammar"
        )
    reader = _Reader(src, dotall="s" in flags)
    tree = reader.alternation()
    if reader.pos != len(src):
        raise Hf2qError(f"the regular expression /{src}/ has an unmatched ')'")
    if not _escapes(tree):
        return "/" + src.replace("/", "\\/") + "/" + flags
    return _lark(tree, tail=True)


def _escapes(node) -> bool:
    """Whether a text of ``node`` may hold a character JSON escapes."""
    if isinstance(node, _Lit):
        return node.char in ESCAPED
    if isinstance(node, _Set):
        return any(_in_class(node.text, c) for c in ESCAPED)
    if isinstance(node, _Rep):
        return _escapes(node.node)
    return any(_escapes(n) for n in (node.items if isinstance(node, _Seq) else node.branches))


def _lark(node, tail: bool) -> str:
    """``node`` as a Lark expression of one-character lexemes; ``tail``: nothing
    of the expression follows it, so a repeated class may be read in runs."""
    if isinstance(node, _Lit):
        return _unit(node.char)
    if isinstance(node, _Set):
        return _set_unit(node.text, run=False)
    if isinstance(node, _Rep):
        if tail and isinstance(node.node, _Set) and node.quantifier in "*+":
            return f"{_set_unit(node.node.text, run=True)}{node.quantifier}"
        return f"({_lark(node.node, tail=False)}){node.quantifier}"
    if isinstance(node, _Seq):
        parts = [_lark(n, tail and k == len(node.items) - 1) for k, n in enumerate(node.items)]
        return "(" + " ".join(parts) + ")" if parts else ""
    branches = [_lark(b, tail) for b in node.branches]
    kept = [b for b in branches if b]
    body = "(" + " | ".join(kept) + ")"
    return body + "?" if len(kept) < len(branches) else body


_QUANTIFIER = re.compile(r"[*+?]|\{\d+(,\d*)?\}")


class _Reader:
    """A recursive-descent reader of a Rust regular expression into a tree of
    characters, classes, sequences, alternatives and repetitions."""

    def __init__(self, src: str, dotall: bool):
        self.src, self.pos, self.dotall = src, 0, dotall

    def _peek(self) -> str:
        return self.src[self.pos] if self.pos < len(self.src) else ""

    def _fail(self, what: str):
        raise Hf2qError(
            f"the regular expression /{self.src}/ uses {what}, which a tool's grammar cannot use here"
        )

    def alternation(self) -> _Alt | _Seq:
        branches = [self._sequence()]
        while self._peek() == "|":
            self.pos += 1
            branches.append(self._sequence())
        return branches[0] if len(branches) == 1 else _Alt(branches)

    def _sequence(self) -> _Seq:
        items = []
        while self._peek() not in ("", "|", ")"):
            item = self._atom()
            while self._peek() in ("*", "+", "?", "{"):
                m = _QUANTIFIER.match(self.src, self.pos)
                if m is None:
                    self._fail("a '{' that is not a repetition")
                self.pos = m.end()
                if self._peek() == "?":
                    self._fail("a lazy repetition")
                item = _Rep(item, m.group())
            if item is not None:
                items.append(item)
        return _Seq(items)

    def _atom(self):
        c = self.src[self.pos]
        self.pos += 1
        if c == "(":
            return self._group()
        if c == "[":
            return _Set(self._class_text())
        if c == ".":
            return _Set(r"[\x{0}-\x{10FFFF}]" if self.dotall else r"[^\n]")
        if c == "\\":
            return self._escape()
        if c in "^$":
            self._fail(f"the anchor {c!r}")
        return _Lit(c)

    def _group(self):
        if self.src.startswith(("?=", "?!", "?<=", "?<!"), self.pos):
            self._fail("a look-around")
        m = re.compile(r"\?(P?<[A-Za-z_][A-Za-z0-9_]*>|[a-zA-Z-]*[:)])").match(self.src, self.pos)
        head = m.group() if m else ""
        self.pos += len(head)
        saved = self.dotall
        if head[-1:] in (":", ")"):
            self._flags(head[1:-1])
        if head.endswith(")"):  # (?s): for the rest of the enclosing group
            return None
        inner = self.alternation()
        if self._peek() != ")":
            self._fail("an unclosed group")
        self.pos += 1
        self.dotall = saved
        return inner

    def _flags(self, flags: str) -> None:
        on, _, off = flags.partition("-")
        for f in on + off:
            if f not in "smuU":
                self._fail(f"the flag {f!r}")
        self.dotall = True if "s" in on else False if "s" in off else self.dotall

    def _class_text(self) -> str:
        """The class opened by the ``[`` just read, to its closing ``]``, nested classes included."""
        start, depth = self.pos - 1, 1
        if self._peek() == "^":
            self.pos += 1
        if self._peek() == "]":
            self.pos += 1
        while depth:
            c = self._peek()
            if not c:
                self._fail("an unclosed '['")
            self.pos += 2 if c == "\\" else 1
            if c == "[" and self.src.startswith(":", self.pos):
                end = self.src.find(":]", self.pos)
                self.pos = end + 2 if end >= 0 else self.pos
            elif c == "[":
                depth += 1
            elif c == "]":
                depth -= 1
        return self.src[start : self.pos]

    def _escape(self):
        c = self._peek()
        if not c:
            self._fail("a trailing backslash")
        self.pos += 1
        if c in "dDsSwW":
            return _Set("\\" + c)
        if c in "pP":
            m = re.compile(r"\{[^}]*\}|[A-Za-z]").match(self.src, self.pos)
            if m is None:
                self._fail("an unfinished \\p")
            self.pos = m.end()
            return _Set("\\" + c + m.group())
        if c in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[c]
            m = re.compile(r"\{[0-9a-fA-F]+\}|[0-9a-fA-F]{" + str(width) + "}").match(self.src, self.pos)
            if m is None:
                self._fail(f"an unfinished \\{c}")
            self.pos = m.end()
            return _Lit(chr(int(m.group().strip("{}"), 16)))
        simple = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}
        if c in simple:
            return _Lit(simple[c])
        if c.isalnum():
            self._fail(f"the escape \\{c}")
        return _Lit(c)


#: Rust's ``\s`` (Unicode White_Space), spelled out for Python's ``regex`` module.
_SPACE = r"\t\n\x0B\f\r \x85\xA0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000"


def _in_class(text: str, c: str) -> bool:
    """Whether the Rust class ``text`` (bracketed, or a class escape) holds ``c``."""
    import regex

    py = re.sub(r"\\([xuU])\{([0-9a-fA-F]+)\}", lambda m: f"\\U{int(m.group(2), 16):08x}", text)
    py = py.replace(r"\s", f"[{_SPACE}]").replace(r"\S", f"[^{_SPACE}]")
    try:
        return regex.fullmatch("(?V1)" + py, c) is not None
    except regex.error as e:
        raise Hf2qError(f"the character class {text} could not be read ({e})") from None
