"""Plain decoding: hf2q-py's baseline against mlx-lm's own stream_generate on
the same loaded model (built-in SmolLM2-135M, float32), alternating in one run.

    python benchmarks/bench_baseline.py [--repeats 5] [--max-tokens 128] [--results benchmarks/results/baseline.json]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import hf2q_py  # first: loads OpenBLAS before mlx.core

from mlx_lm import stream_generate as mlx_stream_generate
from mlx_lm.sample_utils import make_sampler

from hf2q_py.tools import results
from hf2q_py.tools.files import check_writable
from hf2q_py.errors import run_script  # noqa: E402

PROMPT = "Write a long, detailed story about a cartographer who maps an island that keeps changing shape."


def run_mlx_lm(target, ids, max_tokens):
    sampler = make_sampler(0.0)
    t0 = time.perf_counter()
    first = None
    n = 0
    tokens = []
    for resp in mlx_stream_generate(
        target.model, target.tokenizer, ids, max_tokens=max_tokens, sampler=sampler
    ):
        if first is None:
            first = time.perf_counter()
        if resp.token in target.eos_token_ids:
            break
        tokens.append(resp.token)
        n += 1
    end = time.perf_counter()
    return first - t0, (n - 1) / (end - first), tokens


def run_hf2q(target, ids, max_tokens):
    t0 = time.perf_counter()
    first = None
    tokens = []
    for chunk in hf2q_py.stream_generate(target, ids, max_tokens=max_tokens, method="baseline"):
        if first is None:
            first = time.perf_counter()
        tokens += chunk.tokens
    end = time.perf_counter()
    return first - t0, (len(tokens) - 1) / (end - first), tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--results", default=None, help="also write a results file (JSON) here")
    args = ap.parse_args()
    if args.results:
        check_writable(args.results, "--results file")
    target = hf2q_py.load(dtype="float32")
    ids = hf2q_py.encode_prompt(target, PROMPT)
    ttft = {"mlx-lm": [], "hf2q-py": []}
    rate = {"mlx-lm": [], "hf2q-py": []}
    same = True
    run_hf2q(target, ids, 8)  # warm-up
    for r in range(args.repeats):
        order = [("mlx-lm", run_mlx_lm), ("hf2q-py", run_hf2q)]
        if r % 2:
            order.reverse()
        out = {}
        for name, fn in order:
            t, tps, toks = fn(target, ids, args.max_tokens)
            ttft[name].append(t)
            rate[name].append(tps)
            out[name] = toks
        same &= out["mlx-lm"] == out["hf2q-py"]
    med = {k: statistics.median(v) for k, v in rate.items()}
    pre = {k: len(ids) / statistics.median(v) for k, v in ttft.items()}
    rows = [[k, f"{pre[k]:.0f}", f"{med[k]:.2f}"] for k in ("mlx-lm", "hf2q-py")]
    rows.append(
        [
            "hf2q-py / mlx-lm",
            f"{pre['hf2q-py'] / pre['mlx-lm']:.3f}x",
            f"{med['hf2q-py'] / med['mlx-lm']:.3f}x",
        ]
    )
    notes = (
        f"Built-in SmolLM2-135M-Instruct, float32, prompt {len(ids)} tokens, {args.max_tokens} new tokens, "
        f"medians of {args.repeats} alternating runs on the same loaded model; identical tokens: {same}."
    )
    rec = results.record(
        shlex.join(["python", *sys.argv]),
        [results.table(["engine", "prefill tok/s (to first token)", "decode tok/s"], rows, "lrr")],
        notes=notes,
        data={
            "ttft_seconds": ttft,
            "decode_tok_s": rate,
            "identical": same,
            "prompt_tokens": len(ids),
            "max_tokens": args.max_tokens,
        },
    )
    results.publish(rec, args.results)


if __name__ == "__main__":
    run_script(main)
