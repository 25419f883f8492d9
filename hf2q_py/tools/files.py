"""The user's files: reading prompt files and checking output paths before a run."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import Hf2qError
from ..validate import check_unicode


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


def read_prompts(path: str | Path) -> list[str]:
    """A prompt file: JSONL (strings or {"prompt": ...}) or plain text, one prompt per line."""
    lines = read_text(path, "prompts file").splitlines()
    prompts = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith(("{", '"')):
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise Hf2qError(f"{path}:{i}: not valid JSON: {e.msg}") from None
            item = item.get("prompt") if isinstance(item, dict) else item
            if not isinstance(item, str):
                raise Hf2qError(f"{path}:{i}: expected a string or an object with a 'prompt' string")
            check_unicode(item, f"{path}:{i}: the prompt")
            prompts.append(item)
        else:
            prompts.append(line)
    if not prompts:
        raise Hf2qError(f"prompts file {path} holds no prompts")
    return prompts
