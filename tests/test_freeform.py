"""Freeform tools' grammars, without a server: a tool's Lark grammar or regex
rewritten for the inside of a JSON string accepts exactly the escaped texts
of the original's; the whole answer's grammar lets free text and calls
through and holds a freeform call's input to its grammar (JSON and XML call
syntaxes, a forced call's opening, a JSON answer beside tools); a call's
input read back from its arguments, whole or as they stream."""

from __future__ import annotations

import json
import re

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scripted_model import write_scripted_folder
from test_server_responses import PATCH_GRAMMAR

from hf2q_py.constraints import ConstraintSpec, ll_tokenizer
from hf2q_py.errors import Hf2qError
from hf2q_py.grammar_quote import embed_lark, embed_regex, quoted_regex
from hf2q_py.loaders.folder import load_folder
from hf2q_py.server.freeform import InputDeltas, answer_constraint, call_input, check_grammar
from hf2q_py.server.tool_calls import ToolFormat, ToolUse


@pytest.fixture(scope="module")
def chars(tmp_path_factory):
    """A tokenizer of single characters (printable ASCII and the line break), as llguidance reads it."""
    folder = write_scripted_folder(tmp_path_factory.mktemp("chars"), {"\n": ["<tool_call>", "</tool_call>"]})
    hf = load_folder(str(folder), None).tokenizer._tokenizer
    return hf, ll_tokenizer(hf, [hf.eos_token_id])


def accepts(chars, grammar: str, text: str) -> bool:
    hf, tok = chars
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = hf.encode(text, add_special_tokens=False)
    assert hf.decode(ids) == text
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def inside(text: str) -> str:
    """``text`` as JSON writes it inside a string."""
    return json.dumps(text)[1:-1]


PATCHES = [
    ('*** Begin Patch\n*** Add File: a "b".txt\n+hello \\ world\n+\n*** End Patch\n', True),
    (
        '*** Begin Patch\n*** Update File: x.py\n@@ def f():\n-    return 1\n+    return "2"\n*** End Patch',
        True,
    ),
    ("*** Begin Patch\n*** Delete File: old.txt\n*** End Patch\n", True),
    ("*** Begin Patch\n*** Add File: a\nhello\n*** End Patch\n", False),
    ("*** Begin Patch\n*** End Patch\n", False),
    ("*** Begin Patch\n*** Delete File: a\n*** End Patch\n*** End Patch\n", False),
]


@pytest.mark.parametrize("patch, valid", PATCHES, ids=range(len(PATCHES)))
def test_a_quoted_lark_grammar_accepts_the_escaped_texts_of_the_original(chars, patch, valid):
    raw, start = embed_lark(PATCH_GRAMMAR, "t0_", quote=False)
    quoted, same = embed_lark(PATCH_GRAMMAR, "t0_", quote=True)
    assert start == same == "t0_start"
    assert accepts(chars, f"start: {start}\n{raw}", patch) is valid
    assert accepts(chars, f"start: {start}\n{quoted}", inside(patch)) is valid


REGEXES = [
    r"[a-z\"]+\s*\d{2}",
    r"(?s:.)*",
    r"[^x]+",
    r"\S+",
    r"[\n\t]",
    r"a.*b",
    r"(x|\n)+y?",
    r"[a-z]+x.*",
    r"\\\w+",
]
TEXTS = st.text(alphabet='abxy12 "\\\n\t\x01', max_size=8)


@settings(max_examples=200, deadline=None)
@given(index=st.integers(0, len(REGEXES) - 1), text=TEXTS)
def test_a_quoted_regex_matches_the_escaped_texts_of_those_it_matched(chars, index, text):
    regex = REGEXES[index]
    want = re.fullmatch(regex.replace(r"\S", r"[^\s]"), text) is not None
    assert accepts(chars, f"start: {quoted_regex(regex)}", inside(text)) is want


def test_escapes_of_control_characters_take_either_case_of_hex_digit(chars):
    grammar, start = embed_regex("a\x1bb", "t0_", quote=True)
    assert accepts(chars, f"start: {start}\n{grammar}", "a\\u001bb")
    assert accepts(chars, f"start: {start}\n{grammar}", "a\\u001Bb")
    assert not accepts(chars, f"start: {start}\n{grammar}", "a\\u001cb")


@pytest.mark.parametrize(
    "grammar, says",
    [
        ("start: A\nA: /a/\n%ignore /b/", "the %ignore directive"),
        ("start: <|im_end|>", "special token"),
        ("start: x\nx[lazy]: /a+/", "lexeme options"),
        ("start: /^a/", "the anchor"),
        ("start: /(?i)a/", "the flag 'i'"),
        ("start: /a+?/", "a lazy repetition"),
        ("start: /(?=a)a/", "a look-around"),
        ('start: "\\n"i', "case-insensitive literal"),
        ("start: A\n%import common.FANCY", "common.FANCY"),
        ("rule: /a/", "no start rule"),
    ],
)
def test_what_a_quoted_grammar_cannot_carry_is_refused_by_name(grammar, says):
    with pytest.raises(Hf2qError, match=re.escape(says)):
        embed_lark(grammar, "t0_", quote=True)
    assert check_grammar(ConstraintSpec("grammar", grammar)) is not None


