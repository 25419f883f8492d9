"""``load(source)``: a model folder, a GGUF file, a model on the Hugging Face
hub (downloaded once into its cache), or (no source) the built-in
SmolLM2-135M-Instruct."""

from __future__ import annotations

from pathlib import Path


from typing import Any

from ..distributed import barrier, check_mode
from ..errors import ModelLoadError
from ..kv import kv_config
from ..target import Target
from .builtin import builtin_model_path
from .convert import parse_dtype
from .split import Split


def load(
    source: str | Path | None = None,
    *,
    dtype: str | None = "auto",
    group: Any = None,
    shard: str = "auto",
    offline: bool = False,
    progress: bool | None = None,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    quantized_kv_start: int | None = None,
) -> Target:
    """Load a model for generation.

    ``source``: a GGUF file, a model folder, a hub name (``owner/name``,
    ``owner/name:QUANT`` for a GGUF quantization, ``owner/name/file.gguf``),
    or None for the built-in model. A hub model not in the Hugging Face
    cache is downloaded (its model files only) as ``huggingface_hub`` does
    (``HF_ENDPOINT``, ``HF_HOME``, ``HF_TOKEN``); ``offline=True`` (or
    ``HF_HUB_OFFLINE=1``) loads from the cache only.

    ``progress``: progress bars on stderr for downloads and long loads;
    None (default) shows them when stderr is a terminal.

    ``dtype``: "auto" (default) converts to float32 on the CPU and keeps the
    stored weights on a GPU; "keep" keeps them (quantized weights stay
    quantized: best on Metal); "float32", "float16" or "bfloat16" converts.

    ``group``: an ``mx.distributed`` group of more than one rank (every rank
    calls ``load`` alike) shards the model over it; ``shard`` chooses how:
    "auto" (tensor parallel where mlx-lm has it, else pipeline), "tensor",
    "pipeline", or "none" (every rank loads the whole model). Refusals come
    before any weight is read.

    ``kv_bits`` 8 or 4 quantizes the KV caches of every generation on the
    target (None: full precision), in groups of ``kv_group_size`` (32, 64
    or 128; default 64) along the head dimension, from position
    ``quantized_kv_start`` (default 0) on: the target's ``kv``
    (:class:`~hf2q_py.kv.KVConfig`). Bad values are refused before loading,
    a group size the model's head dimension cannot take after.
    """
    from .progress import shown

    kv = kv_config(kv_bits, kv_group_size, quantized_kv_start)
    mx_dtype = parse_dtype(dtype)
    check_mode(shard)
    split = Split(group, shard) if group is not None and group.size() > 1 and shard != "none" else None
    target = _load(source, mx_dtype, split, offline, shown(progress))
    if split is not None:
        barrier(group)  # no rank starts generating while another still loads
    target.kv = kv
    return target


def _load(source: str | Path | None, mx_dtype: Any, split: Split | None, offline: bool, show: bool) -> Target:
    from .gguf import load_gguf

    if source is None or str(source) == "":
        return load_gguf(builtin_model_path(), mx_dtype, split, progress=show)
    from .hub import resolve

    path = resolve(source, offline=offline, progress=show)
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            return load_gguf(path, mx_dtype, split, progress=show)
        raise ModelLoadError(f"{path}: not a GGUF file and not a model folder")
    from .folder import load_folder

    return load_folder(path, mx_dtype, split, progress=show)


def check_source(source: str | Path | None, *, offline: bool = False) -> None:
    """Refuse, without loading or downloading anything, a model source that
    names nothing: a missing file or folder, a hub model or quantization that
    does not exist, or (offline) one not in the cache."""
    if source is None or str(source) == "":
        builtin_model_path()
        return
    from .hub import check

    check(source, offline=offline)


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
