"""The Python API's answer to wrongly typed, non-finite or malformed input: an
Hf2qError naming the problem, never a crash or a NaN (a prompt that is not
valid Unicode is refused on the command line too)."""

import pytest
from helpers import assert_one_line_error, cli
from models import tiny_target

import hf2q_py
from hf2q_py.errors import Hf2qError


@pytest.mark.parametrize(
    "opts",
    [
        dict(temperature="0.5"),
        dict(k="3"),
        dict(max_tokens="5"),
        dict(stop=5),
        dict(stop=[1]),
        dict(top_k=1.5),
        dict(seed="x"),
        dict(adaptive="no"),
        dict(ngram_max=2.0),
        dict(chat_template="yes"),
        dict(skip_layers=[1.5]),
        dict(method="layerskip", skip_layers=5),
        dict(draft=5),
        dict(k=True),
        dict(repetition_penalty=None),
    ],
)
def test_wrongly_typed_python_options_raise_hf2q_error(opts):
    with pytest.raises(Hf2qError):
        hf2q_py.generate(tiny_target("llama"), [1, 2, 3], **{"max_tokens": 2, **opts})


def test_wrongly_typed_prompts_and_configs_raise_hf2q_error():
    target = tiny_target("llama")
    for prompt in (None, 5, b"bytes", [1, "2"], [1.0], [True]):
        with pytest.raises(Hf2qError):
            hf2q_py.generate(target, prompt, max_tokens=2, method="baseline")
    with pytest.raises(Hf2qError, match="GenerationConfig"):
        list(hf2q_py.stream_generate(target, [1, 2], config={"max_tokens": 2}))


@pytest.mark.parametrize(
    "opts",
    [
        dict(temperature=float("inf")),
        dict(temperature=float("nan")),
        dict(top_p=float("nan")),
        dict(repetition_penalty=float("inf")),
        dict(min_p=float("nan")),
        dict(draft_p_min=float("nan")),
    ],
)
def test_non_finite_numbers_are_refused(opts):
    with pytest.raises(Hf2qError, match="finite"):
        hf2q_py.generate(tiny_target("llama"), [1, 2], max_tokens=2, **opts)


def test_prompts_with_lone_surrogates_are_refused(tmp_path, capsys, no_model_load):
    target = tiny_target("llama", tokenizer=True)
    with pytest.raises(Hf2qError, match="lone surrogate"):
        hf2q_py.generate(target, "ab\ud800c", max_tokens=2, method="baseline")
    assert_one_line_error(cli(capsys, "generate", "--prompt", "x\udcff"), "lone surrogate")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "bad \\ud800 escape"}\n')
    assert_one_line_error(cli(capsys, "ab", "--prompts", str(jsonl)), "lone surrogate")
    assert_one_line_error(
        cli(
            capsys,
            "train-dflash",
            "--out",
            str(tmp_path / "d"),
            "--prompts",
            str(jsonl),
            "--samples",
            "1",
            "--holdout",
            "0",
        ),
        "lone surrogate",
    )
