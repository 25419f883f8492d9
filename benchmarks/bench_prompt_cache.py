"""What the prompt cache costs in memory and saves in time to first token.

A conversation of N tokens (a pasted file and an answer), then a next turn
of about 30 new tokens: the time to the first token of that turn with the
Target's prompt cache (its state reused, only the new tokens prefilled)
and without (the whole prompt prefilled), alternating, on the built-in
model in float32; and the memory the cache's snapshot of the conversation
holds.

    python benchmarks/bench_prompt_cache.py [--lengths 256,1024,2048,4096] [--repeats 3] [--results benchmarks/results/prompt_cache.json]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import hf2q_py  # first: loads OpenBLAS before mlx.core

from hf2q_py.errors import Hf2qError, run_script
from hf2q_py.generation import encode_messages
from hf2q_py.prompt_cache import PromptCache
from hf2q_py.tools import results
from hf2q_py.tools.files import check_writable


def conversation(target, n_tokens: int) -> tuple[list[dict], list[dict]]:
    """A pasted text of about ``n_tokens`` tokens with an answer, and the next turn."""
    import inspect
    import json

    text = inspect.getsource(json)
    ids = target.tokenizer.encode(text)
    while len(ids) < n_tokens:
        ids = ids + ids
    pasted = target.tokenizer.decode(ids[: n_tokens - 60])
    first = [{"role": "user", "content": f"Summarise this file:\n\n{pasted}"}]
    answer = "It is the json module: it encodes and decodes JSON."
    follow = [*first, {"role": "assistant", "content": answer},
              {"role": "user", "content": "Which functions does it export? Name them."}]  # fmt: skip
    return first, follow


def first_token_seconds(target, ids: list[int]) -> float:
    t0 = time.perf_counter()
    stream = hf2q_py.stream_generate(target, ids, max_tokens=1, method="baseline")
    for _ in stream:
        break
    stream.close()
    return time.perf_counter() - t0


def measure(target, n: int, repeats: int) -> dict:
    first, follow = conversation(target, n)
    first_ids, follow_ids = encode_messages(target, first), encode_messages(target, follow)
    with_cache, without = [], []
    nbytes = reused = 0
    for _ in range(repeats):
        target.prompt_cache = PromptCache(max_bytes=64 << 30)
        # the earlier turn, kept by the cache
        hf2q_py.generate(target, first_ids, max_tokens=16, method="baseline")
        snap_bytes = target.prompt_cache.nbytes
        stats_before = target.prompt_cache.stats.reused_tokens
        with_cache.append(first_token_seconds(target, follow_ids))
        reused = target.prompt_cache.stats.reused_tokens - stats_before
        nbytes = snap_bytes
        target.prompt_cache = None
        without.append(first_token_seconds(target, follow_ids))
    return {
        "prompt_tokens": len(follow_ids),
        "reused_tokens": reused,
        "snapshot_bytes": nbytes,
        "ttft_cached": with_cache,
        "ttft_uncached": without,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="256,1024,2048,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        raise Hf2qError(f"--lengths must be comma-separated integers, got {args.lengths!r}") from None
    if not lengths or min(lengths) < 128 or args.repeats < 1:
        raise Hf2qError("--lengths must be >= 128 tokens each, --repeats >= 1")
    if args.results:
        check_writable(args.results, "--results file")
    target = hf2q_py.load()
    hf2q_py.generate(target, "Hi", max_tokens=4, method="baseline")  # warm-up
    data = {n: measure(target, n, args.repeats) for n in lengths}
    rows = []
    for n, d in data.items():
        c, u = statistics.median(d["ttft_cached"]), statistics.median(d["ttft_uncached"])
        rows.append([
            str(d["prompt_tokens"]), str(d["reused_tokens"]), f"{u:.3f}", f"{c:.3f}", f"{u / c:.1f}x",
            f"{d['snapshot_bytes'] / 2**20:.1f}", f"{d['snapshot_bytes'] / d['prompt_tokens'] / 1024:.1f}",
        ])  # fmt: skip
    cols = ["next turn's prompt tokens", "reused", "TTFT without s", "TTFT with s", "saved",
            "snapshot MiB", "KiB per token"]  # fmt: skip
    notes = (
        f"Built-in SmolLM2-135M-Instruct, float32; the earlier turn (a pasted file and a 16-token answer) "
        f"ran first; TTFT of the next turn (~30 new tokens) with and without the Target's prompt cache, "
        f"medians of {args.repeats} alternating runs, plain decoding."
    )
    rec = results.record(
        shlex.join(["python", *sys.argv]),
        [results.table(cols, rows, "rrrrrrr")],
        notes=notes,
        data={str(n): d for n, d in data.items()},
    )
    results.publish(rec, args.results)


if __name__ == "__main__":
    run_script(main)
