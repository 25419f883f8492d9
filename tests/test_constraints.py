"""Structured output's grammar state (``hf2q_py.constraints``): masks for the
positions a round verifies, drafts cut where the grammar forbids them,
commits, end of generation, and specs refused with their problem named."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_one_line_error, cli
from models import VOCAB, char_tokenizer, tiny_target

import hf2q_py
from hf2q_py.constraints import ConstraintSpec, bitmask_to_mlx
from hf2q_py.errors import Hf2qError
from hf2q_py.generation import make_config
from hf2q_py.loaders.builtin import builtin_model_path
from hf2q_py.loaders.gguf_file import read_header
from hf2q_py.loaders.gguf_tokenizer import tokenizer_from_gguf

EOS = VOCAB - 1  # the char tokenizer's "∎"
PERSON = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3},
    },
    "required": ["ok", "n", "color", "tags"],
    "additionalProperties": False,
}


def chars(width: int = VOCAB) -> SimpleNamespace:
    """What a constraint reads of a Target, over the tiny character vocabulary."""
    return SimpleNamespace(tokenizer=char_tokenizer(), eos_token_ids={EOS}, vocab_size=width)


def allowed(mask: mx.array, row: int = 0) -> set[int]:
    return {int(i) for i in np.nonzero(np.array(mask[row]))[0]}


def ids(text: str) -> list[int]:
    return list(char_tokenizer().encode(text))


@pytest.fixture(scope="module")
def smol_vocab() -> SimpleNamespace:
    """The built-in model's tokenizer (read from its GGUF's header, no weights)."""
    tok = tokenizer_from_gguf(read_header(builtin_model_path()).metadata)
    return SimpleNamespace(tokenizer=tok, eos_token_ids=set(tok.eos_token_ids), vocab_size=49152)


# -- plan and commit -----------------------------------------------------------------------
def test_plan_counts_the_drafts_the_grammar_allows_and_cuts_at_the_first_it_forbids():
    c = ConstraintSpec.json_schema(PERSON).build(chars())
    good = ids('{"ok": true, "n": 7')
    assert c.plan(good)[0] == len(good)
    assert c.plan(good[:5] + ids("x") + good[6:])[0] == 5  # 'x' cannot follow '{"ok"'
    assert c.plan(ids("["))[0] == 0
    assert c.plan([10_000, *good])[0] == 0  # outside the vocabulary


def test_plan_gives_one_mask_per_verified_position_and_leaves_the_state_as_it_was():
    c = ConstraintSpec.json_schema(PERSON).build(chars())
    drafts = ids('{"ok": f')
    n, masks = c.plan(drafts)
    assert n == len(drafts) and masks.shape == (n + 1, VOCAB) and masks.dtype == mx.bool_
    step = ConstraintSpec.json_schema(PERSON).build(chars())
    for i in range(n + 1):  # row i: what may follow drafts[:i], as committing them one by one says
        assert allowed(masks, i) == allowed(step.plan([])[1])
        if i < n:
            assert drafts[i] in allowed(masks, i)
            step.commit([drafts[i]])
    assert allowed(masks, n) == {ord("a") - 32}  # only "alse" can follow "f"
    assert allowed(c.plan([])[1]) == {ord("{") - 32}  # the plan moved nothing


def test_commit_advances_and_a_token_the_grammar_forbids_is_refused():
    c = ConstraintSpec("regex", "ab+").build(chars())
    c.commit(ids("ab"))
    assert allowed(c.plan([])[1]) == {ord("b") - 32, EOS}
    with pytest.raises(Hf2qError, match="does not allow token"):
        c.commit(ids("a"))


def test_end_of_generation_is_allowed_once_complete_and_alone_once_nothing_can_follow():
    c = ConstraintSpec("regex", "[0-9]+").build(chars())
    assert EOS not in allowed(c.plan([])[1])
    c.commit(ids("4"))
    assert EOS in allowed(c.plan([])[1]) and c.accepting and not c.done  # more digits may follow
    done = ConstraintSpec.json_schema({"enum": ["yes"]}).build(chars())
    done.commit(ids('"yes"'))
    assert done.done and allowed(done.plan([])[1]) == {EOS}
    n, masks = done.plan([EOS])
    assert n == 1 and allowed(masks, 0) == allowed(masks, 1) == {EOS}


def test_masks_are_as_wide_as_the_models_logits_and_false_past_the_vocabulary():
    c = ConstraintSpec("json_object").build(chars(width=VOCAB + 70))
    mask = c.plan([])[1]
    assert mask.shape == (1, VOCAB + 70) and not np.array(mask[0, VOCAB:]).any()
    words = np.array([[0b101, -1]], dtype=np.int32)
    assert np.array(bitmask_to_mlx(words, 40)[0]).nonzero()[0].tolist() == [0, 2, *range(32, 40)]


def test_a_draft_after_the_end_is_not_allowed():
    c = ConstraintSpec.json_schema({"enum": [1]}).build(chars())
    assert c.plan(ids("1") + [EOS] + ids("1"))[0] == 2


def test_each_generation_gets_its_own_state_from_one_cached_compile():
    from hf2q_py.constraints import _compiled

    target = chars()
    spec = ConstraintSpec.json_schema(PERSON)
    first, second = spec.build(target), spec.build(target)
    first.commit(ids('{"ok"'))
    assert allowed(second.plan([])[1]) == {ord("{") - 32}
    eos = (EOS,)
    assert _compiled(target.tokenizer, eos, spec)[0] is _compiled(target.tokenizer, eos, spec)[0]


# -- decoding under a constraint -----------------------------------------------------------
def masked_argmax(logits: mx.array, mask: mx.array) -> mx.array:
    return mx.argmax(mx.where(mask, logits, -mx.inf), axis=-1)


def constrained_greedy(target, spec: ConstraintSpec, prompt: list[int], limit: int) -> list[int]:
    """Plain constrained greedy decoding: one masked argmax per token."""
    c, out = spec.build(target), []
    for _ in range(limit):
        logits = target.model(mx.array([prompt + out]))[0, -1]
        t = int(masked_argmax(logits, c.plan([])[1][0]))
        if t in target.eos_token_ids:
            break
        c.commit([t])
        out.append(t)
    return out


def constrained_speculative(target, spec: ConstraintSpec, prompt: list[int], limit: int, guess) -> list[int]:
    """Speculation under a constraint, as the loop does it: drafts cut by the
    grammar, every verified position masked, the longest matching prefix
    plus the target's own token committed."""
    c, out = spec.build(target), []
    while len(out) < limit:
        n, masks = c.plan(guess(out))
        drafts = guess(out)[:n]
        logits = target.model(mx.array([prompt + out + drafts]))[0, -(n + 1) :]
        chosen = masked_argmax(logits, masks).tolist()
        k = 0
        while k < n and chosen[k] == drafts[k]:
            k += 1
        new = drafts[:k] + [chosen[k]]
        ended = [t in target.eos_token_ids for t in new]
        if any(ended):
            new = new[: ended.index(True)]
        c.commit(new)
        out += new
        if any(ended):
            break
    return out[:limit]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("schema", [PERSON, {"type": "object"}], ids=["person", "any-object"])
