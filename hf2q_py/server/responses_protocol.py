"""OpenAI's Responses API: the request checked and translated into a
:class:`Conversation`, and the response's shapes.

The top level is checked by pydantic (strict types; fields the server does
not use, such as ``store``, ``include``, ``prompt_cache_key``, ``metadata``
or ``client_metadata``, are accepted and ignored); the input items and the
tools by hand, each problem named by its place (``input[3].call_id``,
``tools[1].parameters``).

Input items become chat-template messages in order: ``message`` items (roles
``user``, ``system``, ``developer`` as system, ``assistant``; text parts
joined) as messages; ``function_call`` and ``custom_tool_call`` items an
assistant message's ``tool_calls`` (a freeform call's input as its one
argument, ``input``; a namespaced call under its flat name); each
``function_call_output`` or ``custom_tool_call_output`` a ``tool`` message
answering a call of an earlier item; ``reasoning`` items the next assistant
message's ``reasoning_content``, which only templates that render reasoning
show. An image, file or audio part is refused (the server runs text models).

Tools: ``function`` tools as they are; a ``namespace``'s tools under flat
names, ``NAMESPACE__NAME`` (the name Codex gives such a tool where a call
cannot carry its namespace), read back into the namespace and the name;
``custom`` tools as freeform tools (:mod:`~hf2q_py.server.freeform`), their
grammar constraining the call's input. Tools of types the server cannot run
(``web_search``, ``image_generation``, ``file_search``, ...) are not shown to
the model.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..constraints import ConstraintSpec
from ..errors import Hf2qError
from ..stats import GenerationStats
from .conversation import Conversation, Thinking, schema_problem
from .freeform import INPUT, check_grammar, function_definition
from .protocol import FUNCTION_NAME, MAX_TOOLS, Hf2qOptions
from .tool_calls import history_arguments

#: How a namespace and a function's name join into the name the model calls (Codex's).
NAMESPACE_JOIN = "__"
MAX_FUNCTIONS = 512
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
#: Content parts a text model cannot read.
REFUSED_PARTS = {"input_image": "an image", "input_file": "a file", "input_audio": "audio"}
TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")


class _Loose(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextOptions(_Loose):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ReasoningOptions(_Loose):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Loose):
    """``POST /v1/responses``."""

    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: list[Any] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    store: bool | None = None
    stream: bool = False
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    metadata: dict[str, Any] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    hf2q: Hf2qOptions | None = None

    def unsupported(self) -> str | None:
        """The first field set to something this server cannot do, as a message."""
        if self.background:
            return "background: responses run in the foreground on this server (background must be false)"
        if self.conversation is not None:
            return "conversation: this server keeps no conversations; send the history in input"
        if self.prompt is not None:
            return "prompt: stored prompt templates are not supported; send instructions and input"
        if self.top_logprobs:
            return "top_logprobs is not supported on /v1/responses"
        return None


@dataclass
class Tools:
    """A request's tools as the engine takes them, and how calls map back:
    ``functions`` (OpenAI function definitions, freeform tools included),
    ``freeform`` (freeform tool name -> its grammar, or None),
    ``namespaced`` (flat name -> (namespace, name))."""

    functions: list[dict[str, Any]] = field(default_factory=list)
    freeform: dict[str, ConstraintSpec | None] = field(default_factory=dict)
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)

    def flat(self, name: str, namespace: str | None) -> str:
        return name if namespace is None else join_namespace(namespace, name)


def join_namespace(namespace: str, name: str) -> str:
    """A namespaced tool's flat name, as Codex joins it."""
    return f"{namespace.rstrip('_')}{NAMESPACE_JOIN}{name.lstrip('_')}"


def conversation(
    req: ResponsesRequest, items: list[dict[str, Any]], history: int = 0
) -> tuple[Conversation, Tools]:
    """The request (its ``input`` given as checked ``items``, after the
    first ``history`` items of the response it continues) as the engine's
    conversation, and its tools; Hf2qError naming the field."""
    tools = read_tools(req.tools)
    conv = Conversation(
        messages=template_messages(items, tools, req.instructions, history),
        tools=tools.functions or None,
        tool_choice=_choice(req.tool_choice, tools),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        sampling={k: float(v) for k in ("temperature", "top_p") if (v := getattr(req, k)) is not None},
        max_tokens=req.max_output_tokens,
        constraint=_text_format(req.text),
        stream=req.stream,
        thinking=_thinking(req.reasoning),
        method=req.hf2q.method if req.hf2q is not None else None,
        freeform=tools.freeform,
    )
    return conv, tools


