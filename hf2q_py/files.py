"""The user's files: reading prompt files and checking output paths before a run."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import Hf2qError


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
    """Refuse, before any work, an output path that cannot be written: a
    folder, a file without write permission, or a missing or read-only parent
    folder. (An existing file named as output is replaced.)"""
    p = Path(path)
    if p.is_dir():
        raise Hf2qError(f"{what} {path} is a folder")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise Hf2qError(f"{what} {path} is not writable")
        return
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise Hf2qError(f"cannot write {what} {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise Hf2qError(f"cannot write {what} {path}: folder {parent} is not writable")


def write_text(path: str | Path, text: str, what: str = "output file") -> None:
    """Write ``text`` to ``path``; a one-line ``Hf2qError`` if that fails."""
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        raise Hf2qError(f"cannot write {what} {path}: {e.strerror or e}") from None
