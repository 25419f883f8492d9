"""The n-gram proposers alone: cost per round at long contexts (no model).

    python benchmarks/bench_ngram_index.py [--context 32768] [--results benchmarks/results/ngram_cost_per_round.json]

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
import shlex
import statistics
import sys
import time

from hf2q_py.memory import DraftMemory
from hf2q_py.tools import results
from hf2q_py.tools.files import check_writable
from hf2q_py.proposers.ngram import NgramProposer, lookup_by_rescan
from hf2q_py.proposers.suffix import SuffixProposer
from hf2q_py.errors import run_script  # noqa: E402


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
    ap.add_argument("--results", default=None, help="also write a results file (JSON) here")
    args = ap.parse_args()
    if args.results:
        check_writable(args.results, "--results file")
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
    lookup = results.table(
        ["what", "time"],
        [
            [f"index the {args.context}-token prompt once", f"{build * 1e3:.1f} ms"],
            [
                f"per round, incremental index (median of {args.rounds})",
                f"{statistics.median(inc) * 1e6:.1f} us",
            ],
            ["per round, incremental index (max)", f"{max(inc) * 1e6:.1f} us"],
            [f"per round, full rescan (median of {len(naive)})", f"{statistics.median(naive) * 1e3:.2f} ms"],
        ],
        "lr",
        title="Lookup proposer (n-grams of 1-5, K 16; draft key and drafts per round):",
    )

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
    suffix = results.table(
        ["what", "time"],
        [
            [f"build the automaton over the {args.context}-token prompt once", f"{build * 1e3:.1f} ms"],
            [f"per round (median of {args.rounds})", f"{statistics.median(times) * 1e6:.1f} us"],
            ["per round (mean)", f"{statistics.mean(times) * 1e6:.1f} us"],
            ["per round (max)", f"{max(times) * 1e6:.1f} us"],
            ["mean drafts per round", f"{drafted / args.rounds:.1f}"],
        ],
        "lr",
        title="Suffix proposer (K 32, a memory of 4096 earlier tokens; draft key and drafts per round):",
    )
    rec = results.record(
        shlex.join(["python", *sys.argv]),
        [lookup, suffix],
        notes=f"A context of {args.context} tokens of standard library source; each round "
        "commits 1-4 tokens, then asks for the draft key and the drafts.",
    )
    results.publish(rec, args.results)


if __name__ == "__main__":
    run_script(main)