def test_constrained_greedy_decoding_of_a_random_model_always_gives_valid_json(seed, schema):
    target = tiny_target("llama", seed=seed, scale=2.0, tokenizer=True)
    spec = (
        ConstraintSpec.json_schema(schema) if schema != {"type": "object"} else ConstraintSpec("json_object")
    )
    out = constrained_greedy(target, spec, ids("Answer: "), 200)
    assert len(out) < 200  # these seeds end well within the limit
    jsonschema.validate(json.loads(target.tokenizer.decode(out)), schema)


@pytest.mark.parametrize("seed", range(3))
def test_speculating_under_a_schema_gives_the_plain_constrained_answer(seed):
    target = tiny_target("llama", seed=seed, scale=2.0, tokenizer=True)
    spec = ConstraintSpec.json_schema(PERSON)
    want = constrained_greedy(target, spec, ids("Q: "), 120)
    wrong = ids('{"ok": maybe, "n": 1000}')

    def guess(out: list[int]) -> list[int]:  # right for a while, then wrong, by turns
        i = len(out)
        return want[i : i + 3] + wrong[i % 7 : i % 7 + 3]

    assert constrained_speculative(target, spec, ids("Q: "), 120, guess) == want
    jsonschema.validate(json.loads(target.tokenizer.decode(want)), PERSON)


# -- the built-in model's tokenizer ----------------------------------------------------------
def test_a_schema_over_the_builtin_vocabulary_walks_a_valid_document_and_cuts_a_wrong_draft(smol_vocab):
    spec = ConstraintSpec.json_schema(PERSON)
    c = spec.build(smol_vocab)
    doc = smol_vocab.tokenizer.encode('{"ok": true, "n": 42, "color": "blue", "tags": ["bc", "a"]}')
    n, masks = c.plan(doc)
    assert n == len(doc) and masks.shape == (len(doc) + 1, 49152)
    assert all(t in allowed(masks, i) for i, t in enumerate(doc))
    c.commit(doc)
    assert c.done and allowed(c.plan([])[1]) == smol_vocab.eos_token_ids
    fresh = spec.build(smol_vocab)
    wrong = smol_vocab.tokenizer.encode('{"ok": "yes"}')
    assert 0 < fresh.plan(wrong)[0] < len(wrong)
    assert not allowed(fresh.plan([])[1]) & smol_vocab.eos_token_ids


