"""The prompt cache on disk: model states by token prefix that outlive the
process, so a long prompt (an agent's system prompt and tools, a
conversation so far) is not prefilled again after a restart.

Full-attention layers' keys and values are stored in blocks of
``block_tokens`` positions, each a file named by a hash chained over every
token before it and its own (``b-<hash>.safetensors``): a prefix shared by
many conversations is stored once, and a conversation that grows writes only
its new blocks. What cannot be cut back to an arbitrary prefix (sliding
windows, recurrent layers), and the positions after the last whole block,
go into a tail named by the chain before it, its length and the hash of its
tokens (``t-<chain>-<count>-<hash>.safetensors``), valid at its exact end.
The chain starts from the model's identity, the cache layout and the block
size, so another model, dtype or quantization never matches a name.

Every file is checked before use (``cache_file``: sizes, checksum; here:
model, layout, chain, token ids, array shapes); a file that fails is skipped
with one log line and removed. Writes go through a writer thread
(``disk_writer``); reads happen on the caller's (MLX's) thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from .cache import LayerState
from .cache_file import CacheFileError, Host, read_file, to_host
from .cache_layout import ATTENTION, Layout, digest, fixed_fields, layout_of, leaf_paths, leaves, rebuild
from .cache_layout import shape_fits
from .disk_writer import NAME, DiskStats, Job, Writer
from .errors import Hf2qError, one_line
from .prompt_cache import Snapshot


log = logging.getLogger("hf2q_py.prompt_cache")


class CacheOwner(Protocol):
    """What the disk tier reads of its model (``hf2q_py.target.Target``): its
    identity, KV layout, sharding, and a runtime to probe its states' layout."""

    @property
    def identity(self) -> str: ...

    kv: Any
    sharding: Any

    def runtime(self) -> Any: ...


BLOCK_TOKENS = 128
MIN_TOKENS = 256
DEFAULT_MAX_BYTES = 8 << 30
#: Lookups tried after a file failed (each failure removes the file).
ATTEMPTS = 3


def default_directory() -> Path:
    """Where ``serve`` keeps the prompt cache: ``hf2q-py/prompt-cache`` in the
    user's cache folder (``~/Library/Caches`` on macOS, else
    ``$XDG_CACHE_HOME`` or ``~/.cache``)."""
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "hf2q-py" / "prompt-cache"


