"""Reference files: ``hf2q-py ab --record`` writes hf2q-py's greedy outputs,
``--reference`` checks another engine's outputs against hf2q-py's plain greedy
decoding (token by token, or byte by byte for text), and bad files are one-line
errors naming the file and line."""

import json

import pytest
from helpers import assert_one_line_error, cli
from models import VOCAB, tiny_target

import hf2q_py
from hf2q_py.errors import Hf2qError
from hf2q_py.tools.ab import baseline_trace, reference_case, reference_tokens
from hf2q_py.tools.ab_reference import parse_reference
from hf2q_py.tools.engines import MlxLmEngine

PROMPTS = ["Hello there, how are you?", "def add(a, b):"]


def model_target():
    """The model every in-process CLI run here loads: a tiny llama with a character tokenizer."""
    return tiny_target("llama", scale=2.0, tokenizer=True)


@pytest.fixture
def model(tmp_path, monkeypatch):
    """A model path whose load gives ``model_target()`` (the file itself is never read)."""
    monkeypatch.setattr(hf2q_py, "load", lambda source=None, *, dtype="auto", **kw: model_target())
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    return str(path)


def ab(capsys, model, *argv):
    """``hf2q-py ab --model MODEL ... --json``: (exit status, JSON output, stderr lines)."""
    rc, out, err = cli(capsys, "ab", "--model", model, *argv, "--json")
    return rc, (json.loads(out) if out.strip() else None), err


def record(capsys, model, path, max_tokens=24):
    rc, _, err = ab(capsys, model, *[a for p in PROMPTS for a in ("--prompt", p)], "--max-tokens",
                    str(max_tokens), "--record", str(path))  # fmt: skip
    assert rc == 0, err
    return [json.loads(line) for line in path.read_text().splitlines()]


def write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def widest_margin(case: dict, skip_last: bool = True) -> tuple[int, list]:
    """The output position where plain decoding's top-2 margin is largest, and its trace."""
    trace = baseline_trace(model_target(), case["prompt_ids"], len(case["tokens"]))
    n = len(case["tokens"]) - (1 if skip_last else 0)
    return max(range(n), key=lambda i: trace.tops[i][0][1] - trace.tops[i][1][1]), trace


def test_record_then_compare_is_identical(tmp_path, capsys, model):
    lines = record(capsys, model, tmp_path / "rec.jsonl")
    assert [line["prompt"] for line in lines] == PROMPTS
    for line in lines:
        assert line["engine"] == "hf2q-py" and line["model"] == "<in-memory>"
        assert line["tokens"] and line["text"] and line["prompt_ids"] and line["max_tokens"] == 24
        assert line["finish_reason"] in ("stop", "length")
    rc, out, err = ab(capsys, model, "--reference", str(tmp_path / "rec.jsonl"))
    assert rc == 0, err
    assert [r["verdict"] for r in out["results"]] == ["identical", "identical"]
    assert {r["kind"] for r in out["results"]} == {"reference"}
    assert out["counts"] == {"identical": 2, "near-tie": 0, "MISMATCH": 0}


def test_one_changed_token_where_the_margin_is_large_is_a_mismatch_there(tmp_path, capsys, model):
    lines = record(capsys, model, tmp_path / "rec.jsonl")
    case = lines[0]
    i, trace = widest_margin(case)
    assert trace.tops[i][0][1] - trace.tops[i][1][1] > 0.1
    case["tokens"][i] = trace.tops[i][1][0]  # plain decoding's runner-up there
    rc, out, err = ab(capsys, model, "--reference", write(tmp_path / "changed.jsonl", [case]))
    assert rc == 1, err
    (r,) = out["results"]
    d = r["divergence"]
    assert r["verdict"] == "MISMATCH" and d["position"] == i and d["method_rank"] == 2
    assert d["gap"] == pytest.approx(trace.tops[i][0][1] - trace.tops[i][1][1], rel=1e-5)
    assert d["gap"] > r["bound"] > 0


