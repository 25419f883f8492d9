"""Property: whatever flags and values it is given, the CLI exits 0, or exits 2
with one line on stderr and no traceback (``ab`` may also exit 1 with a
MISMATCH table).

The CLI runs in-process (a crash would take the test run down with it, so
signals are caught too). Most generated command lines fail fast at option
checking; the few that pass load the built-in model once (memoized) and run
with budgets of a few tokens. Dtypes that are slow on a CPU (keep, float16)
and unbounded budgets are left out so the test stays within about a minute.
"""

from __future__ import annotations

import contextlib
import io
import json
from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf2q_py
from hf2q_py.tools.cli import main
from hf2q_py.loaders import load as real_load

pytestmark = pytest.mark.slow

INTS = ["0", "1", "2", "3", "-1", "257", "99999999999999999999", "x", "1.5", ""]
SMALL = ["0", "1", "2", "-1", "x", ""]  # budgets: valid ones stay tiny
FLOATS = ["0", "0.5", "1", "-1", "nan", "inf", "-inf", "1e-40", "1e308", "x", "2"]
TEXTS = ["hi", "", " ", "a\udcff b", "def f(x):\n    return x", "∑ unicode ✓", "\x00"]
SKIPS = ["auto", "alternate", "early:4", "early:x", "middle:6", "middle:0", "3,5", "1,x", "99", ""]
DTYPES = ["auto", "float32", "fp32", "int3", ""]
GENERATE_FLAGS = ["--json", "--profile", "--no-chat-template", "--fixed-k", "--adaptive", "--no-openblas"]


@cache
def _cached_load(source: str | None, dtype):
    return real_load(source, dtype=dtype)


