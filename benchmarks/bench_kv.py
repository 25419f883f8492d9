"""Quantized KV caches: what they save and what they cost.

For each model: (a) the KV bytes per token at full precision, 8 and 4 bits
(as a float16 model stores them on a Mac, and as this run's float32 model
does), and the longest context whose KV fits in a fixed budget after the
weights; (b) decode tokens per second of plain decoding and of n-gram
speculation with each KV layout, speculation's speed-up over plain decoding
with the same layout, whether every method's answer equals plain decoding
with the same bits, and whether a quantized answer differs from the
full-precision one (and at which token). The layouts alternate in each
repeat, on one loaded model.

    python benchmarks/bench_kv.py [--models builtin,PATH.gguf] [--budget 8GiB] [--repeats 3]
        [--max-tokens 128] [--results benchmarks/results/kv_quant.json]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from typing import Any

import hf2q_py  # first: loads OpenBLAS before mlx.core

import mlx.core as mx
from mlx.utils import tree_flatten

from hf2q_py.errors import Hf2qError, run_script
from hf2q_py.kv import FULL_PRECISION, KVConfig, kv_bytes_per_token
from hf2q_py.tools import results
from hf2q_py.tools.files import check_writable
from hf2q_py.tools.workloads import default_workloads

LAYOUTS = {"full": FULL_PRECISION, "8-bit": KVConfig(8, 64, 0), "4-bit": KVConfig(4, 64, 0)}
METHODS = ("baseline", "ngram")
#: A code edit (n-gram speculation copies most of the answer) and fresh code (it copies little).
WORKLOADS = ("code: rename (textwrap.dedent)", "fresh: lru cache")


def parse_size(text: str) -> int:
    """``8GiB``, ``640MB``, ``12GB`` or bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for unit, scale in units.items():
        if t.endswith(unit) and t[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * scale)
    if t.isdigit():
        return int(t)
    raise Hf2qError(f"--budget: not a size: {text!r} (use e.g. 8GiB, 640MB or bytes)")


def weight_bytes(target: Any) -> int:
    return sum(v.nbytes for _, v in tree_flatten(target.model.parameters()))


def footprint_rows(name: str, target: Any, budget: int) -> list[list[str]]:
    """(a): bytes per token and the longest context in ``budget`` per layout."""
    rows, weights = [], weight_bytes(target)
    half = kv_bytes_per_token(target, FULL_PRECISION, dtype=mx.float16)
    for label, kv in LAYOUTS.items():
        per16 = kv_bytes_per_token(target, kv, dtype=mx.float16)
        here = kv_bytes_per_token(target, kv)
        fits = max(0, budget - weights) // max(1, int(here))
        rows.append([name, label, f"{per16:,.0f}", f"{per16 / half:.3f}x", f"{here:,.0f}", f"{fits:,}"])
    return rows


def run(target: Any, prompt: str, method: str, kv: KVConfig, max_tokens: int) -> tuple[list[int], float]:
    """One generation's tokens and its decode tokens per second."""
    target.memory.clear()
    t0 = time.perf_counter()
    r = hf2q_py.generate(target, prompt, max_tokens=max_tokens, method=method, kv=kv)
    return r.tokens, r.stats.tokens_per_second or len(r.tokens) / (time.perf_counter() - t0)


def first_difference(a: list[int], b: list[int]) -> int | None:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return n if n is not None or len(a) == len(b) else min(len(a), len(b))


def speed_rows(name: str, target: Any, repeats: int, max_tokens: int) -> tuple[list[list[str]], dict]:
    """(b): decode speed per layout and method, alternating, with the answers compared."""
    prompts = {w.name: w.prompt for w in default_workloads() if w.name in WORKLOADS}
    rates: dict[tuple[str, str, str], list[float]] = {}
    answers: dict[tuple[str, str, str], list[int]] = {}
    run(target, prompts[WORKLOADS[0]], "baseline", FULL_PRECISION, 8)  # warm-up
    for r in range(repeats):
        order = [(w, label, m) for w in prompts for label in LAYOUTS for m in METHODS]
        for w, label, m in order if r % 2 == 0 else reversed(order):
            tokens, tps = run(target, prompts[w], m, LAYOUTS[label], max_tokens)
            rates.setdefault((w, label, m), []).append(tps)
            answers[(w, label, m)] = tokens
    rows = []
    for w in prompts:
        for label in LAYOUTS:
            plain = statistics.median(rates[(w, label, "baseline")])
            spec = statistics.median(rates[(w, label, "ngram")])
            same = answers[(w, label, "ngram")] == answers[(w, label, "baseline")]
            diff = first_difference(answers[(w, label, "baseline")], answers[(w, "full", "baseline")])
            rows.append([name, w, label, f"{plain:.1f}", f"{spec:.1f}", f"{spec / plain:.2f}x",
                         "yes" if same else "NO", "none" if diff is None else f"token {diff}"])  # fmt: skip
    data = {f"{w}|{label}|{m}": v for (w, label, m), v in rates.items()}
    return rows, data


def load(name: str) -> Any:
    return hf2q_py.load(dtype="float32") if name == "builtin" else hf2q_py.load(name, dtype="float32")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="builtin", help="comma-separated: builtin, GGUF files, folders")
    ap.add_argument("--budget", default="8GiB", help="memory for weights and KV, for the longest context")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--results", default=None, help="also write a results file (JSON) here")
    args = ap.parse_args()
    if args.results:
        check_writable(args.results, "--results file")
    budget = parse_size(args.budget)
    sizes, speeds, data = [], [], {}
    for name in args.models.split(","):
        target = load(name)
        label = name if name == "builtin" else name.rsplit("/", 1)[-1]
        sizes += footprint_rows(label, target, budget)
        rows, data[label] = speed_rows(label, target, args.repeats, args.max_tokens)
        speeds += rows
        del target
        mx.clear_cache()
    tables = [
        results.table(["model", "KV", "bytes/token (16-bit model)", "vs 16-bit", "bytes/token (this run)",
                       f"longest context in {args.budget}"], sizes, "llrrrr", "KV bytes per token"),
        results.table(["model", "workload", "KV", "plain tok/s", "n-gram tok/s", "speed-up",
                       "n-gram = plain (same KV)", "plain vs full precision"], speeds, "lllrrrll",
                      "Decode speed by KV layout"),
    ]  # fmt: skip
    notes = (
        f"float32 weights (this CPU), KV group size 64, {args.max_tokens} new tokens, medians of "
        f"{args.repeats} repeats alternating layouts and methods on one loaded model; the longest "
        f"context is ({args.budget} - the weights as loaded here) / this run's KV bytes per token."
    )
    rec = results.record(shlex.join(["python", *sys.argv]), tables, notes=notes, data=data)
    results.publish(rec, args.results)


if __name__ == "__main__":
    run_script(main)
