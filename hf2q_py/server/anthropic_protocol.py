"""Anthropic's Messages API: the request checked and translated into a
:class:`Conversation`, and the response's shapes.

The request's top level is checked by pydantic (strict types; fields the
server does not use, such as ``metadata``, ``cache_control``,
``context_management`` or ``service_tier``, are accepted and ignored); the
content blocks by hand, each problem named by its place
(``messages.2.content.0.tool_use_id``). Blocks become chat-template
messages in order: ``text`` blocks joined by a line break; ``tool_use``
blocks an assistant's ``tool_calls``; each ``tool_result`` a ``tool``
message answering a ``tool_use`` of an earlier assistant message (its text,
``Error: `` before it when ``is_error``); ``thinking`` blocks the assistant
message's ``reasoning_content``, which only templates that render reasoning
show (the others ignore it); ``redacted_thinking`` blocks are dropped;
``image`` and ``document`` blocks are refused (the server runs text
models). A ``role: "system"`` message stays where it is. A last assistant
message of text is the answer's start (prefill): the answer continues it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..errors import Hf2qError
from ..stats import GenerationStats
from .conversation import Conversation, Thinking, schema_problem
from .protocol import MAX_STOP_STRINGS, MAX_TOOLS, Hf2qOptions

#: Anthropic's rule for tool names.
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"
#: Anthropic's error ``type`` by HTTP status (503: this server is busy or stopping).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 507: "api_error",
               529: "overloaded_error"}  # fmt: skip
STOP_REASONS = {
    "stop": "end_turn",
    "stop_sequence": "stop_sequence",
    "length": "max_tokens",
    "tool_calls": "tool_use",
}
REFUSED_BLOCKS = {"image": "an image", "document": "a document"}


class _Loose(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class AnthropicTool(_Loose):
    """A tool: ``name``, ``description``, ``input_schema``. Anthropic's own
    tools (a ``type`` such as ``web_search_20250305``) are accepted and not
    shown to the model, which cannot run them."""

    type: str | None = None
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any] | None = None

    @field_validator("input_schema")
    @classmethod
    def _schema(cls, value: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        if (
            value is not None
            and info.data.get("type") in (None, "custom")
            and (problem := schema_problem(value))
        ):
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _required(self) -> AnthropicTool:
        if self.custom and self.input_schema is None:
            raise ValueError("input_schema: required for a custom tool")
        return self

    @property
    def custom(self) -> bool:
        return self.type in (None, "custom")

    def function(self) -> dict[str, Any]:
        """The tool as an OpenAI function definition (what templates take)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class ToolChoice(_Loose):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, pattern=TOOL_NAME)
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and self.name is None:
            raise ValueError('name: required with "type": "tool"')
        return self

    def neutral(self) -> str | dict[str, Any]:
        """As the engine's ``tool_choice``."""
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"any": "required"}.get(self.type, self.type)


class ThinkingConfig(_Loose):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)


class OutputConfig(_Loose):
    effort: str | None = Field(None, max_length=32)


class AnthropicMessage(_Loose):
    role: Literal["user", "assistant", "system"]
    content: Any


class CountRequest(_Loose):
    """What ``/v1/messages/count_tokens`` reads (a Messages request without the generation's fields)."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Any = None
    tools: list[AnthropicTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    hf2q: Hf2qOptions | None = None


def conversation(req: CountRequest) -> Conversation:
    """The request as the engine's conversation; Hf2qError naming the field."""
    messages, prefill = _messages(req)
    conv = Conversation(
        messages=messages, prefill=prefill, call_id_prefix="toolu_", thinking=_thinking(req),
        tools=[t.function() for t in req.tools or () if t.custom] or None,
        tool_choice=req.tool_choice.neutral() if req.tool_choice is not None else None,
        parallel_tool_calls=not (req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use),
    )  # fmt: skip
    if isinstance(req, MessagesRequest):
        conv.max_tokens, conv.stream, conv.stop = req.max_tokens, req.stream, _stops(req.stop_sequences)
        conv.sampling = {
            k: v for k in ("temperature", "top_p", "top_k") if (v := getattr(req, k)) is not None
        }
        conv.method = req.hf2q.method if req.hf2q is not None else None
    return conv


