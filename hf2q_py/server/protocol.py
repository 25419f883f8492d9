"""OpenAI's request schemas as pydantic models, and the response bodies.

Requests are validated strictly (a string is not a number); fields that
OpenAI defines and the server cannot honour are refused by name when set to
anything but their neutral value; fields it does not know are ignored.
``hf2q`` is this server's extension: ``{"method": "ngram:k=8"}`` chooses the
method of one request. Tools and tool history are checked here; the tool-call
format and the answer's parsing are ``tool_calls``'s.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..config import MAX_TOP_LOGPROBS
from ..constraints import ConstraintSpec
from ..errors import Hf2qError
from ..stats import GenerationStats
from .conversation import Thinking, schema_problem
from .tool_calls import ToolCall, history_arguments

MAX_STOP_STRINGS = 16


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


#: OpenAI's rule for function names.
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
MAX_TOOLS = 128


class FunctionCall(_Strict):
    """A call in an assistant message of the history; ``arguments`` JSON text (or an object)."""

    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str | dict[str, Any]


class HistoryToolCall(_Strict):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    """A message of the conversation; an assistant's may carry its reasoning
    (``reasoning_content``, or ``reasoning`` as mlx_lm.server and vLLM name it)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[HistoryToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, min_length=1, max_length=256)
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> Message:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries tool calls")
        if (self.reasoning_content or self.reasoning) and self.role != "assistant":
            raise ValueError("reasoning_content: only an assistant message carries reasoning")
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.thought())):
            raise ValueError(
                "content: required (null only in an assistant message with tool_calls or reasoning_content)"
            )
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message names the call it answers")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined; null is empty)."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def thought(self) -> str:
        """The message's reasoning ("" when it has none)."""
        return self.reasoning_content or self.reasoning or ""


