"""The neutral request every API becomes (:class:`Conversation`), and how any
conversation becomes the prompt's token ids, the same for every API.

Each API (``openai_api``, ``anthropic_api``) checks its own fields, naming
them as its clients know them, and translates the request into a
``Conversation``: messages as chat-template dicts in order (``role``,
``content`` text, an assistant's ``tool_calls`` with arguments as objects,
a tool message's ``tool_call_id``, an assistant's ``reasoning_content``),
tools as OpenAI function definitions, and the generation's options. The
:class:`~hf2q_py.server.engine.Engine` does the rest once for every API.

The prompt: system texts have Claude Code's per-request billing nonce fixed
(:func:`normalize_system`), so a conversation's next turn starts with the
same tokens as the last and reuses its states from the prompt cache; the
thinking switch goes to templates that have one (:func:`template_options`);
a template that refuses a system message past the start is given the
conversation with those messages as user text in place
(:func:`system_as_user`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..constraints import ConstraintSpec
from ..errors import Hf2qError
from ..request import encode_messages
from ..target import Target


@dataclass(frozen=True)
class Thinking:
    """What a client asks of a reasoning model: ``enabled`` (True, False;
    None: the template's default), a token ``budget`` and an ``effort``
    (``low``, ``medium``, ``high``)."""

    enabled: bool | None = None
    budget: int | None = None
    effort: str | None = None


@dataclass
class Conversation:
    """One request, whatever API it came by.

    ``messages``: chat-template dicts in order; or ``prompt``: a raw prompt
    (text or token ids) that skips the template (text completions).
    ``tools``: OpenAI function definitions; ``tool_choice``: ``auto``,
    ``none``, ``required`` or ``{"type": "function", "function": {"name"}}``.
    ``sampling``: the ``SamplingConfig`` options the request sets (the
    server's default temperature otherwise). ``max_tokens``: the asked
    answer length (None: the server's default), cut to what the context
    leaves. ``prefill``: text the answer continues (written after the
    generation prompt, not part of the answer). ``call_id_prefix``: how the
    API's call ids begin. ``freeform``: tools (among ``tools``) whose call
    carries one text (their one argument, ``input``), each with the grammar
    that text must follow, or None (:mod:`~hf2q_py.server.freeform`).
    """

    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt: str | list[int] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    stop: tuple[str, ...] = ()
    sampling: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    constraint: ConstraintSpec | None = None
    logprobs: int | None = None
    method: str | None = None
    stream: bool = False
    thinking: Thinking | None = None
    prefill: str = ""
    call_id_prefix: str = "call_"
    freeform: dict[str, ConstraintSpec | None] = field(default_factory=dict)


#: Claude Code's first system block, ``x-anthropic-billing-header: cc_version=V.S;
#: cc_entrypoint=E; cch=HHHHH;``: ``cch`` is a hash of the request body, new on
#: every request (the version's suffix follows the first user message, fixed
#: for a conversation).
_BILLING_NONCE = re.compile(r"^(x-anthropic-billing-header:[^\n]*?\bcch=)[^;\s]*", re.MULTILINE)


def normalize_system(text: str) -> str:
    """A system text with the billing line's per-request nonce fixed (``cch=00000``),
    so two requests of one conversation start with the same tokens."""
    return _BILLING_NONCE.sub(r"\g<1>00000", text) if "x-anthropic-billing-header" in text else text


def normalized(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {**m, "content": normalize_system(m["content"])}
        if m.get("role") == "system" and isinstance(m.get("content"), str)
        else m
        for m in messages
    ]


def schema_problem(schema: Any) -> str | None:
    """What makes a tool's parameter schema unusable, or None: it is a JSON
    object; its ``type``, if given, is ``object``; ``properties`` an object
    of schemas; ``required`` a list of names."""
    if not isinstance(schema, dict):
        return f"must be a JSON schema object, got {type(schema).__name__}"
    if "type" in schema and schema["type"] != "object":
        return f'the type must be "object", got {schema["type"]!r}'
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, (dict, bool)) for v in props.values()):
        return "properties must be an object of schemas"
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return "required must be a list of property names"
    return None


def chat_template_text(tokenizer: Any) -> str:
    """The tokenizer's chat template as text ("" when it has none as text);
    ``tokenizer``: an mlx-lm ``TokenizerWrapper`` or a Hugging Face tokenizer."""
    inner = getattr(tokenizer, "_tokenizer", None)
    template = getattr(inner if hasattr(inner, "apply_chat_template") else tokenizer, "chat_template", None)
    return template if isinstance(template, str) else ""


#: A template reading a bare ``thinking`` variable (DeepSeek-V3.1, Granite): ``if thinking``, ``thinking is defined``.
_THINKING_VARIABLE = re.compile(
    r"\{%-?\s*(?:el)?if\s+(?:not\s+)?thinking\b|\bthinking\s+is\s+(?:not\s+)?defined"
)
#: Efforts clients name, as templates' ``reasoning_effort`` (gpt-oss: low, medium, high) takes them.
_EFFORTS = {"max": "high", "xhigh": "high", "minimal": "low"}


def template_options(tokenizer: Any, thinking: Thinking | None) -> dict[str, Any]:
    """The template variables a thinking wish sets, where the template reads
    them: ``enable_thinking`` (Qwen3, Gemma 4, GLM-4.5+, SmolLM3, ...) or a
    bare ``thinking`` (DeepSeek-V3.1) on or off; ``reasoning_effort``
    (gpt-oss, which always reasons: ``max`` and ``xhigh`` as ``high``,
    ``minimal`` and thinking switched off as ``low``); ``thinking_budget``
    (Seed-OSS: the budget, 0 when off). An effort of ``none`` switches
    thinking off. Nothing for templates without a switch."""
    if thinking is None:
        return {}
    template = chat_template_text(tokenizer)
    enabled, effort = thinking.enabled, thinking.effort
    if effort == "none":
        enabled, effort = (False if enabled is None else enabled), None
    out: dict[str, Any] = {}
    if enabled is not None and "enable_thinking" in template:
        out["enable_thinking"] = enabled
    if enabled is not None and _THINKING_VARIABLE.search(template):
        out["thinking"] = enabled
    if "reasoning_effort" in template and (effort is not None or enabled is False):
        out["reasoning_effort"] = "low" if effort is None else _EFFORTS.get(effort, effort)
    if "thinking_budget" in template and (thinking.budget is not None or enabled is False):
        out["thinking_budget"] = 0 if enabled is False else thinking.budget
    return out


def reasoning_history(messages: Sequence[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """The conversation with each assistant message's ``reasoning_content``
    where the template reads it: as it is (Qwen3, GLM, Seed-OSS, ...), or as
    ``thinking`` for templates that read that instead (gpt-oss); templates
    that drop past reasoning (Gemma 4) read neither."""
    if "reasoning_content" in template or not re.search(r"""(?:\.|\[['"])thinking\b""", template):
        return list(messages)
    return [
        {**{k: v for k, v in m.items() if k != "reasoning_content"}, "thinking": m["reasoning_content"]}
        if m.get("role") == "assistant" and m.get("reasoning_content")
        else m
        for m in messages
    ]


def system_as_user(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The conversation for a template that refuses system messages past the
    start: the leading system messages joined into one, each later one's text
    (in ``<system-reminder>`` tags) joined to the user message right after it,
    else to the one right before it, else a user message of its own. None
    when there is nothing to move."""
    lead = 0
    while lead < len(messages) and messages[lead].get("role") == "system":
        lead += 1
    if lead == len(messages) or (lead <= 1 and all(m.get("role") != "system" for m in messages[lead:])):
        return None
    out = [{"role": "system", "content": "\n\n".join(m["content"] for m in messages[:lead])}] if lead else []
    waiting: list[str] = []  # system texts since the last message that was not one
    for m in [*messages[lead:], None]:
        if m is not None and m.get("role") == "system":
            waiting.append(f"<system-reminder>\n{m['content']}\n</system-reminder>")
            continue
        text = "\n\n".join(waiting)
        if text and m is not None and m.get("role") == "user":
            m = {**m, "content": f"{text}\n\n{m['content']}"}
        elif text and out and out[-1].get("role") == "user":
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{text}"}
        elif text:
            out.append({"role": "user", "content": text})
        waiting = []
        if m is not None:
            out.append(m)
    return out


def encode_conversation(
    target: Target,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
    prefix: str,
    options: dict[str, Any],
) -> list[int]:
    """The conversation's token ids through the chat template; a template
    that refuses system messages past the start is given them as user text
    (:func:`system_as_user`)."""
    try:
        return encode_messages(target, messages, tools=tools, prefix=prefix, template_options=options)
    except Hf2qError as first:
        moved = system_as_user(messages)
        if moved is None:
            raise
        try:
            return encode_messages(target, moved, tools=tools, prefix=prefix, template_options=options)
        except Hf2qError:
            raise first from None