def prepare_directory(path: str | Path, what: str = "prompt cache directory") -> Path:
    """``path`` made (with its parents) and checked writable by writing and
    removing a file; a one-line ``Hf2qError`` naming ``what`` otherwise."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise Hf2qError(f"{what} {path} is not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".tmp-{os.getpid()}-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise Hf2qError(f"cannot write to {what} {path}: {e.strerror or e}") from None
    return p


def link(parent: str, tokens: Any) -> str:
    """The chain hash after ``tokens`` that follow the chain hash ``parent``."""
    data = bytes.fromhex(parent) + np.asarray(tokens, dtype="<i8").tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def block_name(h: str) -> str:
    return f"b-{h}.safetensors"


def tail_name(boundary: str, count: int, end: str) -> str:
    return f"t-{boundary}-{count}-{end}.safetensors"


class Skip(Exception):
    """A file that cannot be used (the message says why)."""


@dataclass
class Found:
    """What a lookup can restore: ``n`` tokens, ``k`` blocks, maybe a tail."""

    n: int
    k: int
    chain: list[str]
    tail: str | None = None


class DiskCache:
    """The prompt cache's disk tier for one Target, in ``directory``, at most
    ``max_bytes`` (None: unbounded), least recently used out. Only snapshots
    of at least ``min_tokens`` tokens are written. ``writable=False``: only
    read (the folder is not made, checked or kept in bounds).

    Raises ``Hf2qError`` for an unwritable directory, bad bounds or a
    sharded target (whose ranks must agree on every lookup)."""

    def __init__(
        self,
        target: CacheOwner,
        directory: str | Path,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
        *,
        block_tokens: int = BLOCK_TOKENS,
        min_tokens: int = MIN_TOKENS,
        writable: bool = True,
    ):
        for name, value in (("block_tokens", block_tokens), ("min_tokens", min_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise Hf2qError(f"prompt cache {name} must be an integer >= 1, got {value!r}")
        if max_bytes is not None and (
            isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1
        ):
            raise Hf2qError(f"prompt cache disk bytes must be an integer >= 1, got {max_bytes!r}")
        if target.sharding is not None:
            raise Hf2qError("the prompt cache on disk does not serve a sharded model (its ranks must agree)")
        self.directory = prepare_directory(directory) if writable else Path(directory)
        self.max_bytes, self.block, self.min_tokens = max_bytes, block_tokens, min_tokens
        self.model = target.identity
        self.kv_config = target.kv  # how the states it holds store keys and values
        self.layout = probe_layout(target)
        self.layout_digest = digest(self.layout)
        self.root = link(
            hashlib.blake2b(f"{self.model} {self.layout_digest}".encode(), digest_size=16).hexdigest(),
            [block_tokens],
        )
        self.kv = [i for i, layer in enumerate(self.layout) if layer["kind"] == "kv"]
        #: every layer can be cut back to any prefix: whole blocks alone restore a state
        self.cuttable = len(self.kv) == len(self.layout)
        self.stats = DiskStats()
        self.writer = Writer(self.directory, max_bytes, self.stats)
        if writable:
            self.writer.evict()
        self._noted_layout = False

    # -- reading -----------------------------------------------------------------
    def holds(self, kv: Any) -> bool:
        """Whether it holds states stored as ``kv`` says (the Target's layout when it was made)."""
        return kv == self.kv_config

    def lookup(self, tokens: list[int], limit: int, longer_than: int = 0) -> tuple[Snapshot | None, int]:
        """The snapshot on disk that rebuilds the longest prefix of
        ``tokens[:limit]``, if longer than ``longer_than``, and that length;
        (None, 0) if none. Never raises: a failure is one log line."""
        if limit < self.min_tokens or limit <= longer_than:
            return None, 0
        try:
            snap = None
            for _ in range(ATTEMPTS):  # a file that fails is removed: look again without it
                found = self._find(tokens, limit)
                if found is None or found.n <= longer_than:
                    break
                snap, failed = self._load(tokens, found, longer_than)
                if snap is not None or not failed:
                    break
        except Exception as e:  # noqa: BLE001 - the disk never fails a request
            log.warning("prompt cache on disk: lookup failed: %s", one_line(e))
            return None, 0
        if snap is None:
            return None, 0
        n = len(snap.tokens)
        self.stats.hits += 1
        self.stats.reused_tokens += n
        return snap, n

    def _listing(self) -> tuple[set[str], dict[str, list[tuple[int, str, str]]]]:
        """The block names and the tails by the chain hash they follow."""
        blocks: set[str] = set()
        tails: dict[str, list[tuple[int, str, str]]] = defaultdict(list)
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:  # removed while the server runs: empty (the writer makes it again)
            names = []
        for name in names:
            if not NAME.match(name):
                continue
            if name[0] == "b":
                blocks.add(name)
            else:
                _, boundary, count, end = name.removesuffix(".safetensors").split("-")
                tails[boundary].append((int(count), end, name))
        return blocks, tails

    def _find(self, tokens: list[int], limit: int) -> Found | None:
        """From the names alone: the longest prefix whose files are all there."""
        blocks, tails = self._listing()
        m = limit // self.block if self.kv else 0
        chain = self.chain(tokens, m)
        j = 0
        while j < m and block_name(chain[j + 1]) in blocks:
            j += 1
        best = Found(j * self.block, j, chain) if self.cuttable and j else None
        for k in range(j, -1, -1):
            at = k * self.block
            for count, end, name in tails.get(chain[k], ()):
                n = at + count
                if n <= limit and (best is None or n > best.n) and link(chain[k], tokens[at:n]) == end:
                    best = Found(n, k, chain, name)
        return best

    def chain(self, tokens: list[int], blocks: int) -> list[str]:
        """The chain hashes at the first ``blocks`` block boundaries (the root first)."""
        out = [self.root]
        for i in range(blocks):
            out.append(link(out[-1], tokens[i * self.block : (i + 1) * self.block]))
        return out

    def _load(self, tokens: list[int], found: Found, longer_than: int) -> tuple[Snapshot | None, bool]:
        """Read and check the files ``found`` names, and whether one failed; a
        file that fails ends the read at the blocks before it (where those
        alone restore a state)."""
        parts = Parts(self, found.n)
        for i in range(found.k):
            try:
                parts.add_block(
                    self._read(block_name(found.chain[i + 1]), found.chain[i], tokens, i * self.block)
                )
            except Skip:
                return self._shorter(parts, tokens, i * self.block, longer_than), True
        if found.tail is not None:
            try:
                parts.add_tail(self._read(found.tail, found.chain[found.k], tokens, found.k * self.block))
            except Skip:
                return self._shorter(parts, tokens, found.k * self.block, longer_than), True
        self._touch(found)
        return parts.snapshot(tokens, found.n), False

    def _shorter(self, parts: Parts, tokens: list[int], n: int, longer_than: int) -> Snapshot | None:
        """The first ``n`` tokens' state from the blocks read, where blocks alone restore one."""
        return parts.snapshot(tokens, n) if self.cuttable and n > longer_than else None

    def _read(self, name: str, parent: str, tokens: list[int], start: int) -> tuple[dict[str, Host], dict]:
        """A file's arrays and metadata, checked against what its name promises."""
        path = self.directory / name
        try:
            arrays, meta = read_file(path)
            self.check(name, arrays, meta, parent, start)
            want = np.asarray(tokens[start : start + int(meta["count"])], dtype=np.int64)
            if not np.array_equal(arrays["tokens"].data, want):
                raise CacheFileError("its token ids differ from the prompt's")
        except FileNotFoundError:
            raise Skip("gone") from None  # removed meanwhile (another server's bound): a miss
        except (CacheFileError, KeyError, ValueError) as e:
            self.stats.skipped += 1
            log.warning("prompt cache on disk: skipped %s: %s", path, one_line(e))
            path.unlink(missing_ok=True)
            raise Skip(str(e)) from None
        return arrays, meta

    def check(
        self, name: str, arrays: dict[str, Host], meta: dict[str, str], parent: str, start: int
    ) -> None:
        """Raise ``CacheFileError`` unless the file is this model's, of this
        layout, at this place in its chain, with the arrays the layout says."""
        if meta.get("model") != self.model:
            raise CacheFileError("saved by another model (or other weights, MLX version or device)")
        if meta.get("layout") != self.layout_digest:
            raise CacheFileError("saved with another cache layout (dtype, quantization or cache kinds)")
        if meta.get("root") != self.root or meta.get("parent") != parent or meta.get("start") != str(start):
            raise CacheFileError("its place in the chain differs from its name")
        kind = "block" if name.startswith("b-") else "tail"
        if meta.get("kind") != kind:
            raise CacheFileError(f"a {meta.get('kind')} named as a {kind}")
        count = int(meta["count"])
        tokens = arrays.get("tokens")
        if tokens is None or tokens.code != "I64" or tokens.data.shape != (count,):
            raise CacheFileError("no token ids of the right length")
        fields = json.loads(meta["layers"]) if kind == "tail" else {}
        for index, layer in enumerate(self.layout):
            if layer["kind"] == "kv":
                self._check_leaves(arrays, index, layer, count or None)
            elif kind == "tail":
                held = _held(fields.get(str(index)), start + count)
                self._check_leaves(arrays, index, layer, held if layer["kind"] in ATTENTION else -1)

    def _check_leaves(self, arrays: dict[str, Host], index: int, layer: dict, count: int | None) -> None:
        """A layer's leaves are all there with the layout's dtype and shape
        and ``count`` positions (-1: any; None: the layer has none here)."""
        for path, desc in leaf_paths(layer["leaves"]):
            h = arrays.get(f"{index}.{path}")
            if count is None:
                if h is not None:
                    raise CacheFileError(f"array {index}.{path} where the layout has none")
                continue
            if h is None or not shape_fits(desc, h.dtype, h.data.shape):
                raise CacheFileError(f"array {index}.{path} is missing or has another dtype or shape")
            if count >= 0 and h.data.shape[-2] != count:
                raise CacheFileError(f"array {index}.{path} holds the wrong number of positions")

    def _touch(self, found: Found) -> None:
        """Mark the files a lookup used as just used, the chain's start last (newest)."""
        names = [found.tail] if found.tail else []
        names += [block_name(found.chain[i]) for i in range(found.k, 0, -1)]
        self.writer.put([Job(name) for name in names])

    # -- writing -----------------------------------------------------------------
    def add(self, snap: Snapshot) -> None:
        """Queue the files ``snap`` needs that are not on disk yet (its arrays
        copied to host memory here, on MLX's thread; written by the writer
        thread). Snapshots shorter than ``min_tokens``, of another layout
        or larger than the bound are not written."""
        if len(snap.tokens) < self.min_tokens:
            return
        try:
            jobs = self.plan(snap)
        except Exception as e:  # noqa: BLE001 - the disk never fails a request
            log.warning("prompt cache on disk: not written: %s", one_line(e))
            return
        if jobs:
            self.writer.put(jobs)

    def plan(self, snap: Snapshot) -> list[Job]:
        """The writes (and touches) that put ``snap`` on disk, blocks from the
        last to the first (so the start of a chain is the newest), the tail last."""
        if layout_of(snap.layers) != self.layout:
            if not self._noted_layout:
                log.info("prompt cache on disk: a state of another layout than this model's is not written")
                self._noted_layout = True
            return []
        if (
            self.max_bytes is not None
            and sum(a.nbytes for s in snap.layers for _, a in leaves(s.arrays)) > self.max_bytes
        ):
            return []  # it would push itself out
        tokens, L, B = list(snap.tokens), len(snap.tokens), self.block
        k = L // B if self.kv else 0
        chain = self.chain(tokens, k)
        count = L - k * B
        tail = tail_name(chain[k], count, link(chain[k], tokens[k * B :]))
        missing = {i for i in range(k) if not (self.directory / block_name(chain[i + 1])).exists()}
        tail_missing = not (self.directory / tail).exists()
        lo = min(missing) * B if missing else k * B
        host = self._host_kv(snap, lo) if missing or (tail_missing and count) else {}
        jobs = []
        for i in range(k - 1, -1, -1):
            if i in missing:
                arrays = _cut(host, i * B - lo, (i + 1) * B - lo)
                jobs.append(self._job(block_name(chain[i + 1]), "block", arrays, tokens, i * B, B, chain[i]))
            else:
                jobs.append(Job(block_name(chain[i + 1])))
        if not tail_missing:
            return [*jobs, Job(tail)]
        kv = _cut(host, k * B - lo, L - lo) if count else {}
        return [*jobs, self._tail_job(snap, tail, kv, k * B, chain[k])]

    def _tail_job(self, snap: Snapshot, name: str, kv: dict[str, Host], start: int, parent: str) -> Job:
        """The tail of ``snap`` after position ``start``: ``kv`` (the full-attention
        positions past the last block) and every other layer's whole state."""
        arrays, fields = dict(kv), {}
        for index, layer in enumerate(snap.layers):
            if index not in self.kv:
                arrays.update({f"{index}.{p}": to_host(a) for p, a in leaves(layer.arrays)})
                fields[str(index)] = {"offset": layer.offset, "start": layer.start}
        job = self._job(name, "tail", arrays, list(snap.tokens), start, len(snap.tokens) - start, parent)
        job.metadata["layers"] = json.dumps(fields)
        return job

    def _host_kv(self, snap: Snapshot, lo: int) -> dict[str, Host]:
        """Every full-attention leaf's positions from ``lo`` on, in host memory."""
        out = {}
        for index in self.kv:
            layer = snap.layers[index]
            for path, a in leaves(layer.arrays):
                if a.shape[-2] != layer.offset:
                    raise ValueError(f"layer {index} holds {a.shape[-2]} positions, not {layer.offset}")
                out[f"{index}.{path}"] = to_host(a[..., lo:, :])
        return out

    def _job(
        self, name: str, kind: str, arrays: dict, tokens: list[int], start: int, count: int, parent: str
    ) -> Job:
        arrays = {**arrays, "tokens": Host(np.asarray(tokens[start : start + count], dtype=np.int64), "I64")}
        meta = {
            "kind": kind, "model": self.model, "layout": self.layout_digest, "root": self.root,
            "parent": parent, "start": str(start), "count": str(count), "block_tokens": str(self.block),
            "layout_json": json.dumps(self.layout, sort_keys=True),
        }  # fmt: skip
        return Job(name, arrays, meta)

    def flush(self) -> list[str]:
        """Wait until every queued write is on disk; the errors since the last flush."""
        return self.writer.flush()


def _held(fields: Any, end: int) -> int:
    """The positions a tail's layer holds, after checking its offset is the tail's end."""
    if not isinstance(fields, dict) or fields.get("offset") != end:
        raise CacheFileError("a layer's state does not end where the tail ends")
    start = fields.get("start")
    if not isinstance(start, int) or not 0 <= start <= end:
        raise CacheFileError("a layer's state starts outside the tail")
    return end - start


def _cut(host: dict[str, Host], a: int, b: int) -> dict[str, Host]:
    """Positions ``a:b`` of every leaf (views)."""
    return {name: Host(h.data[..., a:b, :], h.code) for name, h in host.items()}


class Parts:
    """A snapshot put together from checked files: full-attention leaves
    copied into place block by block, the tail's states as they are."""

    def __init__(self, disk: DiskCache, n: int):
        self.disk, self.n = disk, n
        self.kv: dict[str, np.ndarray] = {}
        self.codes: dict[str, str] = {}
        self.at = 0
        self.tail: dict[str, Host] = {}
        self.fields: dict[str, dict[str, int]] = {}

    def add_block(self, read: tuple[dict[str, Host], dict]) -> None:
        arrays, meta = read
        count = int(meta["count"])
        for name, h in arrays.items():
            if name == "tokens":
                continue
            if name not in self.kv:
                shape = list(h.data.shape)
                shape[-2] = self.n
                self.kv[name] = np.empty(shape, h.data.dtype)
                self.codes[name] = h.code
            self.kv[name][..., self.at : self.at + count, :] = h.data
        self.at += count

    def add_tail(self, read: tuple[dict[str, Host], dict]) -> None:
        arrays, meta = read
        kv = {f"{i}." for i in self.disk.kv}
        self.add_block(
            ({k: v for k, v in arrays.items() if k == "tokens" or k[: k.index(".") + 1] in kv}, meta)
        )
        self.tail = {k: v for k, v in arrays.items() if k != "tokens" and k[: k.index(".") + 1] not in kv}
        self.fields = json.loads(meta["layers"])

    def snapshot(self, tokens: list[int], n: int) -> Snapshot:
        """The snapshot of ``tokens[:n]`` (full-attention positions past ``n`` dropped)."""
        layers = []
        for index, layer in enumerate(self.disk.layout):
            fixed = fixed_fields(layer)
            if layer["kind"] == "kv":
                found = {
                    p: _mlx(self.kv[f"{index}.{p}"][..., :n, :], self.codes[f"{index}.{p}"])
                    for p, _ in leaf_paths(layer["leaves"])
                }
                offset, start = n, 0
            else:
                found = {
                    p: _mlx(self.tail[f"{index}.{p}"].data, self.tail[f"{index}.{p}"].code)
                    for p, _ in leaf_paths(layer["leaves"])
                }
                offset, start = self.fields[str(index)]["offset"], self.fields[str(index)]["start"]
            arrays = rebuild(layer["leaves"], found)
            nbytes = sum(a.nbytes for _, a in leaves(arrays))
            fields = {**fixed, "arrays": arrays, "offset": offset, "start": start, "nbytes": nbytes}
            layers.append(LayerState(**{**fields, "kv": self.disk.kv_config}))
        return Snapshot(tuple(tokens[:n]), tuple(layers), self.disk.kv_config)


def _mlx(data: np.ndarray, code: str) -> mx.array:
    a = mx.array(np.ascontiguousarray(data))
    return a.view(mx.bfloat16) if code == "BF16" else a


def save_snapshots(target: CacheOwner, path: str | Path, snapshots: Sequence[Snapshot]) -> int:
    """Write ``snapshots`` of ``target`` to the folder ``path`` (made if
    needed), waiting until they are on disk; returns how many."""
    disk = DiskCache(target, path, max_bytes=None, min_tokens=1)
    for i, snap in enumerate(snapshots):
        if layout_of(snap.layers) != disk.layout:
            raise Hf2qError(f"snapshot {i} holds states of another layout than this model's")
        jobs = disk.plan(snap)
        if not disk.writer.put(jobs):
            disk.flush()
            disk.writer.put(jobs)
    errors = disk.flush()
    if errors:
        raise Hf2qError(f"cannot save the prompt cache: {errors[0]}")
    return len(snapshots)


def load_snapshots(target: CacheOwner, path: str | Path) -> list[Snapshot]:
    """Every snapshot saved in the folder ``path`` for ``target`` (one per
    tail, with the blocks it follows). Raises ``Hf2qError`` naming the file
    for any file that is corrupt, truncated, incomplete or not this model's."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise Hf2qError(f"no prompt cache folder {path}")
    names = sorted(n for n in os.listdir(folder) if NAME.match(n))
    if not names:
        raise Hf2qError(f"{path} holds no prompt cache files")
    disk = DiskCache(target, folder, max_bytes=None, min_tokens=1, writable=False)
    reader = StrictReader(disk)
    return [reader.snapshot(name) for name in names if name.startswith("t-")]


class StrictReader:
    """Reads a saved folder's chains, raising ``Hf2qError`` at the first bad file."""

    def __init__(self, disk: DiskCache):
        self.disk = disk

    def read(self, name: str) -> tuple[dict[str, Host], dict[str, str]]:
        path = self.disk.directory / name
        try:
            arrays, meta = read_file(path)
            start, parent = int(meta["start"]), meta["parent"]
            self.disk.check(name, arrays, meta, parent, start)
            end = name.removesuffix(".safetensors").split("-")[-1]
            if link(parent, arrays["tokens"].data) != end:
                raise CacheFileError("its token ids do not hash to its name")
        except FileNotFoundError:
            raise Hf2qError(f"{path}: missing (the chain of blocks is incomplete)") from None
        except (CacheFileError, KeyError, ValueError) as e:
            raise Hf2qError(f"{path}: {one_line(e)}") from None
        return arrays, meta

    def snapshot(self, tail: str) -> Snapshot:
        """The snapshot a tail ends: its blocks walked back to the chain's root."""
        t_arrays, t_meta = self.read(tail)
        blocks, at = [], t_meta["parent"]
        while at != self.disk.root:
            if len(blocks) * self.disk.block >= int(t_meta["start"]):
                raise Hf2qError(f"{self.disk.directory / tail}: its chain does not reach the start")
            arrays, meta = self.read(block_name(at))
            blocks.append((arrays, meta))
            at = meta["parent"]
        blocks.reverse()
        if int(t_meta["start"]) != len(blocks) * self.disk.block:
            raise Hf2qError(f"{self.disk.directory / tail}: its chain has blocks out of place")
        tokens = [int(t) for arrays, _ in [*blocks, (t_arrays, t_meta)] for t in arrays["tokens"].data]
        parts = Parts(self.disk, len(tokens))
        for i, (arrays, meta) in enumerate(blocks):
            if int(meta["start"]) != i * self.disk.block:
                raise Hf2qError(f"{self.disk.directory / tail}: its chain has blocks out of place")
            parts.add_block((arrays, meta))
        parts.add_tail((t_arrays, t_meta))
        return parts.snapshot(tokens, len(tokens))


def probe_layout(target: CacheOwner) -> Layout:
    """The layout of ``target``'s saved states, read from a state after one token."""
    rt = target.runtime()
    rt.prefill([0], logits="none")
    mx.eval(rt.state())
    return layout_of(rt.snapshot([0]).layers)
