"""mlx-lm / Hugging Face model folders (local, or a hub repo's, through ``hub``)."""

from __future__ import annotations

import json
from pathlib import Path


import mlx.core as mx

from ..errors import ModelLoadError, UnsupportedModelError, one_line
from ..target import Target
from .convert import to_dtype
from .split import Split


#: A folder needs one of these for its tokenizer (fast, SentencePiece or BPE files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


def resolve_folder(
    source: str | Path, *, offline: bool = False, progress: bool = False, patterns: list[str] | None = None
) -> Path:
    """A local folder, or a hub repo's folder (its files matching ``patterns``,
    by default a model's) from the Hugging Face cache, downloaded first unless
    already there (``offline``: never)."""
    from .hub import HubName, parse_source, resolve

    found = parse_source(source)
    if isinstance(found, Path) and not found.is_dir():
        raise ModelLoadError(f"{source}: not a folder")
    if isinstance(found, HubName) and (found.quant is not None or found.file is not None):
        raise ModelLoadError(f"{source}: names a GGUF file, not a folder")
    return resolve(source, offline=offline, progress=progress, patterns=patterns)


def load_folder(
    path: Path, dtype: mx.Dtype | None, split: Split | None = None, progress: bool = False
) -> Target:
    """Load an mlx-lm folder; ``split`` shards it before its weights are read
    (each rank reads only its part of the safetensors); ``progress`` counts
    the weights read on a bar."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: no config.json, so this is not a model folder")
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path}: no .safetensors weight files")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"{path}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)})")
    import mlx_lm

    from .progress import evaluate

    cfg = _read_config(path)
    if split is not None:
        split.plan(cfg)
    try:
        model, tokenizer = mlx_lm.load(str(path), lazy=True)
    except ValueError as e:
        if "not supported" in str(e):
            raise UnsupportedModelError(f"{path}: {one_line(e)}") from e
        raise ModelLoadError(f"{path}: {one_line(e)}") from e
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot load the model: {one_line(e)}") from e
    model = to_dtype(model, dtype, evaluate=False)
    sharding = split.apply(model, cfg) if split is not None else None
    evaluate(model.parameters(), f"Loading {path.name}", progress)  # a sharded rank reads only its own part
    return Target(model, tokenizer, source=str(path), sharding=sharding)


def _read_config(path: Path) -> dict:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path / 'config.json'}: {one_line(e)}") from e
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path / 'config.json'}: not a JSON object")
    return cfg