# -- input items ------------------------------------------------------------------------------
def read_items(value: str | list[Any] | None, where: str = "input") -> list[dict[str, Any]]:
    """The input as items, each checked for its shape (a string is one user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    out = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise Hf2qError(f"{at}: an input item is an object, got {_kind(item)}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind is None:
            raise Hf2qError(f"{at}: an input item needs a type (or a role, for a message)")
        if kind not in _ITEM_FIELDS:
            raise Hf2qError(f"{at}.type: unknown or unsupported input item type {kind!r}")
        for name, kinds in _ITEM_FIELDS[kind]:
            if not isinstance(item.get(name), kinds) or (kinds is str and not item[name]):
                raise Hf2qError(
                    f"{at}.{name}: a {kind} item needs {_WANTS[kinds]}, got {_kind(item.get(name))}"
                )
        out.append({**item, "type": kind})
    return out


_ITEM_FIELDS: dict[str, list[tuple[str, Any]]] = {
    "message": [("role", str), ("content", (str, list))],
    "function_call": [("call_id", str), ("name", str), ("arguments", (str, dict))],
    "custom_tool_call": [("call_id", str), ("name", str)],
    "function_call_output": [("call_id", str), ("output", (str, list))],
    "custom_tool_call_output": [("call_id", str), ("output", (str, list))],
    "reasoning": [],
}
_WANTS = {str: "a non-empty string", (str, list): "a string or a list of parts", (str, dict): "JSON text"}


@dataclass
class _History:
    """The template messages being built from items: the open assistant
    turn, the calls made so far (call id -> flat name) and reasoning waiting
    for its assistant message."""

    tools: Tools
    out: list[dict[str, Any]] = field(default_factory=list)
    turn: dict[str, Any] | None = None
    calls: dict[str, str] = field(default_factory=dict)
    reasoning: list[str] = field(default_factory=list)

    def close(self) -> None:
        if self.turn is not None:
            self.out.append(self.turn)
        self.turn = None

    def assistant(self, fresh: bool) -> dict[str, Any]:
        """The assistant turn to add to (``fresh``: a new one unless the open one is empty)."""
        if self.turn is not None and fresh and (self.turn["content"] or self.turn.get("tool_calls")):
            self.close()
        if self.turn is None:
            self.turn = {"role": "assistant", "content": ""}
            if any(self.reasoning):
                self.turn["reasoning_content"] = "\n".join(r for r in self.reasoning if r)
            self.reasoning = []
        return self.turn


def template_messages(
    items: list[dict[str, Any]], tools: Tools, instructions: str | None, history: int = 0
) -> list[dict[str, Any]]:
    """The chat-template messages the items (and the instructions, first)
    make; problems are named by their place in the request's ``input``
    (the first ``history`` items: the stored response's)."""
    h = _History(tools)
    if instructions:
        h.out.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        at = f"input[{i - history}]" if i >= history else f"previous_response_id: item {i}"
        kind = item["type"]
        if kind == "message":
            _message(h, item, at)
        elif kind in ("function_call", "custom_tool_call"):
            _call(h, item, at)
        elif kind == "reasoning":
            if h.turn is not None and (h.turn["content"] or h.turn.get("tool_calls")):
                h.close()
            h.reasoning.append(_reasoning_text(item, at))
        else:
            h.close()
            call_id = item["call_id"]
            if call_id not in h.calls:
                raise Hf2qError(
                    f"{at}.call_id: {call_id!r} answers no function_call or custom_tool_call of an earlier item"
                )
            text = _text(item["output"], f"{at}.output", TEXT_PARTS)
            h.out.append({"role": "tool", "tool_call_id": call_id, "name": h.calls[call_id], "content": text})
    h.close()
    return h.out


def _message(h: _History, item: dict[str, Any], at: str) -> None:
    role = item["role"]
    if role not in ("user", "system", "developer", "assistant"):
        raise Hf2qError(f"{at}.role: must be user, system, developer or assistant, got {role!r}")
    text = _text(item["content"], f"{at}.content", TEXT_PARTS)
    if role == "assistant":
        turn = h.assistant(fresh=True)
        turn["content"] = text
        return
    h.close()
    h.out.append({"role": "system" if role == "developer" else role, "content": text})


def _call(h: _History, item: dict[str, Any], at: str) -> None:
    namespace = item.get("namespace")
    if namespace is not None and (not isinstance(namespace, str) or not namespace):
        raise Hf2qError(f"{at}.namespace: must be a non-empty string")
    name = h.tools.flat(item["name"], namespace)
    if item["type"] == "function_call":
        arguments = history_arguments(item["arguments"], f"{at}.arguments")
    else:
        if not isinstance(item.get(INPUT), str):
            raise Hf2qError(
                f"{at}.input: a custom_tool_call item needs a string, got {_kind(item.get(INPUT))}"
            )
        arguments = {INPUT: item[INPUT]}
    turn = h.assistant(fresh=False)
    turn.setdefault("tool_calls", []).append(
        {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": arguments}}
    )
    h.calls[item["call_id"]] = name


def _reasoning_text(item: dict[str, Any], at: str) -> str:
    """A reasoning item's text: its reasoning_text parts, else its summary."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts:
            return _text(parts, f"{at}.{key}", ("reasoning_text", "summary_text", "text"))
    return ""


def _text(content: Any, where: str, allowed: tuple[str, ...]) -> str:
    """Text content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Hf2qError(f"{where}: must be a string or a list of content parts, got {_kind(content)}")
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise Hf2qError(f"{where}[{j}]: a content part is an object with a type, got {_kind(part)}")
        kind = part["type"]
        if kind in REFUSED_PARTS:
            raise Hf2qError(f"{where}[{j}]: {REFUSED_PARTS[kind]} ({kind}), but this model reads text only")
        if kind not in allowed:
            raise Hf2qError(f"{where}[{j}].type: unknown or unsupported content part type {kind!r}")
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise Hf2qError(f"{where}[{j}].text: a {kind} part needs a string, got {_kind(text)}")
        out.append(text)
    return "".join(out)


# -- tools --------------------------------------------------------------------------------------
def read_tools(raw: list[Any] | None) -> Tools:
    """The tools the model is offered (types the server cannot run left out)."""
    tools = Tools()
    for i, tool in enumerate(raw or ()):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise Hf2qError(f"{at}: a tool is an object with a type, got {_kind(tool)}")
        kind = tool["type"]
        if kind == "namespace":
            namespace = _name(tool, at)
            inner = tool.get("tools")
            if not isinstance(inner, list) or not inner:
                raise Hf2qError(f"{at}.tools: a namespace holds a non-empty list of tools")
            for j, t in enumerate(inner):
                _add(tools, t, f"{at}.tools[{j}]", namespace)
        elif kind in ("function", "custom"):
            _add(tools, tool, at, None)
    if len(tools.functions) > MAX_FUNCTIONS:
        raise Hf2qError(f"tools: at most {MAX_FUNCTIONS} functions, got {len(tools.functions)}")
    return tools


def _add(tools: Tools, tool: Any, at: str, namespace: str | None) -> None:
    if not isinstance(tool, dict) or tool.get("type") not in ("function", "custom"):
        raise Hf2qError(f"{at}: a namespace's tool is a function or custom tool")
    name = _name(tool, at)
    flat = tools.flat(name, namespace)
    if any(f["function"]["name"] == flat for f in tools.functions):
        raise Hf2qError(f"{at}.name: a second tool named {flat!r}")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise Hf2qError(f"{at}.description: must be a string, got {_kind(description)}")
    if tool["type"] == "function":
        tools.functions.append(_function(tool, flat, description, at))
    else:
        grammar = _grammar(tool.get("format"), f"{at}.format")
        tools.functions.append(function_definition(flat, description, grammar))
        tools.freeform[flat] = grammar
    if namespace is not None:
        tools.namespaced[flat] = (namespace, name)


def _name(tool: dict[str, Any], at: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not re.fullmatch(FUNCTION_NAME, name):
        raise Hf2qError(f"{at}.name: required, 1-64 letters, digits, _ or -, got {name!r}")
    return name


def _function(tool: dict[str, Any], flat: str, description: str | None, at: str) -> dict[str, Any]:
    parameters = tool.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    elif problem := schema_problem(parameters):
        raise Hf2qError(f"{at}.parameters: {problem}")
    fn: dict[str, Any] = {"name": flat, "parameters": parameters}
    if description is not None:
        fn["description"] = description
    return {"type": "function", "function": fn}


def _grammar(fmt: Any, at: str) -> ConstraintSpec | None:
    """A custom tool's input grammar (None: free text)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
        raise Hf2qError(f'{at}: must be {{"type": "text"}} or {{"type": "grammar", "syntax", "definition"}}')
    if fmt["type"] == "text":
        return None
    syntax, definition = fmt.get("syntax"), fmt.get("definition")
    if syntax not in ("lark", "regex"):
        raise Hf2qError(f'{at}.syntax: must be "lark" or "regex", got {syntax!r}')
    if not isinstance(definition, str) or not definition.strip():
        raise Hf2qError(f"{at}.definition: the grammar, a non-empty string")
    spec = ConstraintSpec("grammar" if syntax == "lark" else "regex", definition)
    problem = check_grammar(spec)
    if problem is not None:
        raise Hf2qError(f"{at}.definition: {problem}")
    return spec


def _choice(choice: str | dict[str, Any] | None, tools: Tools) -> str | dict[str, Any] | None:
    """``tool_choice`` as the engine's (``auto``, ``none``, ``required`` or a named function)."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        name, namespace = choice.get("name"), choice.get("namespace")
        if not isinstance(name, str) or not name:
            raise Hf2qError("tool_choice.name: required, the tool's name")
        flat = tools.flat(name, namespace if isinstance(namespace, str) else None)
        if not any(f["function"]["name"] == flat for f in tools.functions):
            raise Hf2qError(f"tool_choice.name: {flat!r} is not among the tools")
        return {"type": "function", "function": {"name": flat}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        raise Hf2qError("tool_choice: allowed_tools is not supported; send only the tools the model may call")
    if isinstance(choice, dict) and isinstance(choice.get("type"), str):
        raise Hf2qError(f"tool_choice: this server cannot run {choice['type']} tools")
    raise Hf2qError('tool_choice: must be "auto", "none", "required" or {"type": "function", "name": ...}')


# -- options -------------------------------------------------------------------------------------
def _text_format(text: TextOptions | None) -> ConstraintSpec | None:
    """``text.format`` as an output constraint (None for plain text)."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return ConstraintSpec("json_object")
    if fmt.get("type") != "json_schema":
        raise Hf2qError(
            f"text.format.type: must be text, json_object or json_schema, got {fmt.get('type')!r}"
        )
    name = fmt.get("name")
    if not isinstance(name, str) or not re.fullmatch(FUNCTION_NAME, name):
        raise Hf2qError("text.format.name: required, 1-64 letters, digits, _ or -")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise Hf2qError(f"text.format.schema: required, a JSON schema object, got {_kind(schema)}")
    spec = ConstraintSpec.json_schema(schema)
    problem = spec.problem()
    if problem is not None:
        raise Hf2qError(f"text.format.schema: {problem}")
    return spec


def _thinking(reasoning: ReasoningOptions | None) -> Thinking | None:
    """``reasoning.effort`` as the thinking wish (``none``: thinking off)."""
    effort = reasoning.effort if reasoning is not None else None
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise Hf2qError(f"reasoning.effort: must be one of {', '.join(EFFORTS)}, got {effort!r}")
    return Thinking(enabled=False) if effort == "none" else Thinking(enabled=True, effort=effort)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# -- responses -------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(stats: GenerationStats | None, reasoning_tokens: int = 0) -> dict[str, Any]:
    """The Responses API's usage: prompt tokens with those read from the prompt cache."""
    prompt = stats.prompt_tokens if stats is not None else 0
    out = stats.generated_tokens if stats is not None else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": stats.cached_tokens if stats is not None else 0},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt + out,
    }


class ResponseShape:
    """The ``response`` object of one request, as it stands (its status, output and usage)."""

    def __init__(self, model: str, req: ResponsesRequest):
        self.id = new_id("resp")
        self.created = int(time.time())
        self.model = model
        self.req = req

    def body(self, status: str, output: list[dict[str, Any]], usage_: dict[str, Any] | None = None,
             incomplete: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": req.reasoning.summary if req.reasoning else None},
            "store": req.store is not False, "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": (req.text.format if req.text and req.text.format else {"type": "text"})},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [], "truncation": "disabled", "usage": usage_,
            "metadata": req.metadata or {},
        }  # fmt: skip