class FunctionDef(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        problem = schema_problem(value) if value is not None else None
        if problem:
            raise ValueError(problem)
        return value


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateKwargs(_Strict):
    """The chat template variables a request may set (vLLM's and llama-server's
    ``chat_template_kwargs``): the thinking switch only; other keys are ignored."""

    enable_thinking: bool | None = None
    thinking: bool | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class Hf2qOptions(_Strict):
    """This server's per-request extension (``"hf2q": {...}``)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    method: str | None = Field(None, max_length=1000)
    #: Add the generated token ids to the response's ``hf2q`` field (not streamed).
    return_tokens: bool = False


class _Request(_Strict):
    """What chat and text completions share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's sampling extensions
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, lt=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    # defined by OpenAI, refused unless neutral
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    hf2q: Hf2qOptions | None = None

    def unsupported(self) -> str | None:
        """The first field set to something this server cannot do, as a message."""
        if self.n not in (None, 1):
            return "n: only n=1 is supported"
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                return f"{name} is not supported (use repetition_penalty)"
        if self.logit_bias:
            return "logit_bias is not supported"
        return None

    def constraint(self) -> ConstraintSpec | None:
        """The output constraint the request asks for (text completions: none)."""
        return None

    def stop_strings(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > MAX_STOP_STRINGS:
            raise Hf2qError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise Hf2qError("stop: stop strings must not be empty")
        return stops

    def sampling(self) -> dict[str, Any]:
        """The ``SamplingConfig`` options the request sets."""
        out: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                out[name] = float(value) if name in ("temperature", "top_p", "min_p") else value
        return out


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto", "required") or isinstance(value, dict):
            return value
        raise ValueError(
            'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )

    def thinking(self) -> Thinking | None:
        """What the request asks of a reasoning model: ``reasoning_effort``
        (``none``: thinking off) and ``chat_template_kwargs``'
        ``enable_thinking`` (or DeepSeek's ``thinking``)."""
        kw = self.chat_template_kwargs
        enabled = (
            None if kw is None else kw.enable_thinking if kw.enable_thinking is not None else kw.thinking
        )
        if enabled is None and self.reasoning_effort is None:
            return None
        return Thinking(enabled=enabled, effort=self.reasoning_effort)

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template and the parsers take them."""
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]

    def choice(self) -> str | dict | None:
        c = self.tool_choice
        return c.model_dump() if isinstance(c, NamedToolChoice) else c

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation for the chat template: ``developer`` as ``system``,
        null content as empty text, call arguments as objects, an assistant's
        reasoning as ``reasoning_content``; a tool message must answer a call
        of the assistant message before it."""
        out: list[dict[str, Any]] = []
        open_ids: set[str] = set()  # calls of the last assistant message with tool_calls
        for i, m in enumerate(self.messages):
            entry: dict[str, Any] = {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.text(),
            }
            if m.name is not None:
                entry["name"] = m.name
            if m.thought():
                entry["reasoning_content"] = m.thought()
            if m.tool_calls:
                entry["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments":
                     history_arguments(c.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments")}}
                    for j, c in enumerate(m.tool_calls)
                ]  # fmt: skip
                open_ids = {c.id for c in m.tool_calls}
            elif m.role == "tool":
                if m.tool_call_id not in open_ids:
                    raise Hf2qError(
                        f"messages[{i}]: a tool message answers a call of the assistant message before it; "
                        f"tool_call_id {m.tool_call_id!r} matches none"
                    )
                entry["tool_call_id"] = m.tool_call_id
            elif m.role in ("user", "assistant"):
                open_ids = set()
            out.append(entry)
        return out

    def constraint(self) -> ConstraintSpec | None:
        """The output constraint ``response_format`` asks for (None for text)."""
        return response_constraint(self.response_format)

    def logprob_count(self) -> int | None:
        """Alternatives per token asked for (None: no logprobs)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise Hf2qError("top_logprobs: needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


#: The legacy completions API's limit on ``logprobs``.
MAX_COMPLETION_LOGPROBS = 5


def response_constraint(fmt: dict[str, Any] | None) -> ConstraintSpec | None:
    """``response_format`` as an output constraint; Hf2qError naming the field."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_object")
    if kind != "json_schema":
        raise Hf2qError(f"response_format.type: must be text, json_object or json_schema, got {kind!r}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise Hf2qError("response_format.json_schema: required, an object with name and schema")
    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(FUNCTION_NAME, name):
        raise Hf2qError("response_format.json_schema.name: required, 1-64 letters, digits, _ or -")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise Hf2qError("response_format.json_schema.strict: must be true or false")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise Hf2qError(f"response_format.json_schema.schema: must be an object, got {type(schema).__name__}")
    try:
        constraint = ConstraintSpec.json_schema(schema)
    except Hf2qError as e:
        raise Hf2qError(
            f"response_format.json_schema.schema: {str(e).removeprefix('json_schema: ')}"
        ) from None
    problem = constraint.problem()
    if problem is not None:
        raise Hf2qError(f"response_format.json_schema.schema: {problem}")
    return constraint


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    def logprob_count(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo is not supported"
        if self.suffix:
            return "suffix is not supported"
        if self.best_of not in (None, 1):
            return "best_of: only best_of=1 is supported"
        if isinstance(self.prompt, list) and len(self.prompt) > 1 and isinstance(self.prompt[0], str):
            return "prompt: one prompt per request (a list of one string)"
        return super().unsupported()

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    def prompt_input(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt


# -- responses -------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


#: OpenAI's error ``type`` by HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 426: "invalid_request_error",
               429: "rate_limit_error", 499: "invalid_request_error",
               500: "server_error", 503: "server_error", 507: "server_error"}  # fmt: skip


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(stats: GenerationStats, reasoning_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; ``completion_tokens_details.reasoning_tokens``: the
    generated tokens that were reasoning."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


def finish_reason(stats: GenerationStats, called: bool) -> str:
    """OpenAI's finish reason: ``tool_calls`` for an answer that ended on its own with calls."""
    reason = stats.finish_reason or "stop"
    return "tool_calls" if called and reason == "stop" else reason


def openai_finish(finish: str) -> str:
    """OpenAI's finish reason for the engine's (a stop string: ``stop``)."""
    return "stop" if finish == "stop_sequence" else finish


def speculation(stats: GenerationStats, method: str) -> dict[str, Any]:
    """The ``hf2q`` extension field of a response: what speculation did."""
    return {
        "method": method,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "rounds": stats.rounds,
        "verify_rounds": stats.verify_rounds,
        "cached_tokens": stats.cached_tokens,
        "prefill_seconds": round(stats.prefill_seconds, 6),
        "decode_seconds": round(stats.decode_seconds, 6),
        "tokens_per_second": round(stats.tokens_per_second, 3),
    }


class Shape:
    """The response and chunk bodies of one endpoint (chat or text)."""

    def __init__(self, chat: bool, model: str, fingerprint: str):
        self.chat, self.model, self.fingerprint = chat, model, fingerprint
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }

    def _choice(self, text: str | None, finish: str | None, delta: bool, role: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if not delta:
            message = {"role": "assistant", "content": text}
            return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        body: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            body["content"] = text
        return {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish}

    def response(
        self,
        text: str | None,
        stats: GenerationStats,
        method: str,
        calls: list[ToolCall] | None = None,
        finish: str | None = None,
        reasoning: str = "",
        reasoning_tokens: int = 0,
    ) -> dict[str, Any]:
        """The whole answer; with ``calls``, the message carries them (content
        null when empty) and a finished answer's reason is ``tool_calls``
        (``finish``, when given, is the reason); with ``reasoning``, the
        message's ``reasoning_content``."""
        body = self._head("chat.completion" if self.chat else "text_completion")
        choice = self._choice(text, finish or finish_reason(stats, bool(calls)), delta=False)
        if reasoning:
            choice["message"]["reasoning_content"] = reasoning
        if calls:
            choice["message"]["tool_calls"] = [c.openai() for c in calls]
        body["choices"] = [choice]
        body["usage"] = usage(stats, reasoning_tokens)
        body["hf2q"] = speculation(stats, method)
        return body

    def tool_chunk(self, call: ToolCall, index: int, *, with_usage: bool = False) -> dict[str, Any]:
        """A stream's delta carrying one whole tool call (the ``index``-th)."""
        return self.call_chunk(call.openai(index), with_usage=with_usage)

    def call_chunk(self, entry: dict[str, Any], *, with_usage: bool = False) -> dict[str, Any]:
        """A stream's delta carrying part of a tool call: its start (``index``,
        ``id``, ``type``, ``function.name``) or more of its ``function.arguments``."""
        body = self._head("chat.completion.chunk")
        body["choices"] = [
            {"index": 0, "delta": {"tool_calls": [entry]}, "logprobs": None, "finish_reason": None}
        ]
        if with_usage:
            body["usage"] = None
        return body

    def reasoning_chunk(self, text: str, *, with_usage: bool = False) -> dict[str, Any]:
        """A stream's delta carrying reasoning (``delta.reasoning_content``)."""
        body = self._head("chat.completion.chunk")
        body["choices"] = [
            {"index": 0, "delta": {"reasoning_content": text}, "logprobs": None, "finish_reason": None}
        ]
        if with_usage:
            body["usage"] = None
        return body

    def chunk(
        self, text: str | None, finish: str | None = None, *, role: bool = False, with_usage: bool = False
    ) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = [self._choice(text, finish, delta=True, role=role)]
        if with_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, stats: GenerationStats, reasoning_tokens: int = 0) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(stats, reasoning_tokens)
        return body