def test_one_changed_character_of_a_text_reference_names_its_byte_offset(tmp_path, capsys, model):
    lines = record(capsys, model, tmp_path / "rec.jsonl")
    case = lines[0]
    i, trace = widest_margin(case)
    text = case["text"]  # one character per token with this tokenizer
    wrong = "x" if text[i] != "x" else "y"
    offset = len(text[:i].encode("utf-8"))
    del case["tokens"]
    case["text"] = text[:i] + wrong + text[i + 1 :]
    path = write(tmp_path / "text.jsonl", [case])
    rc, out, err = ab(capsys, model, "--reference", path)
    assert rc == 1, err
    d = out["results"][0]["divergence"]
    assert out["results"][0]["verdict"] == "MISMATCH" and out["results"][0]["unit"] == "bytes"
    assert (d["byte_offset"], d["position"], d["method_token"]) == (offset, i, ord(wrong) - 32)
    assert f"byte {offset}" in d["context"] and repr(wrong)[1:-1] in d["context"]
    rc, table, _ = cli(capsys, "ab", "--model", model, "--reference", path)
    assert rc == 1 and f"(byte {offset})" in table and "MISMATCH" in table


def test_a_text_reference_that_ended_where_hf2q_py_goes_on_differs_at_its_end(tmp_path, capsys, model):
    lines = record(capsys, model, tmp_path / "rec.jsonl")
    case = next(line for line in lines if line["finish_reason"] == "length")
    end = len(case["text"].encode("utf-8"))
    for key in ("tokens", "max_tokens"):
        del case[key]
    case["finish_reason"] = "stop"
    rc, out, err = ab(capsys, model, "--reference", write(tmp_path / "ended.jsonl", [case]))
    d = out["results"][0]["divergence"]
    assert (d["byte_offset"], d["position"], d["method_token"]) == (end, 24, -1), err
    assert "<end>" not in d["context"]  # text shows the bytes: hf2q-py's go on, the reference's do not


def test_a_reference_recorded_by_mlx_lm_greedy_decoding_agrees(tmp_path, capsys, model):
    """The issue's target: another engine's file is identical (or a near-tie);
    one token of it changed is a MISMATCH at that position."""
    target = model_target()
    engine = MlxLmEngine(target)
    lines = []
    for p in PROMPTS:
        ids = target.tokenizer.encode(p)
        out = engine.generate(ids, 24)
        text = target.tokenizer.decode(out.tokens)
        lines.append(
            {"prompt_ids": ids, "tokens": out.tokens, "text": text, "engine": "mlx-lm", "max_tokens": 24}
        )
    rc, out, err = ab(capsys, model, "--reference", write(tmp_path / "mlx.jsonl", lines))
    assert rc == 0, err
    assert {r["verdict"] for r in out["results"]} <= {"identical", "near-tie"}
    assert out["results"][0]["method"].startswith("mlx-lm (")
    i, trace = widest_margin(lines[1])
    lines[1]["tokens"][i] = (lines[1]["tokens"][i] + 1) % (VOCAB - 1)
    rc, out, err = ab(capsys, model, "--reference", write(tmp_path / "mlx-changed.jsonl", lines))
    assert rc == 1, err
    assert [r["verdict"] for r in out["results"]][1] == "MISMATCH"
    assert out["results"][1]["divergence"]["position"] == i


def test_record_with_a_reference_writes_hf2q_py_outputs_of_its_prompts(tmp_path, capsys, model):
    ids = model_target().tokenizer.encode("abc")
    ref = write(tmp_path / "ref.jsonl", [{"prompt_ids": ids, "text": "zzz", "engine": "other"}])
    rc, out, _ = ab(capsys, model, "--reference", ref, "--record", str(tmp_path / "ours.jsonl"))
    (line,) = [json.loads(x) for x in (tmp_path / "ours.jsonl").read_text().splitlines()]
    assert line["prompt_ids"] == ids and "prompt" not in line and line["engine"] == "hf2q-py"
    assert rc == out["counts"]["MISMATCH"] == 1  # "zzz" is not what the model writes


def test_reference_tokens_end_where_the_file_says():
    target = model_target()
    eos = VOCAB - 1

    def case(**fields):
        return reference_tokens(target, parse_reference(json.dumps({"prompt": "a", **fields}), "f:1"))

    assert case(tokens=[5, 6, eos]) == ([5, 6], True)  # a final end-of-sequence id: it ended
    assert case(tokens=[5, 6]) == ([5, 6], None)  # not known
    assert case(tokens=[5, 6], max_tokens=4) == ([5, 6], True)  # short of its length: it ended
    assert case(tokens=[5, 6], max_tokens=2) == ([5, 6], False)
    assert case(tokens=[5, 6], finish_reason="length") == ([5, 6], False)
    assert case(tokens=[]) == ([], True)
    assert case(text="hi") == (None, None)
    ref = parse_reference(json.dumps({"prompt": "a", "tokens": [5, 6, eos]}), "f:1")
    assert reference_case(target, ref).max_tokens == 3  # one step past, to see hf2q-py end too


