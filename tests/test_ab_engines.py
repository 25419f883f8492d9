"""Other engines in ``hf2q-py ab``: mlx-lm's greedy decoding and llama.cpp
(llama-cpp-python, when installed) on the same weights and ids, compared with
hf2q-py's plain greedy decoding under a bound that includes the measured
difference between the engines' logits."""

import importlib.util
import json
import subprocess
import sys

import mlx.core as mx
import pytest
from helpers import assert_one_line_error, cli, reference_greedy
from models import random_prompt, tiny_target

import hf2q_py
from hf2q_py.errors import Hf2qError
from hf2q_py.tools.ab import baseline_trace, engine_difference, logit_difference, prompt_cases, run_ab
from hf2q_py.tools.engines import PROMPT_ROWS, EngineOutput, MlxLmEngine, check_engine

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
needs_llama_cpp = pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed")


@pytest.mark.parametrize("arch", ["llama", "gemma4_text", "qwen3_next"])
def test_mlx_lm_greedy_decoding_agrees_with_plain_decoding(arch):
    target = tiny_target(arch, scale=2.0)
    report = run_ab(target, prompt_cases([("p", random_prompt(12))], 40), engines=["mlx-lm"])
    (r,) = report.results
    assert (r.kind, r.method) == ("engine", "mlx-lm")
    assert r.verdict in ("identical", "near-tie"), r
    assert r.logit_diff < 1e-4 and r.bound == pytest.approx(report.noise.bound + 2 * r.logit_diff)


def test_the_mlx_lm_engine_is_mlx_lm_generate_step_and_keeps_each_step_s_logits():
    target = tiny_target("llama", scale=2.0)
    prompt = random_prompt(10)
    free = reference_greedy(target.model, prompt, 30)
    target.eos_token_ids = {free[6]}
    out = MlxLmEngine(target).generate(prompt, 30)
    assert out.tokens == free[: free.index(free[6])] and out.ended
    assert out.logits.shape == (len(out.tokens) + 1, 128)  # the ending step's row too
    assert [int(mx.argmax(r).item()) for r in out.logits] == [*out.tokens, free[6]]


def test_logit_difference_ignores_a_common_shift_and_measures_the_rest():
    ours = mx.random.normal((3, 50), key=mx.random.key(0))
    assert logit_difference([(ours, ours + 7.0)]) == pytest.approx(0.0, abs=1e-5)
    top = mx.argmax(ours, axis=-1)
    bumped = ours + 7.0 + 0.5 * (mx.arange(50)[None] == top[:, None])  # each row's leader 0.5 higher
    assert logit_difference([(ours, bumped)]) == pytest.approx(0.25, abs=1e-5)  # half the range
    tail = mx.argmin(ours, axis=-1)  # far below the leaders: never a greedy choice
    low = ours - 3.0 * (mx.arange(50)[None] == tail[:, None])
    assert logit_difference([(ours, low)]) == pytest.approx(0.0, abs=1e-6)


class SkewedEngine:
    """Plain decoding's tokens with the token at ``at`` replaced by the runner-up,
    and logits that differ from plain decoding's by ``skew`` on each earlier
    step's leading token: a known logit difference between the engines."""

    name = "skewed"

    def __init__(self, target, at: int, skew: float):
        self.target, self.at, self.skew = target, at, skew

    def generate(self, prompt, max_tokens):
        trace = baseline_trace(self.target, prompt, max_tokens)
        tokens = list(trace.tokens)
        tokens[self.at] = trace.tops[self.at][1][0]
        rows = mx.stack(trace.rows)
        bump = mx.arange(rows.shape[-1])[None] == mx.argmax(rows, axis=-1)[:, None]
        return EngineOutput(tokens, False, rows + 3.0 + self.skew * bump)

    def close(self):
        pass


@pytest.mark.parametrize("factor, verdict", [(1.5, "near-tie"), (0.5, "MISMATCH")])
def test_an_engine_s_divergence_is_judged_by_the_measured_difference(factor, verdict):
    target = tiny_target("llama", scale=2.0)
    prompt = random_prompt(10)
    trace = baseline_trace(target, prompt, 20)
    at = 12
    gap = trace.tops[at][0][1] - trace.tops[at][1][1]
    assert gap > 1e-2
    report = run_ab(
        target, prompt_cases([("p", prompt)], 20), engines=[SkewedEngine(target, at, factor * gap)]
    )
    (r,) = report.results
    assert r.logit_diff == pytest.approx(factor * gap / 2, rel=1e-4)
    assert (r.verdict, r.divergence.position, r.divergence.method_rank) == (verdict, at, 2)


@pytest.fixture
def tiny_model_file(tmp_path, monkeypatch):
    """A model path whose load gives a tiny llama with a character tokenizer."""
    monkeypatch.setattr(
        hf2q_py,
        "load",
        lambda source=None, *, dtype="auto", **kw: tiny_target("llama", scale=2.0, tokenizer=True),
    )
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    return str(path)


