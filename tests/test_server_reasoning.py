"""Reasoning models through the real ``hf2q-py serve`` process and the real
clients: scripted models (``scripted_model.py``) behind templates that follow
Qwen3's, Qwen3-Thinking's and gpt-oss's (``thinking_templates.py``), with
their marker tokens. Chat completions give the reasoning as
``reasoning_content`` (whole and streamed, and take it back in history),
Messages as ``thinking`` blocks; the answer's content never holds it; a call
written after the reasoning is a call; the thinking switch reaches the
template."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from scripted_model import write_scripted_folder
from server_process import running_server
from test_server_tools import TOOLS
from thinking_templates import GPT_OSS, GPT_OSS_TOKENS, QWEN3, QWEN3_THINKING, QWEN3_TOKENS

ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
TOOLS_A = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip
PLAIN = {"hf2q": {"method": "baseline"}}  # a token a round: each piece streams on its own

#: Qwen3 thinking on its own (the generation prompt opens nothing): a think block, then the answer.
QWEN3_SCRIPT = ["<think>", "\nThe user asks about Paris.", "\nSpring there is mild.\n", "</think>",
                "\n\nIt is sunny in Paris."]  # fmt: skip
QWEN3_REASONING, QWEN3_ANSWER = "The user asks about Paris.\nSpring there is mild.", "It is sunny in Paris."
#: Qwen3-Thinking (the generation prompt opens the block): reasoning with a call written inside
#: it (not a call), the block's end, then a call.
INNER = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
THINKER_SCRIPT = ["The user wants the weather in Paris.", f" I could write {INNER}, but no.\n", "</think>",
                  "\n\n<tool_call>\n", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "\n</tool_call>"]  # fmt: skip
THINKER_REASONING = f"The user wants the weather in Paris. I could write {INNER}, but no."
#: gpt-oss: analysis, then a message to functions.get_weather (the generation prompt ends in "assistant").
GPT_OSS_SCRIPT = ["<|channel|>analysis<|message|>", "The user wants the weather.", " Call get_weather.",
                  "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
                  '{"city": "Paris"}']  # fmt: skip


def folder(
    tmp_path_factory, name: str, start: str, script: list[str], template: str, tokens: tuple[str, ...]
):
    extra = tuple(t for t in tokens if t not in script)
    return write_scripted_folder(
        tmp_path_factory.mktemp(name), {start: script}, template=template, tokens=extra
    )


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    with running_server(
        "--model", str(folder(tmp_path_factory, "qwen3", "\n", QWEN3_SCRIPT, QWEN3, QWEN3_TOKENS))
    ) as s:
        yield s


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    path = folder(tmp_path_factory, "thinker", "\n", THINKER_SCRIPT, QWEN3_THINKING, QWEN3_TOKENS)
    with running_server("--model", str(path)) as s:
        yield s


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    with running_server(
        "--model", str(folder(tmp_path_factory, "gpt-oss", "t", GPT_OSS_SCRIPT, GPT_OSS, GPT_OSS_TOKENS))
    ) as s:
        yield s


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=60)


def anthropic_client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def chat(server, messages=ASK, **kw):
    return openai_client(server).chat.completions.create(model="any", messages=messages, **kw)


def streamed(server, **kw) -> tuple[list[str], list[str], list, object]:
    """A chat stream's reasoning deltas, content deltas, calls (name, arguments) and last usage."""
    chunks = list(chat(server, stream=True, stream_options={"include_usage": True}, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = [
        d.model_extra["reasoning_content"] for d in deltas if (d.model_extra or {}).get("reasoning_content")
    ]
    content = [d.content for d in deltas if d.content]
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, ["", ""])
            entry[0] += tc.function.name or ""
            entry[1] += tc.function.arguments or ""
    kinds = ["r" if (d.model_extra or {}).get("reasoning_content") else "c" for d in deltas if d.content or (d.model_extra or {}).get("reasoning_content") or d.tool_calls]  # fmt: skip
    assert kinds == sorted(kinds, key=lambda k: k != "r")  # all the reasoning comes first
    return thought, content, [(n, json.loads(a)) for n, a in calls.values()], chunks[-1].usage


def reasoning_of(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


# -- Qwen3: thinks, then answers -----------------------------------------------------------------
def test_chat_completions_give_the_reasoning_apart_from_the_content(qwen3):
    r = chat(qwen3)
    message = r.choices[0].message
    assert (reasoning_of(message), message.content) == (QWEN3_REASONING, QWEN3_ANSWER)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 5 and r.usage.completion_tokens_details.reasoning_tokens == 4


def test_a_stream_gives_the_reasoning_as_it_is_written_then_the_content(qwen3):
    thought, content, calls, usage = streamed(qwen3, extra_body=PLAIN)
    assert "".join(thought) == QWEN3_REASONING and "".join(content) == QWEN3_ANSWER and not calls
    assert len(thought) >= 2  # the block's two pieces as they came, not at its end
    assert not any("think" in c or "mild" in c for c in content)
    assert usage.completion_tokens_details.reasoning_tokens == 4
    again, content, _, _ = streamed(qwen3)  # speculation writes several tokens a round
    assert "".join(again) == QWEN3_REASONING and "".join(content) == QWEN3_ANSWER


def test_thinking_switched_off_reaches_enable_thinking_and_reasoning_written_anyway_is_split(qwen3):
    on = chat(qwen3).usage.prompt_tokens
    closed = len(["<think>", "\n", "\n", "</think>", "\n", "\n"])  # the empty block the template closes
    for off in (chat(qwen3, reasoning_effort="none"),
                chat(qwen3, extra_body={"chat_template_kwargs": {"enable_thinking": False}})):  # fmt: skip
        assert off.usage.prompt_tokens == on + closed
        assert (reasoning_of(off.choices[0].message), off.choices[0].message.content) == (QWEN3_REASONING, QWEN3_ANSWER)  # fmt: skip
    claude = anthropic_client(qwen3)
    count = lambda **kw: claude.messages.count_tokens(model="x", messages=ASK, **kw).input_tokens  # noqa: E731
    assert count(thinking={"type": "disabled"}) == on + closed
    assert count(thinking={"type": "enabled", "budget_tokens": 2048}) == count() == on


def test_messages_give_a_thinking_block_then_the_text(qwen3):
    claude = anthropic_client(qwen3)
    m = claude.messages.create(model="claude-x", max_tokens=256, messages=ASK, thinking={"type": "adaptive"})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", QWEN3_REASONING), ("text", QWEN3_ANSWER)]  # fmt: skip
    assert m.stop_reason == "end_turn" and m.usage.output_tokens == 5
    with claude.messages.stream(model="claude-x", max_tokens=256, messages=ASK, extra_body=PLAIN) as s:
        events = list(s)
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == QWEN3_REASONING and final.content[1].text == QWEN3_ANSWER
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert len([d for d in deltas if d.type == "thinking_delta"]) >= 2
    assert [d.type for d in deltas if d.type == "signature_delta"] == ["signature_delta"]
    assert not any(d.type == "text_delta" and "mild" in d.text for d in deltas)


def test_reasoning_given_back_in_history_is_rendered_where_the_template_renders_it(qwen3):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    thought = "Look it up."

    def turn(**reasoning):
        return [*ASK, {"role": "assistant", "content": None, "tool_calls": [call], **reasoning},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip

    bare = chat(qwen3, turn(), tools=TOOLS).usage.prompt_tokens
    block = len(
        ["<think>", "\n", *thought, "\n", "</think>", "\n", "\n"]
    )  # one token a character but markers
    assert chat(qwen3, turn(reasoning_content=thought), tools=TOOLS).usage.prompt_tokens == bare + block
    assert chat(qwen3, turn(reasoning=thought), tools=TOOLS).usage.prompt_tokens == bare + block
    claude = anthropic_client(qwen3)
    history = [*ASK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": thought, "signature": ""},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]  # fmt: skip
    counted = claude.messages.count_tokens(model="x", messages=history, tools=TOOLS_A).input_tokens
    assert counted == bare + block  # thinking blocks given back are the message's reasoning_content


# -- Qwen3-Thinking: the prompt opens the block; thinks, then calls ---------------------------------
def test_a_model_whose_prompt_opens_the_block_thinks_then_calls(thinker):
    r = chat(thinker, tools=TOOLS)
    message = r.choices[0].message
    assert reasoning_of(message) == THINKER_REASONING and message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]  # fmt: skip
    assert (
        r.choices[0].finish_reason == "tool_calls" and r.usage.completion_tokens_details.reasoning_tokens == 3
    )
    thought, content, calls, _ = streamed(thinker, tools=TOOLS, extra_body=PLAIN)
    assert "".join(thought) == THINKER_REASONING and not content
    assert calls == [("get_weather", {"city": "Paris"})]


def test_messages_give_the_thinking_then_the_tool_use(thinker):
    claude = anthropic_client(thinker)
    m = claude.messages.create(model="claude-x", max_tokens=256, messages=ASK, tools=TOOLS_A)
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
    assert m.content[0].thinking == THINKER_REASONING
    assert (m.content[1].name, m.content[1].input) == ("get_weather", {"city": "Paris"})
    with claude.messages.stream(
        model="claude-x", max_tokens=256, messages=ASK, tools=TOOLS_A, extra_body=PLAIN
    ) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == THINKER_REASONING and final.content[1].input == {"city": "Paris"}


def test_a_forced_call_or_a_constrained_answer_starts_in_the_answer_even_inside_an_opened_block(thinker):
    r = chat(thinker, tools=TOOLS, tool_choice="required", max_tokens=2)
    assert reasoning_of(r.choices[0].message) is None  # what follows the forced opening is the call's
    r = chat(thinker, response_format={"type": "json_object"}, max_tokens=8)
    assert reasoning_of(r.choices[0].message) is None and r.choices[0].message.content


# -- gpt-oss: harmony channels ------------------------------------------------------------------------
def test_gpt_oss_analysis_is_reasoning_and_its_message_to_a_function_a_call(gpt_oss):
    r = chat(gpt_oss, tools=TOOLS)
    message = r.choices[0].message
    assert (
        reasoning_of(message) == "The user wants the weather. Call get_weather." and message.content is None
    )
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]  # fmt: skip
    assert r.usage.completion_tokens_details.reasoning_tokens == 3
    thought, content, calls, _ = streamed(gpt_oss, tools=TOOLS, extra_body=PLAIN)
    assert "".join(thought) == "The user wants the weather. Call get_weather." and not content
    assert calls == [("get_weather", {"city": "Paris"})]
    m = anthropic_client(gpt_oss).messages.create(model="x", max_tokens=256, messages=ASK, tools=TOOLS_A)
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.content[1].input == {"city": "Paris"}


def test_gpt_oss_effort_reaches_reasoning_effort(gpt_oss):
    tokens = {e: chat(gpt_oss, reasoning_effort=e, max_tokens=1).usage.prompt_tokens for e in ("low", "high")}
    assert tokens["high"] == tokens["low"] + 1  # "Reasoning: high" against "Reasoning: low"
    claude = anthropic_client(gpt_oss)
    count = lambda **kw: claude.messages.count_tokens(model="x", messages=ASK, **kw).input_tokens  # noqa: E731
    assert count(thinking={"type": "disabled"}) == count(output_config={"effort": "low"}) == tokens["low"]
    assert count(output_config={"effort": "max"}) == tokens["high"]
