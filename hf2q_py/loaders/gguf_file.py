"""The GGUF container: metadata and tensor directory, read without touching
tensor data (the tensors themselves: ``gguf_tensors``). A split GGUF
(llama.cpp's gguf-split: ``<stem>-00001-of-0000N.gguf`` parts, the metadata
in the first) reads as one header whose tensors name the part holding them.

The header is parsed directly (the ``gguf`` package's ``GGUFReader`` builds a
Python object per string and takes ~20 s on a 262k-token vocabulary).
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelLoadError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types -> (struct format, size); 8 is STRING, 9 is ARRAY.
_SCALARS = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's directory entry. ``shape`` is numpy order (rows first);
    ``offset`` is absolute in ``file`` (the part of a split GGUF holding it;
    None: the header's file); ``ggml_type`` a ``GGMLQuantizationType`` value."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int
    file: Path | None = None

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type {self.ggml_type}"


@dataclass
class GGUFHeader:
    """Everything in a GGUF file except the tensor data; ``parts``: a split
    GGUF's files in order (``path`` is the first), else just ``path``."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    parts: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        if not self.parts:
            self.parts = (self.path,)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def arch_key(self, key: str, default: Any = None) -> Any:
        """``<architecture>.<key>`` from the metadata."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes):
        self.buf = buf
        self.pos = 0

    def scalar(self, vtype: int) -> Any:
        fmt, size = _SCALARS[vtype]
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self) -> int:
        return self.scalar(4)

    def u64(self) -> int:
        return self.scalar(10)

    def string(self) -> str:
        n = self.u64()
        raw = self.buf[self.pos : self.pos + n]
        if len(raw) != n:
            raise ValueError("truncated string")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        buf, pos, out = self.buf, self.pos, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            out.append(buf[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        if pos > len(buf):
            raise ValueError("truncated string array")
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.u32(), self.u64()
            if etype == _STRING:
                return self.strings(count)
            if etype == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_NUMPY[etype])
            end = self.pos + count * dtype.itemsize
            if end > len(self.buf):
                raise ValueError("truncated array")
            values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
            self.pos = end
            return values
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.scalar(vtype)


#: A split GGUF part's name: ``<stem>-00001-of-00003.gguf``.
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def read_header(path: Path) -> GGUFHeader:
    """Parse metadata and the tensor directory (no tensor data is read); a
    part of a split GGUF reads every part (from any of them)."""
    header = _read_one(Path(path))
    count = int(header.metadata.get("split.count", 1) or 1)
    if count <= 1:
        return header
    parts = split_parts(Path(path), count)
    headers = [header if p == Path(path) else _read_one(p) for p in parts]
    tensors: dict[str, TensorInfo] = {}
    for i, (part, h) in enumerate(zip(parts, headers)):
        if h.metadata.get("split.no") != i or h.metadata.get("split.count") != count:
            raise ModelLoadError(f"{part}: not part {i + 1} of the {count}-part split GGUF {parts[0].name}")
        for name, info in h.tensors.items():
            tensors[name] = TensorInfo(info.name, info.shape, info.ggml_type, info.offset, info.nbytes, part)
    want = headers[0].metadata.get("split.tensors.count")
    if want is not None and want != len(tensors):
        raise ModelLoadError(f"{parts[0]}: the split GGUF's parts hold {len(tensors)} tensors, not {want}")
    return GGUFHeader(parts[0], headers[0].metadata, tensors, tuple(parts))


def split_parts(path: Path, count: int) -> list[Path]:
    """The ``count`` parts of the split GGUF ``path`` belongs to, in order
    (beside it, named as llama.cpp's gguf-split names them)."""
    m = SPLIT_NAME.match(path.name)
    if m is None or int(m.group("count")) != count:
        raise ModelLoadError(
            f"{path}: a split GGUF part ({count} parts) not named <name>-00001-of-{count:05d}.gguf"
        )
    parts = [path.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelLoadError(f"{path.name}: part of a {count}-part split GGUF; missing {', '.join(missing)}")
    return parts


def _read_one(path: Path) -> GGUFHeader:
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:  # ValueError: empty file
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e
    try:
        return _parse(path, buf)
    except ModelLoadError:
        raise
    except (ValueError, KeyError, struct.error, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e
    finally:
        buf.close()


def _parse(path: Path, buf: mmap.mmap) -> GGUFHeader:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if buf[:4] != MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (no GGUF magic)")
    c = _Cursor(buf)
    c.pos = 4
    version = c.u32()
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")
    n_tensors, n_kv = c.u64(), c.u64()
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        metadata[key] = c.value(c.u32())
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = [c.u64() for _ in range(c.u32())]
        ggml_type, offset = c.u32(), c.u64()
        infos.append((name, dims, ggml_type, offset))
    align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-c.pos // align) * align
    tensors = {}
    for name, dims, ggml_type, offset in infos:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            block, size = 1, 0  # unknown type: refused later, by name
        count = int(np.prod(dims)) if dims else 1
        nbytes = count // block * size
        if start + offset + nbytes > len(buf):
            raise ModelLoadError(f"{path}: truncated (tensor {name} runs past the end of the file)")
        tensors[name] = TensorInfo(name, tuple(reversed(dims)), ggml_type, start + offset, nbytes)
    return GGUFHeader(Path(path), metadata, tensors)
