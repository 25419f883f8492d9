"""Reasoning told apart from the answer (``hf2q_py.reasoning``), without a
server: each family's syntax as its tokenizer declares it, the splitter
primed by the prompt's end, the same split however the text streams in,
markers never on either side, tool calls only in the answer, reasoning
tokens counted; the thinking switch per template; the library's
``GenerationResult.reasoning``."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scripted_model import char_tokenizer, vocabulary, write_scripted_folder
from test_tool_calls import TOOLS
from thinking_templates import (
    GEMMA4,
    GEMMA4_TOKENS,
    GPT_OSS,
    GPT_OSS_TOKENS,
    QWEN3,
    QWEN3_THINKING,
    QWEN3_TOKENS,
)

import hf2q_py
from hf2q_py.loaders.folder import load_folder
from hf2q_py.reasoning import (
    ANSWER,
    REASONING,
    HarmonySplitter,
    NoReasoning,
    TagSplitter,
    reasoning_format,
    split_reasoning,
    splitter_for,
)
from hf2q_py.server.conversation import Thinking, reasoning_history, template_options
from hf2q_py.server.events import CallEnd, Done, Pipeline, ReasoningDelta, TextDelta
from hf2q_py.server.tool_calls import tool_use
from hf2q_py.stats import GenerationStats

ASK = [{"role": "user", "content": "Weather in Paris?"}]


def family(template: str, tokens: tuple[str, ...]):
    """A tokenizer of single characters plus ``tokens``, with ``template``."""
    return char_tokenizer(vocabulary({}, tokens), template)


QWEN3_TOK = family(QWEN3, QWEN3_TOKENS)
QWEN3_THINKING_TOK = family(QWEN3_THINKING, QWEN3_TOKENS)
GPT_OSS_TOK = family(GPT_OSS, GPT_OSS_TOKENS)
GEMMA4_TOK = family(GEMMA4, GEMMA4_TOKENS)
PLAIN_TOK = family(QWEN3, ("<tool_call>", "</tool_call>"))


def prompt(tok, messages=ASK, **options) -> list[int]:
    return tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False, **options)


def split(splitter, text: str, cuts=None) -> tuple[str, str]:
    """(reasoning, answer) of ``text`` fed in pieces cut at ``cuts`` (default: character by character)."""
    bounds = sorted({0, len(text), *(cuts if cuts is not None else range(len(text)))})
    parts = [p for a, b in zip(bounds, bounds[1:]) for p in splitter.feed(text[a:b])] + splitter.finish()
    assert all(t for _, t in parts)  # no empty parts
    return "".join(t for k, t in parts if k == REASONING), "".join(t for k, t in parts if k == ANSWER)


# (tokenizer, prompt options, the model's raw text, reasoning, answer)
CASES = {
    "qwen3": (QWEN3_TOK, {}, "<think>\nThe user asks.\nParis is sunny.\n</think>\n\nIt is sunny.",
              "The user asks.\nParis is sunny.", "It is sunny."),
    "qwen3-no-think": (QWEN3_TOK, {"enable_thinking": False}, "It is sunny.", "", "It is sunny."),
    "qwen3-thinks-anyway": (QWEN3_TOK, {"enable_thinking": False}, "<think>Hmm.</think>It is sunny.",
                            "Hmm.", "It is sunny."),
    "qwen3-prompt-opened": (QWEN3_THINKING_TOK, {}, "The user asks.  \n</think>\n\nIt is sunny.",
                            "The user asks.", "It is sunny."),
    "qwen3-cut-in-reasoning": (QWEN3_THINKING_TOK, {}, "The user asks about </thi", "The user asks about </thi", ""),
    "gpt-oss": (GPT_OSS_TOK, {}, "<|channel|>analysis<|message|>User asks. Easy.<|end|>"
                "<|start|>assistant<|channel|>final<|message|>It is sunny.", "User asks. Easy.", "It is sunny."),
    "gpt-oss-preamble": (GPT_OSS_TOK, {}, "<|channel|>commentary<|message|>Checking.<|end|>"
                         "<|start|>assistant<|channel|>final<|message|> Sunny.", "", "Checking. Sunny."),
    "gemma4": (GEMMA4_TOK, {"enable_thinking": True}, "<|channel>thought\nThe user asks.<channel|>It is sunny.",
               "The user asks.", "It is sunny."),
    "gemma4-no-think": (GEMMA4_TOK, {"enable_thinking": False}, "It is sunny.", "", "It is sunny."),
    "no-reasoning": (PLAIN_TOK, {}, "<think>Not a marker here.</think> Fine.", "",
                     "<think>Not a marker here.</think> Fine."),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_each_family_splits_its_reasoning_from_its_answer_fed_character_by_character(case):
    tok, options, text, reasoning, answer = CASES[case]
    ids = prompt(tok, **options)
    assert split(splitter_for(tok, ids), text) == (reasoning, answer)
    assert split(splitter_for(tok, ids), text, cuts=[]) == (reasoning, answer)  # whole
    assert split_reasoning(tok, ids, text) == (reasoning, answer)


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(sorted(CASES)), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_any_chunking_gives_the_whole_texts_split(case, cuts):
    tok, options, text, reasoning, answer = CASES[case]
    ids = prompt(tok, **options)
    assert split(splitter_for(tok, ids), text, [c % (len(text) + 1) for c in cuts]) == (reasoning, answer)


def test_each_family_is_read_from_its_vocabulary():
    assert reasoning_format(QWEN3_TOK).start == "<think>"
    assert reasoning_format(GPT_OSS_TOK).kind == "harmony"
    assert (reasoning_format(GEMMA4_TOK).start, reasoning_format(GEMMA4_TOK).end) == (
        "<|channel>thought",
        "<channel|>",
    )
    assert reasoning_format(PLAIN_TOK) is None and reasoning_format(None) is None
    assert isinstance(splitter_for(PLAIN_TOK, prompt(PLAIN_TOK)), NoReasoning)


def test_the_generation_prompt_decides_where_the_answer_starts():
    opened = splitter_for(QWEN3_THINKING_TOK, prompt(QWEN3_THINKING_TOK))
    assert opened.feed("Thinking ") == [(REASONING, "Thinking")]  # trailing spaces wait: the block may end
    closed = splitter_for(QWEN3_TOK, prompt(QWEN3_TOK, enable_thinking=False))
    assert closed.feed("\n\nHello") == [(ANSWER, "Hello")]
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    turn = [*ASK, {"role": "assistant", "content": "", "reasoning_content": "Old.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    assert "</think>" in QWEN3_TOK.apply_chat_template(turn, tokenize=False)  # a closed block in the prompt
    assert splitter_for(QWEN3_TOK, prompt(QWEN3_TOK, turn)).feed("Hi") == [(ANSWER, "Hi")]
    forced = splitter_for(QWEN3_THINKING_TOK, prompt(QWEN3_THINKING_TOK), answering=True)
    assert forced.feed('{"name"') == [(ANSWER, '{"name"')]


@pytest.mark.parametrize(
    "splitter, text, held",
    [(TagSplitter("<think>", "</think>"), "<think>Deep thought</th", "</th"),
     (TagSplitter("<think>", "</think>"), "Answer <thi", "<thi"),
     (HarmonySplitter(), "<|channel|>analysis<|message|>Deep thought<|en", "<|en")],
)  # fmt: skip
def test_reasoning_streams_as_written_and_only_a_possible_marker_waits(splitter, text, held):
    out = []
    for ch in text:
        out += splitter.feed(ch)
    given_out = "".join(t for _, t in out)
    assert given_out + held in text and text.endswith(held)
    assert not any(m in given_out for m in ("<think>", "</th", "<thi", "<|", "|>"))


# -- the pipeline: reasoning, then the tool split -------------------------------------------------
def pipeline_events(tok, text: str, ids=None, tools=TOOLS, pieces=None):
    """The events of ``text`` (fed as ``pieces``, each a token, default characters) through the pipeline."""
    ids = prompt(tok, tools=tools) if ids is None else ids
    use = tool_use(tok, tools, "auto") if tools else None
    pipe = Pipeline(use, splitter_for(tok, ids, answering=bool(use and use.prefix)))
    out = []
    for piece in pieces or list(text):
        out += pipe.feed(piece, None, [len(piece)])
    return out + pipe.finish(), pipe.reasoning_tokens


def test_a_call_written_inside_reasoning_is_reasoning_and_the_answers_call_is_a_call():
    inner = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = f"<think>\nI could write {inner} but no.\n</think>\n\nLet me check.\n{call}"
    events, _ = pipeline_events(QWEN3_TOK, text)
    assert (
        "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == f"I could write {inner} but no."
    )
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Let me check."
    assert [(e.call.name, json.loads(e.call.arguments)) for e in events if isinstance(e, CallEnd)] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_gpt_oss_thinks_then_calls_a_function_through_its_harmony_format():
    text = ("<|channel|>analysis<|message|>Need weather. Maybe to=functions.get_time?<|end|>"
            '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')  # fmt: skip
    events, _ = pipeline_events(GPT_OSS_TOK, text)
    assert (
        "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        == "Need weather. Maybe to=functions.get_time?"
    )
    assert not [e for e in events if isinstance(e, TextDelta)]
    calls = [e.call for e in events if isinstance(e, CallEnd)]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_reasoning_tokens_are_counted_markers_included_however_rounds_cut_them():
    pieces = ["<think>", "\nThe user", " asks.", "\n", "</think>", "\n\n", "It is", " sunny."]
    rng = random.Random(0)
    for _ in range(20):  # a round commits several tokens: feed them together, with their ends
        ids = prompt(QWEN3_TOK)
        pipe = Pipeline(None, splitter_for(QWEN3_TOK, ids))
        i, out = 0, []
        while i < len(pieces):
            n = rng.randint(1, 4)
            group = pieces[i : i + n]
            ends = [sum(len(p) for p in group[: j + 1]) for j in range(len(group))]
            out += pipe.feed("".join(group), None, ends)
            i += n
        out += pipe.finish()
        assert pipe.reasoning_tokens == 5
        assert "".join(e.text for e in out if isinstance(e, TextDelta)) == "It is sunny."


def test_log_probabilities_of_reasoning_tokens_stay_out_of_the_answers():
    pipe = Pipeline(None, splitter_for(QWEN3_TOK, prompt(QWEN3_TOK)), logprobs=True)
    out = pipe.feed("<think>R</think>A", ["lp-think", "lp-r", "lp-end", "lp-a"], [7, 8, 16, 17])
    out += pipe.finish()
    assert [lp for e in out if isinstance(e, TextDelta) for lp in e.logprobs or ()] == ["lp-a"]
    assert pipe.reasoning_tokens == 3


def test_done_carries_the_reasoning_token_count():
    assert Done(GenerationStats(), "stop", reasoning_tokens=4).reasoning_tokens == 4


# -- the thinking switch and past reasoning ---------------------------------------------------------
DEEPSEEK_V31 = "{%- if not thinking is defined %}{% set thinking = false %}{% endif %}{{ '<think>' if thinking else '</think>' }}"
SEED_OSS = (
    "{%- if not thinking_budget is defined %}{% set thinking_budget = -1 %}{% endif %}{{ thinking_budget }}"
)


@pytest.mark.parametrize(
    "template, thinking, want",
    [(QWEN3, Thinking(enabled=False), {"enable_thinking": False}),
     (QWEN3, Thinking(effort="none"), {"enable_thinking": False}),
     (QWEN3, Thinking(effort="high"), {}),
     (GEMMA4, Thinking(enabled=True, budget=1024), {"enable_thinking": True}),
     (GPT_OSS, Thinking(effort="max"), {"reasoning_effort": "high"}),
     (GPT_OSS, Thinking(enabled=False), {"reasoning_effort": "low"}),
     (GPT_OSS, Thinking(enabled=True), {}),
     (DEEPSEEK_V31, Thinking(enabled=True), {"thinking": True}),
     (SEED_OSS, Thinking(enabled=True, budget=512), {"thinking_budget": 512}),
     (SEED_OSS, Thinking(enabled=False), {"thinking_budget": 0}),
     (QWEN3_THINKING, Thinking(enabled=False, effort="low"), {})],
    ids=["qwen3-off", "qwen3-effort-none", "qwen3-effort", "gemma4-on", "gpt-oss-effort", "gpt-oss-off",
         "gpt-oss-on", "deepseek-v3.1", "seed-oss-budget", "seed-oss-off", "no-switch"],
)  # fmt: skip
def test_the_thinking_wish_reaches_each_templates_switch(template, thinking, want):
    assert template_options(family(template, ()), thinking) == want


def test_the_switches_change_what_each_template_renders():
    off = QWEN3_TOK.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False, **template_options(QWEN3_TOK, Thinking(enabled=False)))  # fmt: skip
    assert off.endswith("<think>\n\n</think>\n\n")
    low = GPT_OSS_TOK.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False, **template_options(GPT_OSS_TOK, Thinking(effort="low")))  # fmt: skip
    assert "Reasoning: low" in low and low.endswith("<|start|>assistant")
    on = GEMMA4_TOK.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False, **template_options(GEMMA4_TOK, Thinking(enabled=True)))  # fmt: skip
    assert "<|think|>" in on and on.endswith("<|turn>model\n")


def test_past_reasoning_reaches_templates_that_render_it():
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    turn = [*ASK, {"role": "assistant", "content": "", "reasoning_content": "Need the weather.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    qwen = QWEN3_TOK.apply_chat_template(reasoning_history(turn, QWEN3), tools=TOOLS, tokenize=False)
    assert "<think>\nNeed the weather.\n</think>" in qwen
    oss = GPT_OSS_TOK.apply_chat_template(reasoning_history(turn, GPT_OSS), tools=TOOLS, tokenize=False)
    assert "<|channel|>analysis<|message|>Need the weather.<|end|>" in oss
    assert reasoning_history(turn, GEMMA4) == turn  # Gemma 4 drops past thinking


# -- the library ----------------------------------------------------------------------------------
def test_generate_gives_a_thinking_models_reasoning_and_content_apart(tmp_path):
    scripts = {"\n": ["<|channel>thought", "\nParis in spring.", "<channel|>It is sunny."],
               "<channel|>": ["Sunny, I think."]}  # fmt: skip
    folder = write_scripted_folder(tmp_path / "gemma4", scripts, template=GEMMA4, tokens=GEMMA4_TOKENS)
    target = load_folder(str(folder), None)
    thinking = hf2q_py.generate(target, "Weather?", max_tokens=20, method="baseline")
    assert (thinking.reasoning, thinking.content) == ("Paris in spring.", "It is sunny.")
    assert thinking.text == "<|channel>thought\nParis in spring.<channel|>It is sunny."
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "Weather?"}], add_generation_prompt=True, enable_thinking=False)  # fmt: skip
    quiet = hf2q_py.generate(target, ids, max_tokens=20)
    assert (quiet.reasoning, quiet.content) == ("", "Sunny, I think.")
