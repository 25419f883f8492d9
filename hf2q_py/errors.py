"""User-facing errors: the CLI prints these as one line, without a traceback."""

from __future__ import annotations


class Hf2qError(Exception):
    """Bad input or an unsupported setup, with a message that names the problem."""


class ModelLoadError(Hf2qError):
    """A model source could not be found, read or understood."""


class UnsupportedModelError(Hf2qError):
    """The model's architecture or cache cannot do what was asked."""


def one_line(text: object, limit: int = 300) -> str:
    """``text`` (often a library's multi-line message) as one line of at most
    ``limit`` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def run_script(main) -> None:
    """Run a script's ``main()``; an ``Hf2qError`` ends it with one line on
    stderr (``<script>: error: <message>``) and exit status 2, as argparse does."""
    import os
    import sys

    try:
        main()
    except Hf2qError as e:
        print(f"{os.path.basename(sys.argv[0])}: error: {one_line(e)}", file=sys.stderr)
        raise SystemExit(2) from None
