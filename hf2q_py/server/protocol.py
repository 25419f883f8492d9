"""OpenAI's request schemas as pydantic models, and the response bodies.

Requests are validated strictly (a string is not a number); fields that
OpenAI defines and the server cannot honour are refused by name when set to
anything but their neutral value; fields it does not know are ignored.
``hf2q`` is this server's extension: ``{"method": "ngram:k=8"}`` chooses the
method of one request.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import Hf2qError
from ..stats import GenerationStats

MAX_STOP_STRINGS = 16


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


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
    logprobs: Any = None
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
        if self.logprobs not in (None, False, 0):
            return "logprobs are not supported"
        return None

    def stop_strings(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > MAX_STOP_STRINGS:
            raise Hf2qError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise Hf2qError("stop: stop strings must not be empty")
        return stops

    def sampling(self, default_temperature: float) -> dict[str, Any]:
        """The ``SamplingConfig`` options the request sets."""
        out: dict[str, Any] = {"temperature": default_temperature}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                out[name] = float(value) if name in ("temperature", "top_p", "min_p") else value
        return out


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools are not supported"
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format: only the text format is supported"
        return super().unsupported()

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

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
               405: "invalid_request_error", 413: "invalid_request_error", 499: "invalid_request_error",
               500: "server_error", 503: "server_error"}  # fmt: skip


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(stats: GenerationStats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


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

    def response(self, text: str, stats: GenerationStats, method: str) -> dict[str, Any]:
        body = self._head("chat.completion" if self.chat else "text_completion")
        body["choices"] = [self._choice(text, stats.finish_reason or "stop", delta=False)]
        body["usage"] = usage(stats)
        body["hf2q"] = speculation(stats, method)
        return body

    def chunk(
        self, text: str | None, finish: str | None = None, *, role: bool = False, with_usage: bool = False
    ) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = [self._choice(text, finish, delta=True, role=role)]
        if with_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, stats: GenerationStats) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(stats)
        return body
