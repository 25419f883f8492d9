"""The user's files: reading prompt files and checking output paths before a run."""

from __future__ import annotations

from pathlib import Path

from ..errors import Hf2qError


def read_text(path: str | Path, what: str = "file") -> str:
    """The UTF-8 text of ``path``; a one-line ``Hf2qError`` naming ``what``
    when it cannot be read or is not UTF-8."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise Hf2qError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Hf2qError(f"{what} {path} is not UTF-8 text (invalid byte at offset {e.start})") from None


def check_writable(path: str | Path, what: str = "output file") -> None:
    """Refuse, before any work, an output path that cannot be written (a
    folder, a missing or read-only folder, no permission): the file is opened
    for appending, which changes nothing in an existing file, and a file that
    did not exist is removed again. (An existing file named as output is
    replaced when the run ends.)"""
    p = Path(path)
    if p.is_dir():
        raise Hf2qError(f"{what} {path} is a folder")
    existed = p.exists()
    try:
        with open(p, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise Hf2qError(f"cannot write {what} {path}: {e.strerror or e}") from None
    if not existed:
        p.unlink(missing_ok=True)


def write_text(path: str | Path, text: str, what: str = "output file") -> None:
    """Write ``text`` to ``path``; a one-line ``Hf2qError`` if that fails."""
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        raise Hf2qError(f"cannot write {what} {path}: {e.strerror or e}") from None