# -- the answer's grammar --------------------------------------------------------------------------
APPLY = {"apply_patch": ConstraintSpec("grammar", PATCH_GRAMMAR)}
GOOD, BAD = PATCHES[0][0], PATCHES[3][0]
OTHER = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "x"}}\n</tool_call>'
SYNTAX = {
    "json_tools": lambda p: '<tool_call>\n{"name": "apply_patch", "arguments": {"input": ' + json.dumps(p) + "}}\n</tool_call>",
    "qwen3_coder": lambda p: f"<tool_call>\n<function=apply_patch>\n<parameter=input>\n{p}\n</parameter>\n</function>\n</tool_call>",
}  # fmt: skip


def use(fmt: str, prefix: str = "") -> ToolUse:
    return ToolUse([], frozenset({"apply_patch", "get_time"}), ToolFormat(fmt), prefix)


@pytest.mark.parametrize("fmt", sorted(SYNTAX))
def test_the_answers_grammar_holds_a_freeform_calls_input_to_its_grammar_and_nothing_else(chars, fmt):
    spec = answer_constraint(use(fmt), APPLY, None)
    assert spec.kind == "grammar" and spec.problem() is None
    call = SYNTAX[fmt]
    for text, ok in [("Hello there", True), ("Sure.\n" + call(GOOD), True), ("Sure.\n" + call(BAD), False),
                     (OTHER, True), (f"{call(GOOD)}\n{OTHER}\nDone.", True)]:  # fmt: skip
        assert accepts(chars, spec.text, text) is ok, text


def test_a_forced_calls_opening_is_read_by_the_grammar_before_the_answer(chars):
    opening = '<tool_call>\n{"name": "apply_patch", "arguments": '
    spec = answer_constraint(use("json_tools", opening), APPLY, None)
    assert spec.after == opening
    assert accepts(chars, spec.text, SYNTAX["json_tools"](GOOD)) and spec.text.startswith("%llguidance")


def test_without_a_freeform_grammar_or_a_known_syntax_the_answer_keeps_its_own_constraint():
    text = ConstraintSpec("json_object")
    assert answer_constraint(None, APPLY, text) is text
    assert answer_constraint(use("json_tools"), {"apply_patch": None}, None) is None
    assert answer_constraint(use("pythonic"), APPLY, text) is text  # a syntax the grammar cannot read


def test_a_json_answer_beside_tools_is_calls_or_the_json(chars):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = answer_constraint(use("json_tools"), {}, ConstraintSpec.json_schema(schema))
    for text, ok in [('{"a": 1}', True), ('hi {"a": 1}', False), (OTHER, True), ('{"a": "x"}', False)]:
        assert accepts(chars, spec.text, text) is ok, text


# -- reading a call's input --------------------------------------------------------------------------
def test_a_calls_input_is_its_input_argument_or_its_one_string():
    assert call_input('{"input": "a\\nb"}') == "a\nb"
    assert call_input('{"patch": "x"}') == "x"
    assert call_input('{"a": 1, "b": 2}') == '{"a": 1, "b": 2}'
    assert call_input("not json") == "not json"


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=30), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_a_streamed_input_gives_the_decoded_text_however_the_arguments_are_cut(text, cuts):
    arguments = json.dumps({"input": text})
    reader, got, at = InputDeltas(), [], 0
    for cut in sorted(c for c in cuts if c < len(arguments)):
        got.append(reader.feed(arguments[at:cut]))
        at = cut
    got.append(reader.feed(arguments[at:]))
    got.append(reader.finish(arguments))
    assert "".join(got) == text


@pytest.fixture(scope="module")
def tagged():
    """SmolLM2's tokenizer with ``<tool_call>`` and ``</tool_call>`` added, as Qwen's vocabulary
    has them (not special to the tokenizer; llguidance reads such tokens as special)."""
    from scripted_model import smollm2_tokenizer_json
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(smollm2_tokenizer_json())
    tok.add_tokens([AddedToken(t, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    return hf, ll_tokenizer(hf, [hf.eos_token_id])


@pytest.mark.parametrize("fmt", sorted(SYNTAX))
def test_markers_the_grammar_engine_reads_as_special_tokens_are_named_by_id(tagged, fmt):
    from hf2q_py.constraints import special_tokens

    hf = tagged[0]

    class Target:
        tokenizer, eos_token_ids = hf, [hf.eos_token_id]

    special = special_tokens(Target(), ["<tool_call>", "</tool_call>", "Hello"])
    assert special == {"<tool_call>": hf.convert_tokens_to_ids("<tool_call>"),
                       "</tool_call>": hf.convert_tokens_to_ids("</tool_call>")}  # fmt: skip
    spec = answer_constraint(use(fmt), APPLY, None, lambda texts: special)
    assert f"<[{special['<tool_call>']}]>" in spec.text
    call = SYNTAX[fmt]
    for text, ok in [("Hello there", True), ("Sure.\n" + call(GOOD), True), ("Sure.\n" + call(BAD), False),
                     (OTHER, True), (f"{call(GOOD)}\n{OTHER}\nDone.", True), (call(GOOD), True)]:  # fmt: skip
        assert accepts(tagged, spec.text, text) is ok, text
