"""An answer split into content and tool calls as its text streams in, each
call given out as it is written.

Content is given out as soon as no call can begin in it; from where a call
may begin (the format's marker, or a prefix of one; a fenced
```` ```json ```` block; a JSON value opening the answer) the text is a
*call region*, up to its end marker (or the end of the answer). A region of
JSON calls (``<tool_call>`` JSON, Llama 3.x's bare JSON, fenced JSON,
Mistral's ``[TOOL_CALLS]`` JSON list or ``name[ARGS]{...}``) is read as it
streams: a call begins (:class:`CallStart`) once its name is read and its
arguments object opens, the arguments text follows as it arrives
(:class:`CallDelta`, string and bracket state tracked so the wrapper's
closing characters are never part of it) and the call ends with the object
(:class:`CallEnd`). What does not read that way (arguments before the name
or as a JSON string, another format's syntax: Qwen3-Coder's XML, pythonic
lists, Gemma 4) is read whole at the region's end by the format's parser and
given out as whole calls; a region that does not read as calls is content.
A call given out stays a call: cut short (``max_tokens``), it ends with the
arguments written so far (``ToolCall.complete`` False). Whitespace between
calls is dropped. ``feed`` and ``finish`` give the same content and calls
however the text was cut.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from ..reasoning import partial_marker
from .tool_calls import FENCE, FENCE_END, PYTHON_TAG, ToolCall, ToolUse, parse_calls

#: Formats whose calls are JSON between their markers, read as they stream.
JSON_MARKER_FORMATS = ("json_tools", "mistral")
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class CallStart:
    """A call begins: its place among the answer's calls, its id and function name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallDelta:
    """More of a call's arguments text; a call's deltas joined are its arguments."""

    index: int
    arguments: str


@dataclass(frozen=True)
class CallEnd:
    """A call ends: the whole call (its arguments: the deltas joined)."""

    index: int
    call: ToolCall


Out = str | CallStart | CallDelta | CallEnd


class CallSplitter:
    """Splits an answer, as its text streams in, into content (``str``) and
    call events (see the module docstring)."""

    def __init__(self, use: ToolUse):
        self.use = use
        self.start = use.format.start if use.format is not None else ""
        self.buf = use.prefix
        self.region: _Region | None = None
        self.opened = False  # content given out yet
        self.space = ""  # whitespace held back: dropped if a call follows
        self.calls = 0  # calls begun and given out

    def feed(self, text: str) -> list[Out]:
        self.buf += text
        out: list[Out] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Out]:
        """What is left once the answer ended (a region still open is read as it is)."""
        out: list[Out] = []
        while self._step(out, final=True):
            pass
        if self.region is not None:
            self._take(self.region.finish(), out)
            self.region = None
        elif self.buf:
            self._content(self.buf, out)
        self.buf = ""
        if self.space and not self.calls:
            out.append(self.space)
        self.space = ""
        return out

    def begin(self, name: str, given_id: str = "") -> CallStart | None:
        """A call begins; None when it is dropped (``parallel_tool_calls``
        false and a call was given out)."""
        self.space = ""
        if not self.use.parallel and self.calls:
            return None
        self.calls += 1
        return CallStart(self.calls - 1, given_id or self.use.new_id(), name)

    def _step(self, out: list[Out], final: bool) -> bool:
        """One decision on the held text; False when more text is needed."""
        if self.region is not None:
            if not self.buf:
                return False
            items, rest = self.region.feed(self.buf)
            self.buf = ""
            self._take(items, out)
            if rest is None:
                return False
            self.region, self.buf = None, rest
            return True
        if not self.opened and not self.calls:
            head = (self.space + self.buf).lstrip()
            own_marker = bool(self.start) and (head.startswith(self.start) or self.start.startswith(head))
            if head.startswith(("{", "[", PYTHON_TAG)) and not own_marker:
                self.buf, self.space = self.space + self.buf, ""
                self.region = _Region(self, "", "", "bare", stream=True)
                return True
            if not head:
                self.space, self.buf = self.space + self.buf, ""
                return False
            if PYTHON_TAG.startswith(head) and not final:
                return False  # perhaps Llama's tag opening a call: wait
        markers = [m for m in (self.start, FENCE) if m]
        hits = [(i, m) for m in markers if (i := self.buf.find(m)) >= 0]
        if hits:
            i, marker = min(hits)
            self._content(self.buf[:i], out)
            self.buf, self.region = self.buf[i + len(marker) :], self._region(marker)
            return True
        keep = 0 if final else partial_marker(self.buf, markers)
        self._content(self.buf[: len(self.buf) - keep], out)
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _region(self, marker: str) -> _Region:
        if marker == FENCE:
            return _Region(self, FENCE, FENCE_END, "fence", stream=True)
        fmt = self.use.format
        streams = fmt.name in JSON_MARKER_FORMATS
        return _Region(self, marker, fmt.end, "marker", stream=streams, header=fmt.name == "mistral")

    def _take(self, items: list[Out], out: list[Out]) -> None:
        for item in items:
            if isinstance(item, str):
                self._content(item, out)
            else:
                out.append(item)

    def _content(self, text: str, out: list[Out]) -> None:
        """Give out content; trailing whitespace is held (a call may follow)."""
        body = text.rstrip()
        if body:
            out.append(self.space + body)
            self.space, self.opened = "", True
        self.space += text[len(body) :]


