"""Benchmark results files and the tables rendered from them into the docs."""

import json
from pathlib import Path

import pytest
from models import tiny_target

import hf2q_py
from hf2q_py.errors import Hf2qError
from hf2q_py.tools import results, tables
from hf2q_py.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_a_record_names_the_command_date_machine_and_commit(tmp_path):
    t = results.table(["what", "time"], [["a round", "1.0 us"]], "lr", title="Cost:")
    rec = results.record("python bench.py --x 1", [t], notes="One run.", data={"x": 1})
    assert rec["date"].endswith("UTC") and "cores" in rec["machine"] and rec["commit"]
    results.write(tmp_path / "r.json", rec)
    back = results.read(tmp_path / "r.json")
    assert back == rec
    text = results.render(back)
    assert (
        text.splitlines()[0]
        == f"`python bench.py --x 1`: {rec['date']}, {rec['machine']}, commit {rec['commit']}"
    )
    assert "Cost:\n\n| what | time |\n|---|---:|\n| a round | 1.0 us |" in text
    assert text.endswith("One run.")


def test_a_table_needs_one_cell_per_column():
    with pytest.raises(ValueError):
        results.table(["a", "b"], [["only one"]])
    assert results.table(["a"], [["x|y"]])["rows"] == [["x|y"]]
    assert results.render_table(results.table(["a"], [["x|y"]])).endswith("| x\\|y |")


def test_blocks_are_rewritten_from_their_files_and_the_rest_is_kept(tmp_path):
    rec = results.record("cmd", [results.table(["n"], [["1"]])])
    results.write(tmp_path / "r.json", rec)
    doc = "# Title\n\nBefore.\n\n<!-- results: r.json -->\nstale table\n<!-- /results -->\n\nAfter.\n"
    out = tables.rewrite(doc, tmp_path)
    assert out.startswith("# Title\n\nBefore.\n\n<!-- results: r.json -->\n`cmd`: ")
    assert out.endswith("| n |\n|---|\n| 1 |\n<!-- /results -->\n\nAfter.\n")
    assert tables.rewrite(out, tmp_path) == out  # rendering is stable
    with pytest.raises(Hf2qError, match="no end marker"):
        tables.rewrite("<!-- results: r.json -->\n", tmp_path)
    with pytest.raises(Hf2qError, match="missing.json"):
        tables.rewrite("<!-- results: missing.json -->\n<!-- /results -->", tmp_path)


def test_check_mode_reports_a_stale_file_and_changes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    results.write("r.json", results.record("cmd", [results.table(["n"], [["1"]])]))
    doc = Path("doc.md")
    doc.write_text("<!-- results: r.json -->\n<!-- /results -->\n")
    assert tables.main(["--check", "doc.md"]) == 1
    assert doc.read_text() == "<!-- results: r.json -->\n<!-- /results -->\n"
    assert tables.main(["doc.md"]) == 0
    assert tables.main(["--check", "doc.md"]) == 0
    assert "| n |" in doc.read_text()
    capsys.readouterr()


def test_the_docs_are_rendered_from_their_results_files(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert tables.main(["--check"]) == 0, "run: python -m hf2q_py.tools.tables"


@pytest.mark.parametrize("doc", ["docs/benchmarks.md", "docs/suffix.md"])
def test_every_benchmark_table_comes_from_a_results_file(doc):
    text = tables.BLOCK.sub("", (ROOT / doc).read_text())
    assert not [line for line in text.splitlines() if line.startswith("|")]


def test_bench_writes_a_results_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(hf2q_py, "load", lambda *a, **k: tiny_target("llama", tokenizer=True))
    path = tmp_path / "bench.json"
    rc = main(
        [
            "bench",
            "--only",
            "explain",
            "--max-tokens",
            "3",
            "--methods",
            "ngram:k=2,fixed",
            "--results",
            str(path),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    rec = json.loads(path.read_text())
    assert (
        rec["command"]
        == f"hf2q-py bench --only explain --max-tokens 3 --methods ngram:k=2,fixed --results {path}"
    )
    assert [t["columns"][:2] for t in rec["tables"]] == [["workload", "method"], ["workload kind", "method"]]
    assert rec["tables"][0]["rows"][0][:2] == ["prose: explain", "ngram:k=2,fixed"]
    assert (
        rec["data"]["rows"][0]["method"] == "ngram:k=2,fixed" and rec["data"]["settings"]["max_tokens"] == 3
    )
    assert results.render(rec).count("| prose: explain |") == 1


def test_the_speed_up_summary_keeps_each_kind_and_methods_mean_and_lowest():
    from types import SimpleNamespace as Row

    rows = [Row(kind="code", method="ngram", speedup=s) for s in (1.0, 3.0)]
    rows.append(Row(kind="prose", method="ngram", speedup=0.98))
    t = results.speedup_summary(rows, "workload kind", "lowest speed-up")
    assert t["columns"] == ["workload kind", "method", "mean speed-up", "lowest speed-up"]
    assert t["rows"] == [["code", "ngram", "2.00x", "1.00x"], ["prose", "ngram", "0.98x", "0.98x"]]
