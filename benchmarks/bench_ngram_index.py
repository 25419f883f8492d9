"""The n-gram proposers alone: cost per round at long contexts (no model).

    python benchmarks/bench_ngram_index.py [--context 32768]

Builds a context from Python standard-library source (real, repetitive
text), tokenized with the built-in model's tokenizer when available
(else one id per byte), then times rounds of "commit a few tokens, look up
drafts" with the lookup proposer's incremental index (against a rescan of
the whole context per round for reference) and with the suffix proposer's
automaton (drafts up to 32, with a memory of 4096 earlier tokens).
"""

from __future__ import annotations

import argparse
import inspect
import random
import statistics
import time

from hf2q_py.memory import DraftMemory
from hf2q_py.proposers.ngram import NgramProposer, lookup_by_rescan
from hf2q_py.proposers.suffix import SuffixProposer


def stdlib_tokens(n: int) -> list[int]:
    import argparse as a
    import json
    import textwrap
    import typing
    import dataclasses
    import inspect as i
    import pathlib

    text = "".join(inspect.getsource(m) for m in (a, json.decoder, textwrap, typing, dataclasses, i, pathlib))
    try:
        import hf2q_py

        tok = hf2q_py.load().tokenizer
        ids = tok.encode(text)
    except Exception:
        ids = list(text.encode())
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    ids = stdlib_tokens(args.context + args.rounds * 4)
    rng = random.Random(0)
    prompt = ids[: args.context]

    t0 = time.perf_counter()
    p = NgramProposer(1, 5)
    p.start(None, prompt, {}, None)
    build = time.perf_counter() - t0

    tokens = list(prompt)
    pos = args.context
    inc, naive = [], []
    for r in range(args.rounds):
        step = rng.randint(1, 4)
        tokens += ids[pos : pos + step]
        pos += step
        t = time.perf_counter()
        p.draft_key(tokens)  # the engine asks for the match depth first
        d = p.propose(tokens, 16).tokens
        inc.append(time.perf_counter() - t)
        if r < 20:
            t = time.perf_counter()
            assert lookup_by_rescan(tokens, 1, 5, 16) == d
            naive.append(time.perf_counter() - t)
    print(f"n-gram proposer (min 1, max 5, k 16; draft key + drafts), context {args.context} tokens of stdlib source\n")
    print("| what | time |")
    print("|---|---:|")
    print(f"| index the {args.context}-token prompt once | {build * 1e3:.1f} ms |")
    print(f"| per round, incremental index (median of {args.rounds}) | {statistics.median(inc) * 1e6:.1f} us |")
    print(f"| per round, incremental index (max) | {max(inc) * 1e6:.1f} us |")
    print(f"| per round, full rescan (median of {len(naive)}) | {statistics.median(naive) * 1e3:.2f} ms |")

    memory = DraftMemory()
    memory.add(ids[args.context // 2 : args.context // 2 + 4096])
    t0 = time.perf_counter()
    p = SuffixProposer(memory=memory)
    p.start(None, prompt, {}, None)
    build = time.perf_counter() - t0
    tokens = list(prompt)
    pos = args.context
    times, drafted = [], 0
    for r in range(args.rounds):
        step = rng.randint(1, 4)
        tokens += ids[pos : pos + step]
        pos += step
        t = time.perf_counter()
        p.draft_key(tokens)
        drafted += len(p.propose(tokens, 32))
        times.append(time.perf_counter() - t)
    print("\nsuffix proposer (k 32, memory of 4096 tokens; draft key + drafts), same context\n")
    print("| what | time |")
    print("|---|---:|")
    print(f"| build the automaton over the {args.context}-token prompt once | {build * 1e3:.1f} ms |")
    print(f"| per round (median of {args.rounds}) | {statistics.median(times) * 1e6:.1f} us |")
    print(f"| per round (mean) | {statistics.mean(times) * 1e6:.1f} us |")
    print(f"| per round (max) | {max(times) * 1e6:.1f} us |")
    print(f"| mean drafts per round | {drafted / args.rounds:.1f} |")


if __name__ == "__main__":
    main()