def test_cli_methods_mlx_lm(capsys, tiny_model_file):
    rc, out, err = cli(capsys, "ab", "--model", tiny_model_file, "--methods", "ngram,mlx-lm", "--prompt",
                       "Hello", "--max-tokens", "16", "--json")  # fmt: skip
    assert rc == 0, err
    results = json.loads(out)["results"]
    assert [(r["method"], r["kind"], r["verdict"]) for r in results] == [
        ("ngram", "method", "identical"),
        ("mlx-lm", "engine", "identical"),
    ]


@pytest.mark.parametrize(
    "methods, words",
    [
        ("mlx-lm:k=2", ["engine mlx-lm takes no options"]),
        ("llama.cpp:n=1", ["engine llama.cpp takes no options"]),
        ("mlx_lm", ["unknown method 'mlx_lm'", "mlx-lm, llama.cpp"]),
    ],
)
def test_engine_specs_are_checked_before_loading(capsys, no_model_load, methods, words):
    assert_one_line_error(cli(capsys, "ab", "--methods", methods, "--prompt", "hi"), *words)


def test_llama_cpp_without_llama_cpp_python_is_a_one_line_refusal(
    tmp_path, capsys, no_model_load, monkeypatch
):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert_one_line_error(
        cli(capsys, "ab", "--model", str(model), "--methods", "llama.cpp", "--prompt", "hi"),
        "llama-cpp-python",
    )


def test_llama_cpp_on_a_model_that_is_not_gguf_is_a_one_line_refusal(tmp_path, capsys, no_model_load):
    model = tmp_path / "weights.bin"
    model.write_bytes(b"not a gguf file")
    assert_one_line_error(
        cli(capsys, "ab", "--model", str(model), "--methods", "llama.cpp", "--prompt", "hi"),
        "GGUF files only",
    )
    with pytest.raises(Hf2qError, match="GGUF files only"):
        check_engine("llama.cpp", str(tmp_path))  # a model folder


@needs_llama_cpp
def test_llama_cpp_on_the_same_gguf_agrees(tmp_path, capsys):
    from gguf_export import Q, export

    path = tmp_path / "tiny.gguf"
    export(path, "llama", Q.F32)
    rc, out, err = cli(capsys, "ab", "--model", str(path), "--dtype", "float32", "--methods", "llama.cpp,mlx-lm",
                       "--prompt", "the quick brown fox", "--max-tokens", "24", "--json")  # fmt: skip
    assert rc == 0, err
    llama, mlx_lm = json.loads(out)["results"]
    assert llama["method"] == "llama.cpp" and llama["verdict"] in ("identical", "near-tie")
    # float32 weights, llama.cpp's default float16 KV cache: small, measured, not zero
    assert 0 < llama["logit_diff"] < 1e-2 and llama["bound"] > 2 * llama["logit_diff"]
    assert mlx_lm["logit_diff"] < 1e-4


@pytest.mark.slow
def test_mlx_lm_on_the_builtin_model_agrees(tmp_path):
    rec = tmp_path / "rec.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "hf2q_py", "ab", "--methods", "mlx-lm", "--prompt", "Name three colours.",
         "--max-tokens", "16", "--record", str(rec), "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (r,) = json.loads(proc.stdout)["results"]
    assert r["verdict"] in ("identical", "near-tie") and r["logit_diff"] < 1e-3
    (line,) = [json.loads(x) for x in rec.read_text().splitlines()]
    assert line["model"].endswith(".gguf") and len(line["tokens"]) == r["baseline_tokens"]


@pytest.mark.parametrize("prompt_len", [40, 600])  # 600: past one prefill chunk (512)
def test_prompt_logits_are_compared_position_for_position(prompt_len):
    """An engine returning hf2q-py's own batched logits for the last prompt
    positions differs from them by nothing; shifted by one position, by much."""
    target = tiny_target("llama", scale=2.0)
    ids = random_prompt(prompt_len)
    trace = baseline_trace(target, ids, 4)
    rows = target.model(mx.array([ids]))[0, -1 - PROMPT_ROWS : -1]  # positions len-128 .. len-2
    same = EngineOutput(list(trace.tokens), False, prompt_logits=rows)
    assert engine_difference(target, ids, trace, same) < 1e-4
    shifted = EngineOutput(
        list(trace.tokens), False, prompt_logits=target.model(mx.array([ids]))[0, -2 - PROMPT_ROWS : -2]
    )
    assert engine_difference(target, ids, trace, shifted) > 0.1


@pytest.mark.slow
@needs_llama_cpp
def test_llama_cpp_on_the_builtin_gguf_differs_at_most_at_near_ties():
    """llama.cpp rounds activations to 8 bits for the Q4_1 weights that hf2q-py
    dequantizes to float32: the measured difference is tenths of a logit."""
    proc = subprocess.run(
        [sys.executable, "-m", "hf2q_py", "ab", "--methods", "llama.cpp", "--prompt", "Name three colours.",
         "--max-tokens", "32", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (r,) = json.loads(proc.stdout)["results"]
    assert r["verdict"] in ("identical", "near-tie") and 0.01 < r["logit_diff"] < 2.0
