"""The command line: JSON output, streaming, one-line errors for bad input,
Ctrl-C at any point, and the options it passes on to every model it loads."""

import json
import subprocess
import sys

import pytest
from helpers import cli
from models import random_prompt, tiny_target

import hf2q_py


def run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "hf2q_py", *args], capture_output=True, text=True, timeout=timeout
    )


def assert_one_line_error(proc, *words):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for w in words:
        assert w in lines[0]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--prompt", "hi", "--max-tokens", "0"], ["max-tokens"]),
        (["--prompt", "   "], ["empty"]),
        ([], ["prompt"]),
        (["--prompt", "hi", "--model", "/no/such/model.gguf"], ["no such file"]),
        (["--prompt", "hi", "--method", "magic"], ["unknown method"]),
        (["--prompt", "hi", "--k", "0"], ["--k"]),
        (["--prompt", "hi", "--method", "ngram", "--ngram-min", "0"], ["ngram-min"]),
        (["--prompt", "hi", "--dtype", "int3"], ["dtype"]),
        (["--prompt-file", "/no/such/prompt.txt"], ["prompt file"]),
    ],
)
def test_bad_input_gives_a_one_line_error(args, words):
    assert_one_line_error(run("generate", *args), *words)


def test_version_is_the_packages():
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"hf2q-py {hf2q_py.__version__}"


def test_corrupt_and_unknown_model_files(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"\x00" * 100)
    assert_one_line_error(run("generate", "--prompt", "hi", "--model", str(bad)), "bad.gguf")
    import gguf
    import numpy as np

    odd = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(odd), "rwkv6")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_line_error(run("generate", "--prompt", "hi", "--model", str(odd)), "rwkv6", "not supported")


@pytest.mark.slow
def test_json_output_on_the_builtin_model_names_the_default_speculative_method():
    proc = run("generate", "--prompt", "What is 2+2?", "--max-tokens", "6", "--json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no progress bars under --json
    out = json.loads(proc.stdout)
    assert out["stats"]["method"] == "ngram"
    assert set(out) >= {"text", "tokens", "prompt_tokens", "stats"}
    assert len(out["tokens"]) <= 6 and out["prompt_tokens"] > 0
    for key in (
        "generated_tokens",
        "prefill_seconds",
        "decode_seconds",
        "tokens_per_second",
        "rounds",
        "drafted",
        "accepted",
        "acceptance_rate",
        "mean_accepted_length",
    ):
        assert key in out["stats"]


@pytest.mark.slow
def test_streaming_output_and_summary(tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Say hello.")
    proc = run("generate", "--prompt-file", str(prompt), "--max-tokens", "5", "--profile")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "tok/s" in proc.stderr.splitlines()[-1]


def test_ctrl_c_is_seen_between_short_prefill_chunks(monkeypatch, capsys):
    from hf2q_py import target as target_module

    assert target_module.PREFILL_CHUNK <= 512
    target = tiny_target("llama")
    widths = []
    real = target_module.Runtime.forward

    def spy(self, tokens, **kw):
        widths.append(len(tokens))
        return real(self, tokens, **kw)

    monkeypatch.setattr(target_module.Runtime, "forward", spy)
    target.runtime().prefill(random_prompt(1100), logits="none")
    assert max(widths) <= target_module.PREFILL_CHUNK and sum(widths) == 1100

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf2q_py, "load", interrupted)
    rc, _, err = cli(capsys, "generate", "--prompt", "hi")
    assert rc == 130 and err == ["hf2q-py: interrupted"]


def test_the_draft_model_loads_with_the_requested_dtype(tmp_path, capsys, monkeypatch):
    loads = []

    def fake_load(source=None, *, dtype="auto", **_):
        loads.append(dtype)
        return tiny_target("llama", seed=len(loads), tokenizer=True)

    monkeypatch.setattr(hf2q_py, "load", fake_load)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    rc, out, err = cli(
        capsys,
        "generate",
        "--prompt",
        "ab",
        "--model",
        str(model),
        "--method",
        "draft",
        "--draft-model",
        str(model),
        "--dtype",
        "float16",
        "--max-tokens",
        "3",
        "--json",
    )
    assert rc == 0, err
    assert loads == ["float16", "float16"]