def _load(source=None, *, dtype="auto", **_):
    """The real loader, memoized: the built-in model loads once per session."""
    return _cached_load(None if source in (None, "") else str(source), dtype)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Paths the fuzzer chooses from: good, missing, corrupt, not UTF-8, unwritable."""
    from hf2q_py.loaders.builtin import builtin_model_path

    root = tmp_path_factory.mktemp("fuzz")
    (root / "prompt.txt").write_text("Say hi.")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "prompts.jsonl").write_text(
        "\n".join(json.dumps(p) for p in ["Say hi.", {"prompt": "Count to 3."}, "x"])
    )
    (root / "bad.jsonl").write_text('{"prompt": 5}\nnot json\n')
    (root / "corrupt.gguf").write_bytes(b"GGUF" + b"\x00" * 60)
    (root / "empty-folder").mkdir()
    (root / "drafter").mkdir()
    (root / "drafter" / "config.json").write_text('{"dflash_config": [], "hidden_size": "big"}')
    model_folder = root / "a-model"
    model_folder.mkdir()
    (model_folder / "config.json").write_text("{}")
    return {
        "prompt": [str(root / "prompt.txt"), str(root / "latin1.txt"), str(root / "missing.txt"), str(root)],
        "prompts": [
            str(root / "prompts.jsonl"),
            str(root / "bad.jsonl"),
            str(root / "latin1.txt"),
            "/no/such",
        ],
        "model": [str(root / "corrupt.gguf"), str(root / "empty-folder"), "/no/such.gguf", "no/such-repo"],
        "draft": [str(builtin_model_path()), str(root / "corrupt.gguf"), "/no/such"],
        "drafter": [str(root / "drafter"), str(root / "empty-folder"), "/no/such"],
        "out": [str(root / "new.md"), "/no/such/folder/x.md", str(root)],
        "train_out": [str(model_folder), str(root / "prompt.txt"), "/proc/no-such/d"],
        "root": root,
    }


def flag(name: str, values) -> st.SearchStrategy[list[str]]:
    return st.sampled_from(values).map(lambda v: [name, v])


def command_lines(files) -> st.SearchStrategy[list[str]]:
    spec = [
        flag("--method", ["baseline", "ngram", "draft", "layerskip", "dflash", "magic", ""]),
        flag("--k", INTS),
        flag("--ngram-min", INTS),
        flag("--ngram-max", INTS),
        flag("--draft-model", files["draft"]),
        flag("--draft-p-min", FLOATS),
        flag("--skip-layers", SKIPS),
        flag("--drafter", files["drafter"]),
        flag("--temp", FLOATS),
        flag("--top-p", FLOATS),
        flag("--top-k", INTS),
        flag("--min-p", FLOATS),
        flag("--seed", INTS),
        flag("--repetition-penalty", FLOATS),
    ]
    common = [flag("--model", files["model"]), flag("--dtype", DTYPES)]

    def build(
        cmd: str, fixed: list[str], options: list[st.SearchStrategy[list[str]]], flags=("--no-openblas",)
    ):
        return st.lists(st.one_of(*options, st.sampled_from(flags).map(lambda f: [f])), max_size=4).map(
            lambda parts: [cmd, *fixed, *[x for p in parts for x in p]]
        )

    generate = st.tuples(st.sampled_from(TEXTS), st.sampled_from(SMALL)).flatmap(
        lambda pm: build(
            "generate",
            ["--prompt", pm[0], "--max-tokens", pm[1]],
            [
                *spec,
                *common,
                flag("--prompt-file", files["prompt"]),
                flag("--stop", TEXTS),
            ],
            GENERATE_FLAGS,
        )
    )
    bench = st.tuples(st.sampled_from(["explain", "no-such-workload"]), st.sampled_from(SMALL)).flatmap(
        lambda om: build(
            "bench",
            ["--only", om[0], "--max-tokens", om[1]],
            [
                *common,
                flag(
                    "--methods",
                    [
                        "ngram",
                        "ngram:k=2,fixed",
                        "ngram:temperature=0.5",
                        "magic",
                        "baseline",
                        "",
                        "ngram;layerskip:skip_layers=middle:6",
                        "ngram:k=x",
                        "draft",
                        "dflash:drafter=/no",
                    ],
                ),
                flag("--repeats", ["1", "0", "x"]),
                flag("--temp", FLOATS),
                flag("--seed", INTS),
                flag("--markdown", files["out"]),
                flag("--chart", files["out"]),
            ],
        )
    )
    ab = st.tuples(st.sampled_from(TEXTS), st.sampled_from(SMALL)).flatmap(
        lambda pm: build(
            "ab",
            ["--prompt", pm[0], "--max-tokens", pm[1]],
            [
                *common,
                flag(
                    "--methods",
                    [
                        "ngram",
                        "layerskip",
                        "ngram,magic",
                        "draft",
                        "dflash",
                        "mlx-lm-draft",
                        "mlx-lm",
                        "llama.cpp",
                        "",
                    ],
                ),
                flag("--reference", files["prompts"]),
                flag("--record", files["out"]),
                flag("--prompts", files["prompts"]),
                flag("--prompt-file", files["prompt"]),
                flag("--k", INTS),
                flag("--skip-layers", SKIPS),
                flag("--markdown", files["out"]),
                flag("--draft-model", files["draft"]),
                flag("--drafter", files["drafter"]),
            ],
            ("--json", "--no-chat-template", "--no-openblas"),
        )
    )
    train = st.integers(0, 10**9).flatmap(
        lambda n: build(
            "train-dflash",
            [
                "--out",
                str(files["root"] / f"run-{n}"),
                "--samples",
                "2",
                "--holdout",
                "1",
                "--max-new-tokens",
                "2",
                "--steps",
                "2",
                "--eval-every",
                "1",
                "--checkpoint-every",
                "1",
                "--layers",
                "1",
                "--anchors",
                "2",
                "--prompts",
                files["prompts"][0],
            ],
            [
                flag("--out", files["train_out"]),
                flag("--prompts", files["prompts"]),
                flag("--target", files["model"]),
                flag("--dtype", DTYPES),
                flag("--samples", SMALL),
                flag("--holdout", SMALL),
                flag("--steps", SMALL),
                flag("--layers", SMALL),
                flag("--block-size", INTS),
                flag("--target-layers", ["1,2", "1,x", "-1", "99", "", "0,0"]),
                flag("--mask-token-id", INTS),
                flag("--lr", FLOATS),
                flag("--ce-positions", INTS),
                flag("--hidden-weight", FLOATS),
                flag("--max-minutes", FLOATS),
                flag("--seed", INTS),
            ],
            ("--overwrite",),
        )
    )
    return st.one_of(generate, bench, ab, train)


def run_in_process(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def test_the_cli_never_crashes(files):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf2q_py, "load", _load)

        @settings(
            max_examples=50,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(argv=command_lines(files))
        def check(argv):
            rc, out, err = run_in_process(argv)
            assert "Traceback" not in err, (argv, err)
            if rc == 1 and argv[0] == "ab":
                assert "MISMATCH" in out, (argv, out, err)
                return
            assert rc in (0, 2), (argv, rc, err)
            if rc == 2:
                lines = err.strip().splitlines()
                assert len(lines) == 1 and "error:" in lines[0], (argv, err)

        check()
