"""Grammar engines for constrained decoding, measured on real vocabularies:
llguidance, xgrammar and outlines-core, the same JSON schema, the same
valid document walked token by token.

    python benchmarks/bench_grammar_engines.py [--qwen-gguf PATH|none] [--repeats 5] \
        [--results benchmarks/results/grammar_engines.json]

Per engine and vocabulary (the built-in SmolLM2's 49,152 tokens; Qwen2.5's
151,936 from the Qwen2.5-Coder 0.5B GGUF, see ``qwen_gguf.py``): the time to
prepare the vocabulary, to compile the schema (for llguidance, whose
compilation is lazy, construction plus the first mask), one next-token
bitmask per position of the document (median, 90th percentile), and one
speculative round's worth of masks: the 9 masks of 8 drafted tokens (advance
through the drafts, fill a mask at each position, roll back), as hf2q-py's
``Constraint.plan`` does. Also the engine-independent cost of turning 9
bitmask rows into MLX boolean masks.

xgrammar imports ``torch`` when it is imported (its Linux wheel depends on
torch and CUDA, gigabytes); where torch is not installed, the benchmark gives
it a stand-in module named ``torch`` before the import: its matcher runs in
C++ and takes the bitmask through DLPack (here a numpy array), so the
numbers are its own.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hf2q_py

import hf2q_py  # noqa: E402, F401  first: OpenBLAS before mlx.core

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from hf2q_py.constraints import bitmask_to_mlx  # noqa: E402
from hf2q_py.errors import Hf2qError, run_script  # noqa: E402
from hf2q_py.loaders.builtin import builtin_model_path  # noqa: E402
from hf2q_py.loaders.gguf_file import read_header  # noqa: E402
from hf2q_py.loaders.gguf_tokenizer import tokenizer_from_gguf  # noqa: E402
from hf2q_py.tools import results  # noqa: E402
from hf2q_py.tools.files import check_writable  # noqa: E402

#: An agent-shaped schema: strings, an integer, an enum, an array, a nested object.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "editor",
    "tags": ["mathematics", "poetry", "analytical engine", "notes on Menabrea"],
    "address": {"city": "London", "zip": "W1J 7NT"},
}
DRAFTS = 8


@dataclass
class Vocab:
    name: str
    wrapper: Any  # mlx-lm TokenizerWrapper
    size: int  # the model's logits width

    @property
    def hf(self) -> Any:
        return self.wrapper._tokenizer

    @property
    def eos(self) -> list[int]:
        return sorted(self.wrapper.eos_token_ids)


@dataclass
class Row:
    engine: str
    vocab: str
    vocab_seconds: float
    compile_seconds: float
    mask_us: list[float] = field(default_factory=list)
    round_us: list[float] = field(default_factory=list)


# -- the engines: prepare the vocabulary, compile, and a matcher's five moves ------------------
class Engine:
    name = ""

    def vocabulary(self, v: Vocab) -> Any: ...
    def compile(self, prepared: Any, schema: dict) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, m: Any, bitmask: np.ndarray, row: int) -> None: ...
    def advance(self, m: Any, token: int) -> None: ...
    def rollback(self, m: Any, n: int) -> None: ...


class Llguidance(Engine):
    name = "llguidance"

    def __init__(self):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg, self.np = llguidance, llguidance.numpy

    def vocabulary(self, v: Vocab) -> Any:
        return self.llg.hf.from_tokenizer(v.hf, n_vocab=v.size, eos_token=v.eos)

    def compile(self, prepared: Any, schema: dict) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        m = self.llg.LLMatcher(prepared, grammar)
        bitmask = self.np.allocate_token_bitmask(1, prepared.vocab_size)
        self.np.fill_next_token_bitmask(m, bitmask, 0)  # compilation is lazy: the first mask finishes it
        if m.is_error():
            raise Hf2qError(f"llguidance: {m.get_error()}")
        return m

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, m, bitmask, row):
        self.np.fill_next_token_bitmask(m, bitmask, row)

    def advance(self, m, token):
        if not m.consume_token(token):
            raise Hf2qError(f"llguidance refused token {token}: {m.get_error()}")

    def rollback(self, m, n):
        m.rollback(n)


class Xgrammar(Engine):
    name = "xgrammar"
    stand_in = False

    def __init__(self):
        try:
            import torch  # noqa: F401
        except ImportError:
            import tvm_ffi  # noqa: F401  imported before the stand-in, so it finds no torch

            sys.modules["torch"] = _StandInTorch("torch")
            Xgrammar.stand_in = True
        try:
            import xgrammar
        finally:
            if Xgrammar.stand_in:
                del sys.modules["torch"]
        self.xgr = xgrammar

    def vocabulary(self, v: Vocab) -> Any:
        info = self.xgr.TokenizerInfo.from_huggingface(v.hf, vocab_size=v.size, stop_token_ids=v.eos)
        return self.xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, prepared: Any, schema: dict) -> Any:
        return prepared.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled, max_rollback_tokens=DRAFTS + 1)

    def fill(self, m, bitmask, row):
        m.fill_next_token_bitmask(bitmask, row)

    def advance(self, m, token):
        if not m.accept_token(token):
            raise Hf2qError(f"xgrammar refused token {token}")

    def rollback(self, m, n):
        m.rollback(n)


class _StandInTorch(types.ModuleType):
    """Enough of a module named ``torch`` for ``import xgrammar`` (names only)."""

    Tensor = type("Tensor", (), {})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__call__": lambda self, *a, **k: None})()
        setattr(self, name, value)
        return value


class OutlinesCore(Engine):
    name = "outlines-core"

    def __init__(self):
        import outlines_core

        self.oc = outlines_core

    def vocabulary(self, v: Vocab) -> Any:
        """outlines-core's Vocabulary: each token's bytes (byte-level BPE undone), EOS apart."""
        byte_of = _byte_level_chars()
        special = set(v.hf.all_special_ids)
        tokens: dict[bytes, list[int]] = {}
        for text, i in v.hf.get_vocab().items():
            if i in special or i in v.eos:
                continue
            raw = bytes(byte_of[c] for c in text) if all(c in byte_of for c in text) else text.encode()
            tokens.setdefault(raw, []).append(i)
        return self.oc.Vocabulary(v.eos[0], tokens), v.size

    def compile(self, prepared: Any, schema: dict) -> Any:
        vocabulary, size = prepared
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, vocabulary), size

    def matcher(self, compiled: Any) -> Any:
        index, _ = compiled
        return self.oc.Guide(index, max_rollback=DRAFTS + 1)

    def fill(self, m, bitmask, row):
        view = bitmask[row]
        m.write_mask_into(view.ctypes.data, view.size, 4)

    def advance(self, m, token):
        m.advance(token, return_tokens=False)

    def rollback(self, m, n):
        m.rollback_state(n)


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character for each byte, inverted."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(extra)}
    return {c: b for b, c in chars.items()}


ENGINES: dict[str, Callable[[], Engine]] = {
    "llguidance": Llguidance,
    "xgrammar": Xgrammar,
    "outlines-core": OutlinesCore,
}


# -- measuring ---------------------------------------------------------------------------------
def measure(engine: Engine, v: Vocab, repeats: int) -> Row:
    ids = v.hf.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    t0 = time.perf_counter()
    prepared = engine.vocabulary(v)
    vocab_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = engine.compile(prepared, SCHEMA)
    row = Row(engine.name, v.name, vocab_seconds, time.perf_counter() - t0)
    bitmask = np.zeros((DRAFTS + 1, (v.size + 31) // 32), dtype=np.int32)
    for _ in range(repeats):
        m = engine.matcher(compiled)
        for t in ids:  # one mask per position, then the document's token
            s = time.perf_counter()
            engine.fill(m, bitmask, 0)
            row.mask_us.append((time.perf_counter() - s) * 1e6)
            engine.advance(m, t)
        m = engine.matcher(compiled)
        for i in range(len(ids) - DRAFTS):  # a round at every position: 9 masks over 8 drafts, rolled back
            drafts = ids[i : i + DRAFTS]
            s = time.perf_counter()
            for j, d in enumerate(drafts):
                engine.fill(m, bitmask, j)
                engine.advance(m, d)
            engine.fill(m, bitmask, DRAFTS)
            engine.rollback(m, DRAFTS)
            row.round_us.append((time.perf_counter() - s) * 1e6)
            engine.advance(m, ids[i])
    return row


def to_mlx_us(size: int, repeats: int) -> list[float]:
    """Microseconds to turn 9 bitmask rows into a (9, size) boolean MLX array
    (``hf2q_py.constraints.bitmask_to_mlx``), evaluated."""
    bitmask = np.random.default_rng(0).integers(
        -(2**31), 2**31 - 1, (DRAFTS + 1, (size + 31) // 32), np.int32
    )
    out = []
    for _ in range(max(repeats * 20, 20)):
        s = time.perf_counter()
        mx.eval(bitmask_to_mlx(bitmask, size))
        out.append((time.perf_counter() - s) * 1e6)
    return out


def vocabularies(qwen: str) -> list[Vocab]:
    out = []
    for name, path in (("SmolLM2 (built-in)", builtin_model_path()), ("Qwen2.5", qwen)):
        if path == "none":
            continue
        if path == "auto":
            from qwen_gguf import qwen_coder_gguf

            path = qwen_coder_gguf()
        meta = read_header(Path(path)).metadata
        size = meta.get(f"{meta['general.architecture']}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
        out.append(Vocab(name, tokenizer_from_gguf(meta), int(size)))
    return out


def _p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, of: " + ", ".join(ENGINES))
    ap.add_argument(
        "--qwen-gguf",
        default="auto",
        help="the Qwen2.5-Coder GGUF for the 151,936-token vocabulary; auto: assembled from the "
        "installed part wheels (qwen_gguf.py); none: skip it",
    )
    ap.add_argument("--repeats", type=int, default=5, help="walks of the document per engine and vocabulary")
    ap.add_argument("--results", default=None, help="also write a results file (JSON) here")
    args = ap.parse_args()
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if unknown or not names:
        raise Hf2qError(f"--engines: unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}")
    if args.repeats < 1:
        raise Hf2qError("--repeats must be >= 1")
    if args.results:
        check_writable(args.results, "--results file")
    vocabs = vocabularies(args.qwen_gguf)
    rows = []
    for name in names:
        engine = ENGINES[name]()
        for v in vocabs:
            rows.append(measure(engine, v, args.repeats))
            print(f"{name} on {v.name}: done", file=sys.stderr, flush=True)
    cells = [
        [r.engine, r.vocab, f"{r.vocab_seconds * 1e3:.0f}", f"{r.compile_seconds * 1e3:.1f}",
         f"{statistics.median(r.mask_us):.1f}", f"{_p90(r.mask_us):.1f}", f"{statistics.median(r.round_us):.1f}"]
        for r in rows
    ]  # fmt: skip
    convert = {v.name: to_mlx_us(v.size, args.repeats) for v in vocabs}
    conv_cells = [[name, f"{statistics.median(us):.1f}"] for name, us in convert.items()]
    engines_table = results.table(
        ["engine", "vocabulary", "prepare vocabulary ms", "compile schema ms", "mask us (median)",
         "mask us (p90)", "8-draft round us (median)"],
        cells, "llrrrrr", title="One JSON schema, one valid document walked token by token",
    )  # fmt: skip
    conv_table = results.table(
        ["vocabulary", "9 bitmask rows -> MLX bool (9, V) us"], conv_cells, "lr",
        title="Bitmask to MLX, any engine",
    )  # fmt: skip
    stand_in = (
        " xgrammar ran with a stand-in module named torch (torch is not installed)."
        if Xgrammar.stand_in
        else ""
    )
    notes = (
        f"{args.repeats} walks of a {len(json.dumps(DOCUMENT))}-character document per engine and vocabulary, "
        f"one thread. An 8-draft round: fill a mask, advance by a draft, 8 times, a 9th mask, roll back 8."
        + stand_in
    )
    data = {
        "schema": SCHEMA,
        "document": DOCUMENT,
        "rows": [r.__dict__ for r in rows],
        "to_mlx_us": convert,
        "xgrammar_stand_in_torch": Xgrammar.stand_in,
    }
    rec = results.record(
        shlex.join(["python", *sys.argv]), [engines_table, conv_table], notes=notes, data=data
    )
    results.publish(rec, args.results)


if __name__ == "__main__":
    run_script(main)
