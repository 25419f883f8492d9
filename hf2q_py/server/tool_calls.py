"""Tool calls: how a chat request's tools reach the model, and how the
model's answer is split into content and calls.

The tool-call format is chosen as mlx-lm chooses it (the parser a checkpoint
names, else the markers its chat template or vocabulary holds; the parsers
are mlx-lm's own, ``mlx_lm.tool_parsers``), plus what mlx-lm lacks: Llama
3.x's bare JSON calls, Hermes-style ``<tool_call>`` templates mlx-lm does
not recognise, and, for every model, a call written as JSON naming one of
the request's tools, alone or in a fenced ```` ```json ```` block (how
Qwen2.5-Coder answers; Ollama reads it the same way), and gpt-oss's harmony
messages addressed ``to=functions.NAME`` (which the reasoning splitter,
``hf2q_py.reasoning``, hands on as ``<|channel|>commentary
to=functions.NAME<|message|>ARGUMENTS<|call|>``).

``tool_choice``: ``auto`` renders the tools; ``none`` renders without
them and parses nothing; ``required`` and a named function start the
answer with the format's call opening (``<tool_call>\\n`` and, named,
``{"name": "NAME", "arguments": ``), so the model writes the call's rest;
formats without a known opening refuse them.
"""

from __future__ import annotations

import importlib
import json
import re
import secrets
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic_core import from_json

from ..errors import Hf2qError, one_line
from ..reasoning import H_CALL, H_CHANNEL, H_MESSAGE, HARMONY_CALL

#: A parser as mlx-lm's: the text between the markers, and the request's tools
#: -> ``{"name", "arguments"}`` or a list of them; raises on what it cannot read.
Parser = Callable[[str, Any], Any]
FENCE, FENCE_END = "```json", "```"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text, as the
    model wrote them (``complete`` False: the text is not a whole JSON
    object, as when ``max_tokens`` cut the call short)."""

    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    complete: bool = True

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry (with ``index`` in a stream's delta)."""
        body = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return body if index is None else {"index": index, **body}

    def input(self) -> dict[str, Any]:
        """The arguments as an object; of arguments cut short, what they hold
        so far (read as partial JSON); ``{}`` when nothing reads."""
        try:
            value = from_json(self.arguments, allow_partial="trailing-strings")
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class ToolFormat:
    """A model family's tool-call syntax: where a call starts and ends in the
    text (``end`` empty: at the end of the answer), its parser, and the
    openings that force a call (``required``) or a named one (``named``)."""

    name: str
    start: str = ""
    end: str = ""
    parse: Parser | None = None
    required: str | None = None
    named: Callable[[str], str] | None = None
    mistral_ids: bool = False


#: Openings that force a call, per mlx-lm parser (and ours): (required, named).
_OPENINGS: dict[str, tuple[str, Callable[[str], str]]] = {
    "json_tools": ("<tool_call>\n", lambda n: f'<tool_call>\n{{"name": "{n}", "arguments": '),
    "qwen3_coder": ("<tool_call>\n<function=", lambda n: f"<tool_call>\n<function={n}>\n"),
    "pythonic": ("<|tool_call_start|>[", lambda n: f"<|tool_call_start|>[{n}("),
    "gemma4": ("<|tool_call>call:", lambda n: f"<|tool_call>call:{n}{{"),
    "function_gemma": ("<start_function_call>call:", lambda n: f"<start_function_call>call:{n}{{"),
    "llama3_json": ('{"name": "', lambda n: f'{{"name": "{n}", "parameters": '),
}


def tool_format(tokenizer: Any) -> ToolFormat | None:
    """The tool-call format of a tokenizer (an mlx-lm ``TokenizerWrapper``), or
    None when none is known (then only JSON calls naming a tool are read)."""
    hf = _hf_tokenizer(tokenizer)
    template = getattr(hf, "chat_template", None)
    template = template if isinstance(template, str) else ""
    name = (getattr(hf, "init_kwargs", None) or {}).get("tool_parser_type") or _mlx_lm_guess(hf)
    if name is None and (PYTHON_TAG in template or "ipython" in template):
        name = "llama3_json"
    if name is None and "<tool_call>" in template:
        name = "json_tools"  # Hermes-style templates that mlx-lm does not name
    if name is None and H_CHANNEL in template and "commentary" in template:
        return ToolFormat("harmony", start=HARMONY_CALL, end=H_CALL, parse=parse_harmony_call)
    if name is None:
        return None
    if name == "llama3_json":
        required, named = _OPENINGS[name]
        return ToolFormat(name, required=required, named=named)
    try:
        module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    except ImportError:
        return None
    required, named = _OPENINGS.get(name, (None, None))
    if name == "mistral":
        required = "[TOOL_CALLS]"
        if "[ARGS]" in template:
            named = lambda n: f"[TOOL_CALLS]{n}[ARGS]"  # noqa: E731
        else:
            named = lambda n: f'[TOOL_CALLS][{{"name": "{n}", "arguments": '  # noqa: E731
    return ToolFormat(
        name,
        start=module.tool_call_start,
        end=module.tool_call_end,
        parse=module.parse_tool_call,
        required=required,
        named=named,
        mistral_ids=name == "mistral",
    )


