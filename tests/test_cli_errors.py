"""The command line's answer to bad input, in process: status 2 and one line on
stderr, before any model loads and with no file written, never a traceback;
the benchmark scripts answer bad input the same way."""

import json

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_one_line_error, cli
from models import tiny_model

from hf2q_py.draft_length import MAX_K


@pytest.fixture
def not_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    return str(path)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt-file", "{f}"],
        ["ab", "--prompts", "{f}"],
        ["ab", "--prompt-file", "{f}"],
        ["train-dflash", "--out", "{d}", "--prompts", "{f}"],
    ],
)
def test_prompt_files_that_are_not_utf8_are_one_line_errors(tmp_path, capsys, no_model_load, not_utf8, argv):
    argv = [a.format(f=not_utf8, d=tmp_path / "d") for a in argv]
    assert_one_line_error(cli(capsys, *argv), "not UTF-8")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["generate", "--prompt", "hi", "--temp", "-1"], ["temperature"]),
        (["generate", "--prompt", "hi", "--top-p", "2"], ["top-p"]),
        (
            ["generate", "--prompt", "hi", "--method", "ngram", "--ngram-min", "4", "--ngram-max", "2"],
            ["ngram-max"],
        ),
        (["generate", "--prompt", "hi", "--stop", ""], ["stop"]),
        (
            ["generate", "--prompt", "hi", "--method", "layerskip", "--skip-layers", "middle:0"],
            ["skip recipe"],
        ),
        (
            ["generate", "--prompt", "hi", "--method", "dflash", "--drafter", "/no/such/drafter"],
            ["no such folder"],
        ),
        (["generate", "--prompt", "hi", "--model", "/no/such/folder"], ["no such file or folder"]),
    ],
)
def test_option_errors_come_before_the_model_loads(capsys, no_model_load, argv, words):
    assert_one_line_error(cli(capsys, *argv), *words)


@pytest.mark.parametrize(
    "methods, words",
    [
        ("ngram:temperature=0.5", ["unknown method option 'temperature'", "--temp"]),
        ("ngram:k=0", ["k (draft length)"]),
        ("ngram:k=x", ["bad value for k"]),
        ("ngram:ngram_max=99", ["ngram-max"]),
        ("magic", ["unknown method"]),
        ("draft", ["draft model"]),
        ("layerskip:skip_layers=early:x", ["skip recipe"]),
    ],
)
def test_bench_method_options_are_checked_before_loading(capsys, no_model_load, methods, words):
    assert_one_line_error(cli(capsys, "bench", "--methods", methods), *words)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["ab", "--methods", "ngram,magic"], ["unknown method 'magic'"]),
        (["ab", "--methods", ","], ["--methods is empty"]),
        (["ab", "--methods", "draft"], ["needs a draft model", "--draft-model"]),
        (["ab", "--methods", "dflash"], ["needs a drafter", "--drafter"]),
        (["ab", "--k", str(MAX_K + 1)], ["k (draft length)"]),
        (["ab", "--prompt", " "], ["empty"]),
        (["ab", "--methods", "layerskip", "--skip-layers", "1,x"], ["bad skip layers"]),
        (["ab", "--methods", "dflash", "--drafter", "/no/such/folder"], ["no such folder"]),
        (["bench", "--temp", "-1"], ["temperature"]),
        (["bench", "--only", "no-such-workload"], ["no workload"]),
        (["bench", "--methods", "baseline"], ["no method"]),
        (["bench", "--dtype", "int3"], ["dtype"]),
        (
            ["generate", "--prompt", "hi", "--method", "draft", "--draft-model", "/no/such.gguf"],
            ["no such file"],
        ),
    ],
)
def test_bench_and_ab_option_errors_are_one_line_before_loading(capsys, no_model_load, argv, words):
    assert_one_line_error(cli(capsys, *argv), *words)


@pytest.mark.parametrize(
    "argv",
    [
        ["ab", "--prompt", "hi", "--markdown", "{t}/no/such/folder/ab.md"],
        ["bench", "--markdown", "{t}/no/such/folder/b.md"],
        ["bench", "--chart", "{t}"],
    ],
)
def test_unwritable_outputs_are_refused_before_the_run(tmp_path, capsys, no_model_load, argv):
    argv = [a.format(t=tmp_path) for a in argv]
    assert_one_line_error(cli(capsys, *argv), "file")
    assert list(tmp_path.iterdir()) == []


def test_an_output_check_leaves_no_file_behind(tmp_path):
    from hf2q_py.tools.files import check_writable

    check_writable(tmp_path / "new.md")
    assert not (tmp_path / "new.md").exists()
    (tmp_path / "old.md").write_text("kept")
    check_writable(tmp_path / "old.md")
    assert (tmp_path / "old.md").read_text() == "kept"


def test_a_model_folder_without_tokenizer_files_is_a_one_line_error(tmp_path, capsys):
    from mlx.utils import tree_flatten
    from models import CONFIGS

    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIGS["llama"]))
    mx.save_safetensors(
        str(folder / "model.safetensors"), dict(tree_flatten(tiny_model("llama").parameters()))
    )
    assert_one_line_error(
        cli(capsys, "generate", "--prompt", "hi", "--model", str(folder)), "no tokenizer files"
    )


def test_a_gguf_with_missing_tensors_is_a_one_line_error(tmp_path, capsys):
    import gguf

    path = tmp_path / "partial.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(32)
    w.add_head_count(4)
    w.add_feed_forward_length(64)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_line_error(cli(capsys, "generate", "--prompt", "hi", "--model", str(path)), "GGUF")


def test_benchmark_scripts_end_bad_input_with_one_line_and_status_2():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_draft_length.py"
    for args, message in (
        (["--results", "/nonexistent/dir/x.json"], "cannot write --results file /nonexistent/dir/x.json"),
        (["--fixed-ks", "2,0"], "--fixed-ks and --k must be draft lengths in [1, 256]"),
        (["--k", "300"], "--fixed-ks and --k must be draft lengths in [1, 256]"),
        (["--streams", "/nonexistent/s.json"], "cannot read recorded streams /nonexistent/s.json"),
        (["--record", "builtin", "builtin"], "--record needs --streams"),
        (["--seeds", "0"], "--seeds must be at least 1"),
    ):
        done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)
        assert done.returncode == 2
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("bench_draft_length.py: error: ") and message in last
        assert "Traceback" not in done.stderr
