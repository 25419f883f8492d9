"""mlx-lm / Hugging Face model folders, and repo ids already in the local HF cache."""

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


def resolve_folder(source: str) -> Path:
    """A local folder, or a repo id resolved offline from the Hugging Face cache."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelLoadError(f"{source}: not a model folder or GGUF file")
    if source.count("/") != 1 or source.startswith((".", "/", "~")):
        raise ModelLoadError(f"{source}: no such file or folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, local_files_only=True))
    except Exception as e:  # huggingface_hub raises several offline error types
        raise ModelLoadError(
            f"{source}: no such folder, and not in the local Hugging Face cache "
            f"(hf2q-py never downloads; fetch it first with `hf download {source}`)"
        ) from e


def load_folder(source: str, dtype: mx.Dtype | None, split: Split | None = None) -> Target:
    """Load an mlx-lm folder; ``split`` shards it before its weights are read
    (each rank reads only its part of the safetensors)."""
    path = resolve_folder(source)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: no config.json, so this is not a model folder")
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path}: no .safetensors weight files")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"{path}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)})")
    import mlx_lm

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
    mx.eval(model.parameters())  # a sharded rank reads only its own part
    return Target(model, tokenizer, source=str(path), sharding=sharding)


def _read_config(path: Path) -> dict:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path / 'config.json'}: {one_line(e)}") from e
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path / 'config.json'}: not a JSON object")
    return cfg
