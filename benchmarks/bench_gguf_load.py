"""Where a GGUF load spends its time: header, tokenizer, tensor decoding,
model build, each phase on its own, then the whole ``hf2q_py.load``.

    flock /tmp/hf2q-cpu.lock python benchmarks/bench_gguf_load.py model.gguf
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import hf2q_py  # first: OpenBLAS before mlx.core

import mlx.core as mx
import mlx_lm.utils  # noqa: F401  (import time is not load time)

from hf2q_py.loaders.gguf import plan_gguf
from hf2q_py.loaders.gguf_tensors import read_tensors
from hf2q_py.loaders.gguf_tokenizer import tokenizer_from_gguf
from hf2q_py.errors import run_script  # noqa: E402


def clock(label: str, fn):
    start = time.perf_counter()
    out = fn()
    print(f"{label:<34} {time.perf_counter() - start:7.2f} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    path = Path(ap.parse_args().gguf)
    header, spec, cfg = clock("header + checks (plan_gguf)", lambda: plan_gguf(path))
    types = Counter(t.type_name for t in header.tensors.values())
    print(f"  {header.architecture}, {len(header.tensors)} tensors: {dict(types)}")
    clock("tokenizer", lambda: tokenizer_from_gguf(header.metadata))

    def tensors():
        t = read_tensors(header)
        mx.eval(t)
        return t

    clock("tensors read + decoded (float32)", tensors)
    clock("hf2q_py.load (all, overlapped)", lambda: hf2q_py.load(path))


if __name__ == "__main__":
    run_script(main)