def parse_harmony_call(text: str, _tools: Any = None) -> dict[str, Any]:
    """A harmony call as the reasoning splitter hands it on
    (``functions.NAME<|message|>ARGUMENTS``); raises when it is not a call
    of a function."""
    recipient, sep, arguments = text.partition(H_MESSAGE)
    if not sep or not recipient.startswith("functions.") or not recipient[len("functions.") :]:
        raise ValueError("not a call of a function")
    return {"name": recipient[len("functions.") :], "arguments": json.loads(arguments)}


def _mlx_lm_guess(hf: Any) -> str | None:
    """mlx-lm's own guess from the template and vocabulary (None if it has none)."""
    try:
        from mlx_lm.tokenizer_utils import _infer_tool_parser
    except ImportError:
        return None
    try:
        return _infer_tool_parser(hf)
    except Exception:  # noqa: BLE001 - a tokenizer mlx-lm cannot inspect has no known format
        return None


# -- the request's side ----------------------------------------------------------------------
@dataclass(frozen=True)
class ToolUse:
    """How one chat request uses tools: the tool definitions for the chat
    template, the format the answer is read in, and the text the answer is
    made to start with (``prefix``, part of the prompt)."""

    tools: list[dict[str, Any]]
    names: frozenset[str]
    format: ToolFormat | None
    prefix: str = ""
    parallel: bool = True
    id_prefix: str = "call_"

    def new_id(self) -> str:
        """A new call id: ``id_prefix`` and 24 hex digits (Mistral's templates: 9 letters and digits)."""
        if self.format is not None and self.format.mistral_ids:
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return f"{self.id_prefix}{uuid.uuid4().hex[:24]}"


def tool_use(
    tokenizer: Any,
    tools: list[dict[str, Any]] | None,
    choice: str | dict | None,
    parallel: bool = True,
    id_prefix: str = "call_",
) -> ToolUse | None:
    """The request's use of tools, or None (no tools, or ``tool_choice: none``:
    the prompt is rendered without tools and the answer is plain text).
    Raises Hf2qError naming the field for what this model cannot do."""
    choice = "auto" if choice is None else choice
    if not tools:
        if choice in ("auto", "none"):
            return None
        raise Hf2qError("tool_choice: a required or named tool call needs tools")
    if choice == "none":
        return None
    if not renders_tools(tokenizer):
        raise Hf2qError(
            "tools: this model's chat template does not render tools (it has no tool support), "
            "so the model cannot be told about them"
        )
    names = frozenset(t["function"]["name"] for t in tools)
    fmt = tool_format(tokenizer)
    prefix = ""
    if choice != "auto":
        label = "required" if choice == "required" else f"the function {choice['function']['name']!r}"
        if choice != "required" and choice["function"]["name"] not in names:
            raise Hf2qError(
                f"tool_choice: the function {choice['function']['name']!r} is not among the tools"
            )
        opening = fmt.required if fmt is not None and choice == "required" else None
        if choice != "required" and fmt is not None and fmt.named is not None:
            opening = fmt.named(choice["function"]["name"])
        if opening is None:
            kind = fmt.name if fmt is not None else "unknown"
            raise Hf2qError(
                f"tool_choice: {label} is not supported for this model's tool-call format ({kind}); use auto"
            )
        prefix = opening
    return ToolUse(list(tools), names, fmt, prefix, parallel, id_prefix)


#: Whether each chat template renders tools, by template text.
_RENDERS_TOOLS: dict[str, bool] = {}
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "hf2q_probe_tool",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}


def renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template puts tools in the prompt (a template that
    ignores ``tools`` renders a conversation the same with and without)."""
    hf = _hf_tokenizer(tokenizer)
    template = getattr(hf, "chat_template", None)
    if not isinstance(template, str):
        return False
    if template not in _RENDERS_TOOLS:
        messages = [{"role": "user", "content": "hello"}]
        try:
            bare = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            with_tools = hf.apply_chat_template(
                messages, tools=[_PROBE_TOOL], add_generation_prompt=True, tokenize=False
            )
            _RENDERS_TOOLS[template] = with_tools != bare
        except Exception:  # noqa: BLE001 - a template that fails on tools cannot take them
            _RENDERS_TOOLS[template] = False
    return _RENDERS_TOOLS[template]


# -- reading calls ---------------------------------------------------------------------------
def parse_calls(use: ToolUse, text: str, kind: str) -> list[ToolCall] | None:
    """The whole calls in ``text``, or None when it does not read as calls.
    ``kind``: ``marker`` (the text between the format's markers, read by its
    parser), ``fence`` or ``bare`` (JSON calls naming one of the tools)."""
    try:
        if kind == "marker":
            found = as_calls(use.format.parse(text, use.tools))
        else:
            found = named_json_calls(text.strip().removeprefix(PYTHON_TAG), use.names)
    except Exception:  # noqa: BLE001 - unreadable tool text is content, never a failure
        return None
    if not found:
        return None
    try:
        return [
            ToolCall(
                c["name"], json.dumps(call_arguments(c), ensure_ascii=False), _given_id(c) or use.new_id()
            )
            for c in found
        ]
    except (KeyError, TypeError, ValueError):
        return None


def _given_id(call: dict) -> str:
    given = call.get("id")
    return given if isinstance(given, str) and given else ""


def as_calls(parsed: Any) -> list[dict]:
    """A parser's result as a list of calls; raises if it is not one."""
    calls = parsed if isinstance(parsed, list) else [parsed]
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) and c["name"] for c in calls):
        raise ValueError("not a tool call")
    return calls


def call_arguments(call: dict) -> dict:
    """A parsed call's arguments as an object (given as one, or as its JSON text)."""
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("arguments are not an object")
    return args


def named_json_calls(text: str, names: frozenset[str]) -> list[dict] | None:
    """JSON calls naming a tool: one object, a list of them, or objects one after
    another (``;``, ``,`` or whitespace between, as Llama 3.x writes several;
    the rest of a list); None when the text holds anything else."""
    decoder, calls, pos, text = json.JSONDecoder(), [], 0, text.strip()
    while pos < len(text):
        value, pos = decoder.raw_decode(text, pos)
        calls.extend(value if isinstance(value, list) else [value])
        while pos < len(text) and (text[pos].isspace() or text[pos] in ";,]"):
            pos += 1
    for c in calls:
        if not isinstance(c, dict) or c.get("name") not in names:
            return None
        if not isinstance(c.get("arguments", c.get("parameters")), (dict, str)):
            return None
    return calls or None


# -- history for the chat template ---------------------------------------------------------------
def history_arguments(arguments: str | dict, where: str) -> dict:
    """A call's arguments in the conversation as the dict templates expect."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as e:
        raise Hf2qError(f"{where}: not valid JSON ({one_line(e)})") from None
    if not isinstance(value, dict):
        raise Hf2qError(f"{where}: the arguments must be a JSON object, got {type(value).__name__}")
    return value


def _hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer inside an mlx-lm ``TokenizerWrapper`` (or the tokenizer itself)."""
    inner = getattr(tokenizer, "_tokenizer", None)
    return inner if hasattr(inner, "apply_chat_template") else tokenizer


#: Message texts shorter than this are not worth drafting from in quoted form.
MIN_QUOTED = 64
#: A line as ``cat -n`` numbers it (Claude Code's Read): spaces, the number, a tab.
_NUMBERED = re.compile(r" *\d+\t")


def unnumbered(text: str) -> str | None:
    """A file shown with numbered lines (``cat -n``, as Claude Code's Read
    returns it) as the file itself: the numbered lines without their
    numbers. None when fewer than two lines are numbered."""
    lines = [line[m.end() :] for line in text.split("\n") if (m := _NUMBERED.match(line))]
    return "\n".join(lines) + "\n" if len(lines) >= 2 else None


def quoted_views(messages: Sequence[dict[str, Any]]) -> list[str]:
    """Long message texts (a tool's result, a pasted file; not system texts,
    which calls do not quote and whose billing nonce changes every request)
    as a tool call's JSON arguments quote them: a call that writes a file
    back copies it with its line breaks and quotes escaped, which the text
    in the conversation does not show. Each text is given JSON-quoted and,
    where it holds quotes or backslashes, with only its line breaks and tabs
    escaped (how small models write code into a call: Qwen2.5-Coder 0.5B
    leaves a docstring's quotes unescaped). A file shown with numbered lines
    (a Read result) is given without the numbers: an edit's ``old_string``
    copies the lines, not the numbers. Only views that differ from the text
    are given."""
    out: list[str] = []
    for m in messages:
        text = m.get("content")
        if m.get("role") == "system" or not isinstance(text, str) or len(text) < MIN_QUOTED:
            continue
        t = unnumbered(text) or text
        quoted = json.dumps(t, ensure_ascii=False)[1:-1]
        half = t.replace("\n", "\\n").replace("\t", "\\t")
        out += [v for v in dict.fromkeys((quoted, half)) if v != text]
    return out