def _stops(stops: list[str] | None) -> tuple[str, ...]:
    stops = tuple(stops or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise Hf2qError(f"stop_sequences: at most {MAX_STOP_STRINGS}, got {len(stops)}")
    if any(not s for s in stops):
        raise Hf2qError("stop_sequences: a stop sequence must not be empty")
    return stops


def _thinking(req: CountRequest) -> Thinking | None:
    effort = req.output_config.effort if req.output_config is not None else None
    if req.thinking is None and effort is None:
        return None
    t = req.thinking
    return Thinking(None if t is None else t.type != "disabled", t.budget_tokens if t else None, effort)


def _messages(req: CountRequest) -> tuple[list[dict[str, Any]], str]:
    """The template messages, and the prefill (a last assistant message of text)."""
    out: list[dict[str, Any]] = []
    if req.system is not None and (system := _text(_indexed(req.system, "system"), "system", ())):
        out.append({"role": "system", "content": system})
    calls: dict[str, str] = {}  # tool_use ids of earlier assistant messages -> the tool's name
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        blocks = _indexed(m.content, f"{where}.content")
        if m.role == "system":
            out.append({"role": "system", "content": _text(blocks, f"{where}.content", ())})
        elif m.role == "assistant":
            out.append(_assistant(blocks, f"{where}.content", calls))
        else:
            out += _user(blocks, f"{where}.content", calls)
    last = req.messages[-1]
    if last.role == "assistant" and not out[-1].get("tool_calls") and out[-1]["content"]:
        return out[:-1], out[-1]["content"]
    return out, ""


Blocks = list[tuple[int, dict[str, Any]]]  # content blocks with their places


def _indexed(content: Any, where: str) -> Blocks:
    """Content as its blocks with their places (a string is one text block)."""
    if isinstance(content, str):
        return [(0, {"type": "text", "text": content})]
    if not isinstance(content, list):
        raise Hf2qError(f"{where}: must be a string or a list of content blocks, got {_kind(content)}")
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise Hf2qError(f"{where}.{j}: a content block is an object with a type, got {_kind(b)}")
    return list(enumerate(content))


def _text(blocks: Blocks, where: str, allowed: tuple[str, ...]) -> str:
    """The text blocks' text, joined by line breaks; blocks of the ``allowed``
    types are skipped, any other is refused by name."""
    parts = []
    for j, b in blocks:
        if b["type"] == "text":
            parts.append(_field(b, "text", str, f"{where}.{j}"))
        elif b["type"] not in allowed:
            raise Hf2qError(_refusal(b["type"], f"{where}.{j}"))
    return "\n".join(p for p in parts if p)


def _assistant(blocks: Blocks, where: str, calls: dict[str, str]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": _text(blocks, where, ("tool_use", "thinking", "redacted_thinking"))}  # fmt: skip
    tool_calls, thinking = [], []
    for j, b in blocks:
        at = f"{where}.{j}"
        if b["type"] == "tool_use":
            call_id, name = _field(b, "id", str, at), _field(b, "name", str, at)
            if not call_id or not name:
                raise Hf2qError(f"{at}: a tool_use block needs an id and a name")
            tool_calls.append({"id": call_id, "type": "function",
                               "function": {"name": name, "arguments": _field(b, "input", dict, at)}})  # fmt: skip
            calls[call_id] = name
        elif b["type"] == "thinking":
            thinking.append(_field(b, "thinking", str, at))
    if tool_calls:
        message["tool_calls"] = tool_calls
    if any(thinking):
        message["reasoning_content"] = "\n".join(thinking)
    return message


def _user(blocks: Blocks, where: str, calls: dict[str, str]) -> list[dict[str, Any]]:
    """A user message's blocks in order: runs of text as user messages, each
    ``tool_result`` a tool message."""
    out: list[dict[str, Any]] = []
    run: Blocks = []  # text blocks not given out yet
    for j, b in blocks:
        if b["type"] != "tool_result":
            run.append((j, b))
            continue
        if run:
            out.append({"role": "user", "content": _text(run, where, ())})
            run = []
        out.append(_tool_result(b, f"{where}.{j}", calls))
    if run or not out:
        out.append({"role": "user", "content": _text(run, where, ())})
    return out


def _tool_result(block: dict[str, Any], at: str, calls: dict[str, str]) -> dict[str, Any]:
    call_id = _field(block, "tool_use_id", str, at)
    if call_id not in calls:
        raise Hf2qError(
            f"{at}.tool_use_id: {call_id!r} answers no tool_use block of an earlier assistant message"
        )
    content = block.get("content", "")
    text = (
        content
        if isinstance(content, str)
        else _text(_indexed(content, f"{at}.content"), f"{at}.content", ())
    )
    if block.get("is_error", False) is True:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "name": calls[call_id], "content": text}


def _field(block: dict[str, Any], name: str, kind: type, at: str) -> Any:
    value = block.get(name)
    if not isinstance(value, kind):
        what = {str: "a string", dict: "an object"}[kind]
        raise Hf2qError(f"{at}.{name}: a {block['type']} block needs {what}, got {_kind(value)}")
    return value


def _refusal(kind: str, at: str) -> str:
    if kind in REFUSED_BLOCKS:
        return f"{at}: {REFUSED_BLOCKS[kind]} block, but this model reads text only"
    if kind in ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"):
        return f"{at}: a {kind} block is not allowed here"
    return f"{at}: unknown content block type {kind!r}"


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# -- responses -------------------------------------------------------------------
def error_body(message: str, status: int) -> dict[str, Any]:
    """Anthropic's error envelope, its type read from the status."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class MessageShape:
    """The bodies of one Messages response (whole, or its stream's events)."""

    def __init__(self, model: str):
        self.model = model
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def message(self, content: list[dict[str, Any]], stop_reason: str | None, stop_sequence: str | None,
                usage: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage,
        }  # fmt: skip


def usage(stats: GenerationStats | None, prompt_tokens: int = 0) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens not read from the cache."""
    prompt = stats.prompt_tokens if stats is not None else prompt_tokens
    cached = stats.cached_tokens if stats is not None else 0
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": stats.generated_tokens if stats is not None else 0,
    }