BAD_LINES = [
    ('{"prompt": "hi", "tokens": [1, 2]', "not valid JSON"),
    ('["hi", [1, 2]]', "expected a JSON object"),
    ('{"prompt": "hi"}', "neither 'tokens' nor 'text'"),
    ('{"tokens": [1, 2]}', "give the prompt"),
    ('{"prompt": "hi", "tokens": [1, "2"]}', "not a token id"),
    ('{"prompt": "hi", "tokens": [1, -2]}', "not a token id"),
    ('{"prompt": "hi", "tokens": [true]}', "not a token id"),
    ('{"prompt": "hi", "tokens": 3}', "must be a list"),
    ('{"prompt": "hi", "text": 3}', "text must be a string"),
    ('{"prompt": "hi", "text": "\\ud800"}', "not valid Unicode"),
    ('{"prompt": " ", "text": "x"}', "the prompt is empty"),
    ('{"prompt_ids": [], "text": "x"}', "prompt_ids is empty"),
    ('{"prompt": "hi", "tokens": [1, 2], "max_tokens": 1}', "more than max_tokens"),
    ('{"prompt": "hi", "tokens": [1], "max_tokens": 0}', "max_tokens must be"),
    ('{"prompt": "hi", "tokens": [1], "finish_reason": "eos"}', "finish_reason"),
    ('{"prompt": "hi", "tokens": [1], "chat_template": "no"}', "chat_template"),
    ('{"prompt": "hi", "token": [1]}', "unknown field(s) token"),
]


@pytest.mark.parametrize("line, words", BAD_LINES)
def test_a_bad_line_is_a_one_line_error_naming_the_file_and_line(
    tmp_path, capsys, no_model_load, line, words
):
    path = tmp_path / "ref.jsonl"
    path.write_text(json.dumps({"prompt": "fine", "tokens": [1, 2]}) + "\n\n" + line + "\n")
    assert_one_line_error(cli(capsys, "ab", "--reference", str(path)), f"{path}:3", words)


def test_empty_and_missing_reference_files_are_one_line_errors(tmp_path, capsys, no_model_load):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    assert_one_line_error(cli(capsys, "ab", "--reference", str(empty)), str(empty), "holds no cases")
    missing = tmp_path / "missing.jsonl"
    assert_one_line_error(cli(capsys, "ab", "--reference", str(missing)), str(missing), "cannot read")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "caf\xe9", "text": "x"}\n'.encode("latin-1"))
    assert_one_line_error(cli(capsys, "ab", "--reference", str(latin)), str(latin), "not UTF-8")


@pytest.mark.parametrize("field", ["tokens", "prompt_ids"])
def test_ids_outside_the_vocabulary_are_one_line_errors_naming_the_line(tmp_path, capsys, model, field):
    case = {"prompt_ids": [1, 2], "tokens": [3, 4], field: [5, VOCAB]}
    path = write(tmp_path / "ref.jsonl", [{"prompt": "ok", "tokens": [1]}, case])
    assert_one_line_error(
        cli(capsys, "ab", "--model", model, "--reference", path),
        f"{path}:2",
        field,
        "outside the model's vocabulary",
    )


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--prompt", "hi"], ["drop --prompt"]),
        (["--max-tokens", "4"], ["drop --max-tokens"]),
        (["--no-chat-template"], ["drop --no-chat-template"]),
        (["--reference-bound", "-1"], ["--reference-bound"]),
        (["--record", "{ref}"], ["overwrite the --reference file"]),
        (["--record", "{dir}/no/such/folder/r.jsonl"], ["--record file"]),
    ],
)
def test_reference_options_that_conflict_are_refused_before_loading(
    tmp_path, capsys, no_model_load, argv, words
):
    ref = write(tmp_path / "ref.jsonl", [{"prompt": "hi", "tokens": [1]}])
    argv = [a.format(ref=ref, dir=tmp_path) for a in argv]
    assert_one_line_error(cli(capsys, "ab", "--reference", ref, *argv), *words)


def test_a_text_reference_needs_a_tokenizer():
    target = tiny_target("llama")
    ref = parse_reference(json.dumps({"prompt_ids": [1, 2], "text": "hi"}), "f.jsonl:7")
    with pytest.raises(Hf2qError, match="f.jsonl:7: this model has no tokenizer"):
        reference_case(target, ref)
