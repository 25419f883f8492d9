"""Rewrite the benchmark tables in Markdown documents from their results files.

A document marks each table block with the results file it comes from::

    <!-- results: benchmarks/results/baseline.json -->
    (rendered: the command, date, machine and commit, then the tables)
    <!-- /results -->

    python -m hf2q_py.tools.tables                # docs/*.md and README.md
    python -m hf2q_py.tools.tables docs/x.md      # those files
    python -m hf2q_py.tools.tables --check        # exit 1 if a block is out of date

Paths in the markers are relative to the current folder (the repository root).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from collections.abc import Sequence

from ..errors import Hf2qError
from .results import read, render

BLOCK = re.compile(r"(<!-- results: (?P<path>[^>]+?) -->\n)(?P<body>.*?)(<!-- /results -->)", re.DOTALL)


def rewrite(text: str, root: Path = Path(".")) -> str:
    """``text`` with every results block rendered from its file."""

    def block(m: re.Match) -> str:
        return f"{m.group(1)}{render(read(root / m.group('path').strip()))}\n{m.group(4)}"

    out = BLOCK.sub(block, text)
    if out.count("<!-- results:") != out.count("<!-- /results -->"):
        raise Hf2qError("a results block has no end marker (<!-- /results -->)")
    return out


def default_files(root: Path = Path(".")) -> list[Path]:
    return sorted((root / "docs").glob("*.md")) + [p for p in [root / "README.md"] if p.exists()]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hf2q_py.tools.tables", description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="Markdown files (default: docs/*.md and README.md)")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file is out of date")
    args = ap.parse_args(argv)
    stale = []
    try:
        for path in [Path(f) for f in args.files] or default_files():
            text = path.read_text(encoding="utf-8")
            new = rewrite(text)
            if new != text:
                stale.append(str(path))
                if not args.check:
                    path.write_text(new, encoding="utf-8")
    except (Hf2qError, OSError) as e:
        print(f"tables: error: {e}", file=sys.stderr)
        return 2
    verb = "out of date" if args.check else "rewritten"
    for p in stale:
        print(f"{p}: {verb}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
