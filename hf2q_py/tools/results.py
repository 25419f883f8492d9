"""Benchmark results files: what a benchmark measured, with the command, the
date, the machine and the commit, as JSON under ``benchmarks/results/``.

A results file is one JSON object::

    {"command": "hf2q-py bench --methods ngram ...", "date": "2026-12-01 02:40 UTC",
     "machine": "2 x x86_64 cores, Linux, MLX 0.32.0 (cpu), OpenBLAS loaded",
     "commit": "604b16a", "tables": [{"title": "", "columns": [...], "align": "lrr", "rows": [[...]]}],
     "notes": "...", "data": {...}}

``tables`` hold the cells as rendered (strings); ``data`` the raw numbers.
``python -m hf2q_py.tools.tables`` renders them into Markdown documents.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from ..errors import Hf2qError


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "", title: str = "") -> dict:
    """A table of cells (rendered with ``str``); ``align`` one letter per
    column, ``l`` or ``r`` (default: left)."""
    align = align or "l" * len(columns)
    if len(align) != len(columns) or any(len(r) != len(columns) for r in rows):
        raise ValueError("every row and the alignment need one entry per column")
    return {
        "title": title,
        "columns": list(columns),
        "align": align,
        "rows": [[str(c) for c in r] for r in rows],
    }


def speedup_summary(rows: Sequence[Any], kind_title: str = "kind", low_title: str = "min speed-up") -> dict:
    """The per-kind summary table of rows with ``kind``, ``method`` and ``speedup``:
    the mean and the lowest speed-up of each (kind, method), in first-seen order."""
    groups: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        groups.setdefault((r.kind, r.method), []).append(r.speedup)
    summary = [
        [kind, method, f"{sum(xs) / len(xs):.2f}x", f"{min(xs):.2f}x"]
        for (kind, method), xs in groups.items()
    ]
    return table([kind_title, "method", "mean speed-up", low_title], summary, "llrr")


def render_tables(tables: Sequence[dict]) -> str:
    """Tables as Markdown, one after another."""
    return "\n\n".join(render_table(t) for t in tables)


def record(command: str, tables: Sequence[dict], *, notes: str = "", data: Any = None) -> dict:
    """A results record stamped with the date, this machine and the commit."""
    return {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "commit": commit(),
        "tables": list(tables),
        "notes": notes,
        "data": data,
    }


def publish(rec: dict, path: str | os.PathLike | None = None) -> None:
    """Print the record as Markdown and, given a ``path``, write it there."""
    print(render(rec), flush=True)
    if path:
        write(path, rec)


def write(path: str | os.PathLike, rec: dict) -> None:
    from .files import write_text

    write_text(str(path), json.dumps(rec, indent=1) + "\n", "results file")


def read(path: str | os.PathLike) -> dict:
    try:
        rec = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise Hf2qError(f"results file {path}: {e}") from None
    missing = {"command", "date", "machine", "commit", "tables"} - set(rec if isinstance(rec, dict) else ())
    if missing:
        raise Hf2qError(f"results file {path} lacks {', '.join(sorted(missing))}")
    return rec


def machine() -> str:
    """Cores, OS, MLX version and device, and whether OpenBLAS is loaded."""
    import mlx.core as mx

    import hf2q_py

    device = getattr(mx.default_device().type, "name", str(mx.default_device()))
    return (
        f"{os.cpu_count()} x {platform.machine()} cores, {platform.system()}, MLX {mx.__version__} "
        f"({device}), OpenBLAS {hf2q_py.openblas_status().state}"
    )


def commit() -> str:
    """The checkout's short commit hash, marked when the code has uncommitted changes."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30
        ).stdout.strip()

    try:
        sha = git("rev-parse", "--short", "HEAD")
        # the code only: a benchmark rewriting its own results file mid-run is no change of code
        dirty = git(
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            "hf2q_py",
            "benchmarks",
            ":!benchmarks/results",
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not sha:
        return "unknown"
    return f"{sha} + uncommitted changes" if dirty else sha


def render_table(t: dict) -> str:
    sep = ["---:" if a == "r" else "---" for a in t["align"]]
    lines = [_row(t["columns"]), "|" + "|".join(sep) + "|", *(_row(r) for r in t["rows"])]
    return (t["title"] + "\n\n" if t.get("title") else "") + "\n".join(lines)


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def render(rec: dict) -> str:
    """The record as Markdown: a line naming the command, date, machine and
    commit, the tables, and the notes."""
    parts = [f"`{rec['command']}`: {rec['date']}, {rec['machine']}, commit {rec['commit']}"]
    parts += [render_table(t) for t in rec["tables"]]
    if rec.get("notes"):
        parts.append(rec["notes"])
    return "\n\n".join(parts)