class _Region:
    """One call region's text (after its ``opening``, up to ``end``; no
    ``end``: to the end of the answer). With ``stream``, read as JSON calls
    character by character (``header``: Mistral's ``name[ARGS]{...}`` too);
    from the first character that does not read so (or from the start,
    without ``stream``) the rest is read whole at the region's end."""

    def __init__(self, owner: CallSplitter, opening: str, end: str, kind: str, stream: bool, header=False):
        self.owner, self.opening, self.end, self.kind, self.header = owner, opening, end, kind, header
        self.names = owner.use.names if kind != "marker" else None  # bare and fenced JSON must name a tool
        self.raw = ""  # the text read character by character
        self.pending = ""  # text not read yet (perhaps the start of a marker)
        self.text = ""  # the text read whole (once ``state`` is "opaque")
        self.searched = 0  # how much of ``text`` holds no end marker
        self.state = "between" if stream else "opaque"
        self.emitted = False  # a call of this region has begun
        self._reset_object()

    def _reset_object(self) -> None:
        self.obj_at: int | None = None  # where the object (or Mistral header) being read began in ``raw``
        self.key = self.name = None
        self.buf = ""  # a string literal being read, or a Mistral name
        self.began = False  # this object's call has begun
        self.call: CallStart | None = None  # ... and was given out
        self.args: str | None = None
        self.depth = 0
        self.stack = ""  # the arguments' open brackets
        self.closed = False  # the arguments' last value closed: a separator or a bracket comes next
        self.in_str = self.esc = False
        self.delta = ""

    # -- feeding -------------------------------------------------------------------------
    def feed(self, text: str) -> tuple[list[Out], str | None]:
        """The content and call events ``text`` makes ready, and the text
        after the region's end marker once it is found (else None)."""
        out: list[Out] = []
        if self.state == "opaque":
            self.text += text
            return out, self._opaque(out)
        self.pending += text
        rest = self._scan(out)
        if rest is None and self.state == "opaque":
            rest = self._opaque(out)
        return out, rest

    def finish(self) -> list[Out]:
        """The answer ended inside the region."""
        out: list[Out] = []
        if self.state == "drop":
            return out
        if self.state != "opaque":
            if self.began:
                self._end_call(out)  # cut short: the arguments written so far
                return out
            quiet = not self.pending.strip() or (self.end and self.end.startswith(self.pending))
            if self.state == "between" and self.emitted and quiet:
                return out
            self._fallback(out)
        self._whole(self.text, out, ended=False)
        return out

    def _scan(self, out: list[Out]) -> str | None:
        p, i = self.pending, 0
        while i < len(p) and self.state != "opaque":
            if self.end and not self.in_str:
                if p.startswith(self.end, i):
                    return self._ended(p, i, out)
                if len(p) - i < len(self.end) and self.end.startswith(p[i:]):
                    break  # perhaps the end marker: wait
            step = getattr(self, f"_{self.state}")(p, i, out)
            if step == 0:
                break
            i += step
        self._flush(out)
        self.raw, self.pending = self.raw + p[:i], p[i:]
        if self.state == "opaque":
            self._fallback(out)
        return None

    def _ended(self, p: str, i: int, out: list[Out]) -> str | None:
        """The end marker at ``p[i]``: the region is over (or, mid-object with
        no call begun, read whole)."""
        self.raw, self.pending = self.raw + p[:i], p[i:]
        if self.began:
            self._end_call(out)
            return p[i + len(self.end) :]
        if self.state in ("between", "drop") and self.emitted:
            return p[i + len(self.end) :]
        self._fallback(out)
        return None

    def _fallback(self, out: list[Out]) -> None:
        """From here on the region is read whole: from where reading failed
        (a call given out ends there), the object it failed in, or the start."""
        if self.began:
            self._end_call(out)
            at = len(self.raw)
        elif self.emitted:
            at = self.obj_at if self.obj_at is not None else len(self.raw)
        else:
            at = 0
        self.text, self.pending, self.searched = self.raw[at:] + self.pending, "", 0
        self.state = "opaque"
        self._reset_object()

    def _opaque(self, out: list[Out]) -> str | None:
        """Read whole once the end marker is there: the text after it (else None)."""
        if not self.end:
            return None
        k = self.text.find(self.end, max(0, self.searched - len(self.end) + 1))
        if k < 0:
            self.searched = len(self.text)
            return None
        self._whole(self.text[:k], out, ended=True)
        return self.text[k + len(self.end) :]

    def _whole(self, text: str, out: list[Out], ended: bool) -> None:
        """Calls read from ``text`` whole, or the text as content."""
        calls = parse_calls(self.owner.use, text, self.kind) if text.strip() else None
        if calls:
            for call in calls:
                self.emitted = True
                start = self.owner.begin(call.name, call.id)
                if start is not None:
                    whole = replace(call, id=start.id)
                    out += [start, CallDelta(start.index, call.arguments), CallEnd(start.index, whole)]
        elif text.strip() or not self.emitted:
            lead = "" if self.emitted else self.opening
            out.append(lead + text + (self.end if ended else ""))

    # -- calls ---------------------------------------------------------------------------
    def _begin(self, out: list[Out]) -> None:
        self.began = self.emitted = True
        self.args = ""
        self.call = self.owner.begin(self.name)
        if self.call is not None:
            out.append(self.call)

    def _flush(self, out: list[Out]) -> None:
        if self.delta and self.call is not None:
            out.append(CallDelta(self.call.index, self.delta))
        self.delta = ""

    def _end_call(self, out: list[Out]) -> None:
        self._flush(out)
        if self.call is not None:
            complete = self.depth == 0 and _is_object(self.args)
            call = ToolCall(self.name, self.args, self.call.id, complete)
            out.append(CallEnd(self.call.index, call))
        self.began, self.call = False, None

    def _close_object(self, out: list[Out]) -> None:
        """The object (or Mistral call) ends: its call ends, or begins and ends
        (a name without arguments); an object naming nothing is not a call."""
        if not self.began and self.name is None:
            self.state = "opaque"
            return
        if not self.began:
            self._begin(out)
            self.args = self.delta = "{}"
        self._end_call(out)
        self._reset_object()
        self.state = "between"

    # -- states: each reads ``p[i]`` on, returns the characters it read (0: wait, or opaque)
    def _between(self, p: str, i: int, out: list[Out]) -> int:
        c = p[i]
        for mark in (PYTHON_TAG, MISTRAL_CALLS) if self.header else (PYTHON_TAG,):
            if p.startswith(mark, i):
                return len(mark)
            if c == mark[0] and len(p) - i < len(mark) and mark.startswith(p[i:]):
                return 0  # perhaps the mark: wait
        if c.isspace() or c in ",;[]":
            return 1
        if c == "{" or (self.header and (c.isalnum() or c in "_-")):
            self._reset_object()
            self.obj_at, self.state = len(self.raw) + i, "key" if c == "{" else "header"
            self.buf = "" if c == "{" else c
            return 1
        self.state = "opaque"
        return 0

    def _key(self, p: str, i: int, out: list[Out]) -> int:
        """In an object, before a key or its end."""
        c = p[i]
        if c.isspace() or c == ",":
            return 1
        if c == '"':
            self.buf, self.in_str, self.state = c, True, "keystr"
            return 1
        if c == "}":
            self._close_object(out)
            return 1
        self.state = "opaque"
        return 0

    def _keystr(self, p: str, i: int, out: list[Out]) -> int:
        if self._literal(p[i]):
            self.key, self.state = _decoded(self.buf), "colon"
        return 1

    def _colon(self, p: str, i: int, out: list[Out]) -> int:
        c = p[i]
        if c.isspace():
            return 1
        self.state = "value" if c == ":" else "opaque"
        return 1 if c == ":" else 0

    def _value(self, p: str, i: int, out: list[Out]) -> int:
        c = p[i]
        if c.isspace():
            return 1
        if self.key == "name" and c == '"' and self.name is None:
            self.buf, self.in_str, self.state = c, True, "name"
            return 1
        if self.key in ARGUMENT_KEYS and c == "{" and self.name is not None and self.args is None:
            self._begin(out)
            self.state = "args"
            return self._args(p, i, out)
        if self.key == "name" or self.key in ARGUMENT_KEYS:
            self.state = "opaque"  # not streamable (arguments first, or as a string): read whole
            return 0
        self.depth, self.state = 0, "skip"
        return self._skip(p, i, out)

    def _name(self, p: str, i: int, out: list[Out]) -> int:
        if self._literal(p[i]):
            name = _decoded(self.buf)
            ok = isinstance(name, str) and name and (self.names is None or name in self.names)
            self.name, self.state = (name, "after") if ok else (None, "opaque")
        return 1

    def _args(self, p: str, i: int, out: list[Out]) -> int:
        c = p[i]
        if self.closed and not self.in_str and not c.isspace() and c not in ",:}]":
            return self._malformed(out)
        self.args += c
        self.delta += c
        if self.in_str:
            self._string_char(c)
            self.closed = not self.in_str
        elif c == '"':
            self.in_str = True
        elif c in ",:":
            self.closed = False
        elif c in "{[":
            self.depth += 1
            self.stack += c
        elif c in "}]":
            self.depth -= 1
            self.stack, self.closed = self.stack[:-1], True
            if self.depth == 0 and self.key is None:
                self._close_object(out)  # Mistral's name[ARGS]{...}: the call is over
            elif self.depth == 0:
                self.state = "after"
        return 1

    def _malformed(self, out: list[Out]) -> int:
        """The arguments stop being JSON (a string closed, then no separator: a
        quote the model did not escape): the call ends with what was JSON,
        closed (as ``ToolCall.input`` reads it), and the region's rest is dropped."""
        closing = ('"' if self.in_str else "") + "".join(
            "}" if b == "{" else "]" for b in reversed(self.stack)
        )
        if _is_object(self.args + closing):
            self.args += closing
            self.delta += closing
            self.depth = 0
        self._end_call(out)
        self._reset_object()
        self.state = "drop"
        return 1

    def _drop(self, p: str, i: int, out: list[Out]) -> int:
        """The rest of a region whose call was malformed, up to its end."""
        return 1

    def _skip(self, p: str, i: int, out: list[Out]) -> int:
        """The value of a key that is neither the name nor the arguments."""
        c = p[i]
        if self.in_str:
            self._string_char(c)
        elif self.depth == 0 and c in ",}":
            return self._after(p, i, out)
        elif c == '"':
            self.in_str = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
        return 1

    def _after(self, p: str, i: int, out: list[Out]) -> int:
        """After a value: the next key, or the object's end."""
        c = p[i]
        if c.isspace():
            return 1
        if c == ",":
            self.state = "key"
            return 1
        if c == "}":
            self._close_object(out)
            return 1
        self.state = "opaque"
        return 0

    def _header(self, p: str, i: int, out: list[Out]) -> int:
        """Mistral's ``name[ARGS]``."""
        if p.startswith(MISTRAL_ARGS, i):
            name = self.buf.strip()
            ok = name and all(ch.isalnum() or ch in "_-" for ch in name)
            self.name, self.state = (name, "hvalue") if ok else (None, "opaque")
            return len(MISTRAL_ARGS) if ok else 0
        c = p[i]
        if len(p) - i < len(MISTRAL_ARGS) and MISTRAL_ARGS.startswith(p[i:]):
            return 0
        if c.isalnum() or c in "_-" or c.isspace():
            self.buf += c
            return 1
        self.state = "opaque"
        return 0

    def _hvalue(self, p: str, i: int, out: list[Out]) -> int:
        c = p[i]
        if c.isspace():
            return 1
        if c != "{":
            self.state = "opaque"
            return 0
        self._begin(out)
        self.state = "args"
        return self._args(p, i, out)

    def _literal(self, c: str) -> bool:
        """One character of a string literal; True once it closes."""
        self.buf += c
        self._string_char(c)
        return not self.in_str

    def _string_char(self, c: str) -> None:
        if self.esc:
            self.esc = False
        elif c == "\\":
            self.esc = True
        elif c == '"':
            self.in_str = False


def _decoded(literal: str) -> object:
    try:
        return json.loads(literal)
    except ValueError:
        return None


def _is_object(text: str | None) -> bool:
    try:
        return isinstance(json.loads(text or ""), dict)
    except ValueError:
        return False


class AnswerSplitter:
    """The answer as content and whole calls (each given out when it ends)."""

    def __init__(self, use: ToolUse):
        self.inner = CallSplitter(use)

    @property
    def calls(self) -> int:
        return self.inner.calls

    def feed(self, text: str) -> list[str | ToolCall]:
        return _whole_calls(self.inner.feed(text))

    def finish(self) -> list[str | ToolCall]:
        return _whole_calls(self.inner.finish())


def _whole_calls(items: list[Out]) -> list[str | ToolCall]:
    return [i.call if isinstance(i, CallEnd) else i for i in items if isinstance(i, (str, CallEnd))]


def split_answer(use: ToolUse, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's content (None when empty) and tool calls."""
    splitter = AnswerSplitter(use)
    pieces = splitter.feed(text) + splitter.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return (content or None), [p for p in pieces if isinstance(p, ToolCall)]
