"""``load(source)``: a model folder, a Hugging Face repo id in the local cache,
a GGUF file, or (no source) the built-in SmolLM2-135M-Instruct."""

from __future__ import annotations

from pathlib import Path


from typing import Any

from ..distributed import barrier, check_mode
from ..errors import ModelLoadError
from ..target import Target
from .builtin import builtin_model_path
from .convert import parse_dtype
from .split import Split


def load(
    source: str | Path | None = None, *, dtype: str | None = "auto", group: Any = None, shard: str = "auto"
) -> Target:
    """Load a model for generation.

    ``dtype``: "auto" (default) converts to float32 on the CPU and keeps the
    stored weights on a GPU; "keep" keeps them (quantized weights stay
    quantized: best on Metal); "float32", "float16" or "bfloat16" converts.

    ``group``: an ``mx.distributed`` group of more than one rank (every rank
    calls ``load`` alike) shards the model over it; ``shard`` chooses how:
    "auto" (tensor parallel where mlx-lm has it, else pipeline), "tensor",
    "pipeline", or "none" (every rank loads the whole model). Refusals come
    before any weight is read.
    """
    mx_dtype = parse_dtype(dtype)
    check_mode(shard)
    split = Split(group, shard) if group is not None and group.size() > 1 and shard != "none" else None
    target = _load(source, mx_dtype, split)
    if split is not None:
        barrier(group)  # no rank starts generating while another still loads
    return target


def _load(source: str | Path | None, mx_dtype: Any, split: Split | None) -> Target:
    if source is None or str(source) == "":
        path = builtin_model_path()
        from .gguf import load_gguf

        return load_gguf(path, mx_dtype, split)
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            from .gguf import load_gguf

            return load_gguf(path, mx_dtype, split)
        raise ModelLoadError(f"{path}: not a GGUF file and not a model folder")
    from .folder import load_folder

    return load_folder(str(source), mx_dtype, split)


def check_source(source: str | Path | None) -> None:
    """Refuse, without loading anything, a model source that does not exist:
    a missing file or folder, or a repo id not in the local cache."""
    if source is None or str(source) == "":
        builtin_model_path()
        return
    if Path(source).expanduser().is_file():
        return
    from .folder import resolve_folder

    resolve_folder(str(source))


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