# -- specs refused, naming the problem -------------------------------------------------------
@pytest.mark.parametrize(
    "make, says",
    [
        (lambda: ConstraintSpec.json_schema({"type": "object", "if": {}, "then": {}}), "unsupported schema feature(s): if, then"),
        (lambda: ConstraintSpec.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
        (lambda: ConstraintSpec.json_schema({"type": "strng"}), "strng"),
        (lambda: ConstraintSpec.json_schema("{not json"), "not valid JSON"),
        (lambda: ConstraintSpec.json_schema([1, 2]), "a schema is a JSON object"),
        (lambda: ConstraintSpec.json_schema({"type": "string", "pattern": "[a-"}), "unclosed character class"),
        (lambda: ConstraintSpec.json_schema({"$ref": "https://example.com/s.json"}), "https://example.com/s.json"),
        (lambda: ConstraintSpec("regex", "(ab"), "invalid regular expression"),
        (lambda: ConstraintSpec("regex", "  "), "regex is empty"),
        (lambda: ConstraintSpec("grammar", "start: undefined_rule"), "undefined_rule"),
        (lambda: ConstraintSpec("xml", "<a/>"), "unknown constraint kind"),
    ],
)  # fmt: skip
def test_an_invalid_or_unsupported_spec_is_refused_naming_the_problem(make, says):
    with pytest.raises(Hf2qError) as e:
        make().validate()
    assert says in str(e.value)


def test_generation_options_make_the_spec_and_refuse_two_at_once():
    assert ConstraintSpec.from_options(json_schema='{"type": "integer"}') == ConstraintSpec(
        "json_schema", '{"type":"integer"}'
    )
    assert ConstraintSpec.from_options(json_object=True) == ConstraintSpec("json_object")
    assert ConstraintSpec.from_options(grammar='start: "x"') == ConstraintSpec("grammar", 'start: "x"')
    assert ConstraintSpec.from_options() is None
    with pytest.raises(Hf2qError, match="not regex and grammar"):
        ConstraintSpec.from_options(regex="a", grammar="b")
    with pytest.raises(Hf2qError, match="regex must be a string"):
        ConstraintSpec.from_options(regex=5)
    with pytest.raises(Hf2qError, match="unsupported schema feature"):
        make_config(json_schema={"not": {}})


# -- the generation loop under a constraint ------------------------------------------------
#: A prompt whose context holds JSON the n-gram proposer can copy drafts from.
SEEDED = '{"name": "ab", "age": 3, "tags": ["x"]}\nQ: '


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "options",
    [dict(method="baseline"), dict(method="ngram", k=4, adaptive=False, memory=False), dict(method="ngram")],
    ids=["plain", "ngram-fixed", "ngram-adaptive"],
)
def test_the_loop_under_a_schema_equals_plain_constrained_decoding(seed, options):
    target = tiny_target("llama", seed=seed, scale=2.0, tokenizer=True)
    want = constrained_greedy(target, ConstraintSpec.json_schema(PERSON), ids(SEEDED), 120)
    got = hf2q_py.generate(target, ids(SEEDED), max_tokens=120, json_schema=PERSON, **options)
    assert got.tokens == want
    jsonschema.validate(json.loads(got.text), PERSON)
    if options["method"] == "ngram":
        assert got.stats.drafted > 0, "speculation should still draft under a schema"


def test_batched_rows_under_schemas_equal_their_solo_generations():
    target = tiny_target("llama", seed=1, scale=2.0, tokenizer=True)
    prompts = [ids(SEEDED), ids("Q: "), ids('{"tags": ["y", "z"]}\nA: ')]
    options = dict(method="ngram", k=4, adaptive=False, memory=False, json_schema=PERSON)
    want = [hf2q_py.generate(target, p, max_tokens=100, **options).tokens for p in prompts]
    got = hf2q_py.batch_generate(target, prompts, max_tokens=100, **options)
    assert [g.tokens for g in got] == want


@pytest.mark.parametrize("temperature", [0.7, 1.2])
def test_sampling_under_a_schema_always_gives_valid_json(temperature):
    target = tiny_target("llama", seed=2, scale=2.0, tokenizer=True)
    for seed in range(3):
        r = hf2q_py.generate(target, ids(SEEDED), max_tokens=150, json_schema=PERSON, method="ngram",
                             temperature=temperature, seed=seed)  # fmt: skip
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(r.text), PERSON)
        else:  # the budget ran out inside the document: what there is is a valid prefix
            assert r.finish_reason == "length" and ConstraintSpec.json_schema(PERSON).build(target).plan(
                r.tokens
            )[0] == len(r.tokens)


def test_a_regex_constrains_the_whole_answer():
    target = tiny_target("llama", seed=0, scale=2.0, tokenizer=True)
    r = hf2q_py.generate(target, ids("Code: "), max_tokens=30, regex=r"[A-Z]{3}-[0-9]{2,4}")
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", r.text), r.text


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--json-schema", "{oops"], "--json-schema: not valid JSON"),
        (["--json-schema", "/no/such/schema.json"], "cannot read --json-schema file"),
        (["--json-schema", '{"type": "object", "not": {}}'], "unsupported schema feature(s): not"),
        (["--regex", "[a-"], "invalid regular expression"),
    ],
)
def test_bad_constraint_flags_are_one_line_errors_before_the_model_loads(capsys, no_model_load, flags, says):
    assert_one_line_error(cli(capsys, "generate", "--prompt", "hi", *flags), says)


def test_a_schema_file_is_read_by_the_flag(tmp_path, capsys, no_model_load):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps({"type": "object", "dependentRequired": {"a": ["b"]}}))
    assert_one_line_error(
        cli(capsys, "generate", "--prompt", "hi", "--json-schema", str(path)), "dependentRequired"
    )
