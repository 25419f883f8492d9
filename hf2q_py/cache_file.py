"""One file of the prompt cache on disk: a safetensors file whose data a
checksum in its header covers, written under a temporary name and moved
into place, read back only after every size, offset and the checksum agree.

Arrays cross between MLX and the file as host arrays (:class:`Host`: a
numpy array and its safetensors dtype, so bfloat16 travels as its bits).
Converting from MLX happens on the thread that owns MLX; writing and
reading the files needs no MLX at all, so a writer thread can do it.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

FORMAT = "hf2q-prompt-cache"
VERSION = "1"
TEMP_PREFIX = ".tmp-"
MAX_HEADER = 64 << 20

#: safetensors dtype codes by numpy dtype (bfloat16 is carried as uint16 bits).
_CODES = {
    np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.float64): "F64",
    np.dtype(np.int8): "I8", np.dtype(np.int16): "I16", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64",
    np.dtype(np.uint8): "U8", np.dtype(np.uint16): "U16", np.dtype(np.uint32): "U32",
    np.dtype(np.uint64): "U64", np.dtype(np.bool_): "BOOL",
}  # fmt: skip
_NUMPY = {code: dtype for dtype, code in _CODES.items()} | {"BF16": np.dtype(np.uint16)}
#: MLX's dtype names by safetensors code.
_NAMES = {code: dtype.name for dtype, code in _CODES.items()} | {"BF16": "bfloat16", "BOOL": "bool"}


class CacheFileError(Exception):
    """A cache file that cannot be used; the message says why, in a few words."""


@dataclass(frozen=True)
class Host:
    """An array in host memory: its data and its safetensors dtype code."""

    data: np.ndarray
    code: str

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def dtype(self) -> str:
        """The dtype's name as MLX spells it (``float32``, ``bfloat16``, ...)."""
        return _NAMES[self.code]


def to_host(a: mx.array) -> Host:
    """An evaluated MLX array copied to host memory (on MLX's own thread)."""
    if a.dtype == mx.bfloat16:
        return Host(np.array(a.view(mx.uint16)), "BF16")
    data = np.array(a)
    if data.dtype not in _CODES:
        raise CacheFileError(f"arrays of {a.dtype} are not stored")
    return Host(data, _CODES[data.dtype])


def to_mlx(h: Host) -> mx.array:
    a = mx.array(h.data)
    return a.view(mx.bfloat16) if h.code == "BF16" else a


def dtype_name(a: mx.array) -> str:
    """An MLX array's dtype as the layout names it (``float32``, ``bfloat16``...)."""
    return str(a.dtype).rsplit(".", 1)[-1]


def write_file(path: Path, arrays: dict[str, Host], metadata: dict[str, str]) -> int:
    """Write ``arrays`` and ``metadata`` (plus the format, version and the
    data's checksum) to ``path`` atomically: a reader sees no file or the
    whole file. Returns the file's size."""
    names = sorted(arrays)
    header: dict[str, Any] = {}
    offset = 0
    digest = hashlib.sha256()
    chunks = []
    for name in names:
        h = arrays[name]
        data = np.ascontiguousarray(h.data)
        header[name] = {
            "dtype": h.code,
            "shape": list(data.shape),
            "data_offsets": [offset, offset + data.nbytes],
        }
        offset += data.nbytes
        view = memoryview(data).cast("B") if data.nbytes else b""
        digest.update(view)
        chunks.append(view)
    meta = {**metadata, "format": FORMAT, "version": VERSION, "checksum": digest.hexdigest()}
    header["__metadata__"] = meta
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    temp = path.with_name(f"{TEMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}-{path.name}")
    try:
        with open(temp, "wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for chunk in chunks:
                f.write(chunk)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return 8 + len(text) + offset


def read_file(path: Path) -> tuple[dict[str, Host], dict[str, str]]:
    """The arrays and metadata of a cache file, after checking its header,
    every array's size and place, and the checksum of its data. Raises
    ``FileNotFoundError`` when it is gone, :class:`CacheFileError` (why)
    when it cannot be used."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise CacheFileError("truncated (no header)")
    n = int.from_bytes(blob[:8], "little")
    if n > MAX_HEADER or 8 + n > len(blob):
        raise CacheFileError("truncated or not a cache file (header size)")
    try:
        header = json.loads(blob[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CacheFileError("not a cache file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise CacheFileError("not a cache file (header is not an object)")
    meta = _metadata(header.pop("__metadata__", None))
    data = memoryview(blob)[8 + n :]
    arrays = _arrays(header, data)
    if hashlib.sha256(data).hexdigest() != meta.get("checksum"):
        raise CacheFileError("corrupt (checksum mismatch)")
    return arrays, meta


def _metadata(meta: Any) -> dict[str, str]:
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CacheFileError("not a cache file (no metadata)")
    if meta.get("format") != FORMAT:
        raise CacheFileError("not an hf2q-py prompt cache file")
    if meta.get("version") != VERSION:
        raise CacheFileError(f"format version {meta.get('version')!r}, not {VERSION}")
    return meta


def _arrays(header: dict[str, Any], data: memoryview) -> dict[str, Host]:
    """The header's arrays as views of ``data``; they must tile it exactly."""
    spans, arrays = [], {}
    for name, entry in header.items():
        try:
            code, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            dtype = _NUMPY[code]
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError
            count = int(np.prod(shape, dtype=np.int64))
        except (KeyError, TypeError, ValueError):
            raise CacheFileError(f"not a cache file (array {name!r} is malformed)") from None
        if not (isinstance(begin, int) and isinstance(end, int)) or end - begin != count * dtype.itemsize:
            raise CacheFileError(f"corrupt (array {name!r} has the wrong size)")
        spans.append((begin, end))
        arrays[name] = (dtype, shape, begin, end, code)
    spans.sort()
    at = 0
    for begin, end in spans:
        if begin != at:
            raise CacheFileError("corrupt (arrays overlap or leave gaps)")
        at = end
    if at != len(data):
        raise CacheFileError("truncated" if at > len(data) else "corrupt (data past the arrays)")
    return {
        name: Host(np.frombuffer(data[begin:end], dtype=dtype).reshape(shape), code)
        for name, (dtype, shape, begin, end, code) in arrays.items()
    }
