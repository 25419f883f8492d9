"""The memory budget's models against what MLX allocates, in this process:

1. the activation allowance (``hf2q_py.budget``) of a 512-token prefill
   chunk at several contexts and of a batched round (4 rows x 9 positions),
   against the peak each takes over the memory active before it
   (``mx.get_peak_memory`` after ``mx.reset_peak_memory``; a prefill's own
   KV growth left out, since reservations hold it);
2. MLX's buffer cache over a long batched run with the scheduler giving it
   back (``mx.clear_cache``, the default cadence) and without, the cache
   limit raised to 4 GiB as on Metal (where it may grow to the memory limit).

    python benchmarks/bench_memory_budget.py [--model PATH] [--contexts 512,1024,2048] [--requests 48]
        [--results benchmarks/results/memory_budget.json]
"""

from __future__ import annotations

import argparse
import shlex
import sys

import hf2q_py  # first: loads OpenBLAS before mlx.core

import mlx.core as mx

from hf2q_py.batch.cache import STEP
from hf2q_py.batch.runtime import BatchRuntime
from hf2q_py.budget import MemoryPrices, arrays_bytes, format_bytes
from hf2q_py.errors import run_script
from hf2q_py.generation import make_config
from hf2q_py.scheduler import Scheduler, SchedulerConfig, Sink
from hf2q_py.tools import results
from hf2q_py.tools.files import check_writable


class Quiet(Sink):
    def chunk(self, chunk) -> None: ...

    def done(self, stats, error=None) -> None: ...


def peak_of(fn) -> int:
    """What ``fn`` takes at its peak over the memory active before it."""
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    fn()
    return mx.get_peak_memory() - base


def ids(n: int, seed: int, vocab: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % (vocab - 3) + 3 for i in range(n)]


def allowance_rows(target, contexts: list[int]) -> list[list[str]]:
    prices, kv, vocab = MemoryPrices(target, 512), target.kv, target.vocab_size
    rows = []
    for context in contexts:
        rt = target.runtime()
        if context > 512:
            rt.prefill(ids(context - 512, 1, vocab), logits="none")
            mx.eval(rt.state())
        held = arrays_bytes([rt.state()])
        peak = peak_of(lambda: mx.eval(rt.prefill(ids(512, 2, vocab), logits="none").hidden, rt.state()))  # noqa: B023
        took = peak - (arrays_bytes([rt.state()]) - held)
        allowed = prices.shape.bytes(1, 512, context + STEP, 0) + prices.layer(context + STEP, kv)
        rows.append([f"prefill chunk of 512 at {context}", format_bytes(took), format_bytes(allowed),
                     f"{allowed / took:.1f}x"])  # fmt: skip
    batch = BatchRuntime(target)
    for i in range(4):
        rt = target.runtime()
        rt.prefill(ids(400 + 200 * i, i, vocab), logits="none")
        batch.add(i, rt)
    mx.eval(batch.forward([[5] * 9] * 4).logits, batch.state())
    columns = max(t.capacity for t in batch.tables.values())
    took = peak_of(lambda: mx.eval(batch.forward([[6] * 9] * 4).logits, batch.state()))
    allowed = prices.shape.bytes(4, 9, columns, 36) + 4 * prices.layer(columns, kv)
    rows.append([f"batched round, 4 rows x 9 at {columns} columns", format_bytes(took), format_bytes(allowed),
                 f"{allowed / took:.1f}x"])  # fmt: skip
    return rows


def cache_run(target, every: int, requests: int) -> list[int]:
    """MLX's cache after each step of a batched run (4 at a time)."""
    sched = Scheduler(target, SchedulerConfig(max_batch=4, prefill_chunk=64, clear_cache_every=every))
    for i in range(requests):
        config = make_config(max_tokens=40 + 13 * (i % 5), method="baseline")
        sched.submit(ids(50 + 37 * (i % 7), i, target.vocab_size), config, Quiet())
    mx.clear_cache()
    sizes = []
    while not sched.idle:
        sched.step()
        sizes.append(mx.get_cache_memory())
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the built-in model")
    ap.add_argument("--contexts", default="512,1024,2048")
    ap.add_argument("--requests", type=int, default=48, help="requests of the buffer-cache run")
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    if args.results:
        check_writable(args.results, "--results file")
    target = hf2q_py.load(args.model) if args.model else hf2q_py.load()
    contexts = [int(c) for c in args.contexts.split(",")]
    allowance = allowance_rows(target, contexts)
    limit = mx.set_cache_limit(4 << 30)
    try:
        runs = {"never": cache_run(target, 0, args.requests), "every 256 steps and after ends": cache_run(target, 256, args.requests)}  # fmt: skip
    finally:
        mx.set_cache_limit(limit)
    cache_rows = []
    for name, sizes in runs.items():
        sixth = max(1, len(sizes) // 6)
        tops = [max(sizes[i : i + sixth]) for i in range(0, sixth * 6, sixth)]
        cache_rows.append([name, str(len(sizes)), *(format_bytes(t) for t in tops)])
    tables = [
        results.table(["forward", "measured peak", "allowance", "allowance / peak"], allowance, "lrrr"),
        results.table(
            ["mx.clear_cache", "steps", *(f"sixth {i + 1}" for i in range(6))],
            cache_rows,
            "lr" + "r" * 6,
            title="MLX's buffer cache, highest in each sixth of the run",
        ),  # fmt: skip
    ]
    notes = (f"{args.model or 'the built-in SmolLM2-135M-Instruct'}, {target.kv.describe()}; buffer cache: "
             f"{args.requests} requests of 50-272 prompt tokens and 40-92 new tokens, 4 at a time, plain decoding.")  # fmt: skip
    rec = results.record(shlex.join(["python", *sys.argv]), tables, notes=notes,
                         data={"allowance": allowance, "cache": runs})  # fmt: skip
    results.publish(rec, args.results)


if __name__ == "__main__":
    run_script(main)
