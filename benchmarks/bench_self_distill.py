"""Self-distillation throughput on the built-in model (SmolLM2-135M, float32):
training answers per hour one at a time (as ``train-dflash`` made them before
batching: greedy generation with n-gram speculation, then one target pass per
sequence for the training features) against ``train-dflash``'s batched data
phase (``dflash_data.self_distill``) at several batch sizes, with the features
taken by a separate target pass or captured while generating. Every setting
answers the same prompts in one process; answers are compared with the
one-at-a-time answers.

    python benchmarks/bench_self_distill.py --prompts 16 --batches 1,8,16,32 \\
        --out benchmarks/results/self_distill_smollm2.json --lock /tmp/hf2q-cpu.lock
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hf2q_py

import hf2q_py  # noqa: E402  first: OpenBLAS before mlx.core

import mlx.core as mx  # noqa: E402

from hf2q_py.tools import results  # noqa: E402
from hf2q_py.tools.dflash_data import GenerationTimes, batched_answers, default_prompts, self_distill  # noqa: E402
from hf2q_py.tools.dflash_train import TrainConfig, target_pass  # noqa: E402
from hf2q_py.tools.files import check_writable  # noqa: E402
from hf2q_py.errors import run_script  # noqa: E402


def feature_pass(target, sequences: list[list[int]], layers: list[int]) -> float:
    """Seconds of the training pass (``target_pass``) over every sequence."""
    t0 = time.perf_counter()
    for seq in sequences:
        out = target_pass(target, seq, layers)
        mx.eval(out)
    return time.perf_counter() - t0


def one_at_a_time(target, prompts, max_new_tokens, layers, method) -> dict:
    t0 = time.perf_counter()
    answers, prefill = [], 0.0
    for ids in prompts:
        r = hf2q_py.generate(target, ids, max_tokens=max_new_tokens, method=method)
        answers.append(r.tokens)
        prefill += r.stats.prefill_seconds
    gen = time.perf_counter() - t0
    feats = feature_pass(target, [p + a for p, a in zip(prompts, answers)], layers)
    return {
        "answers": answers,
        "generation": gen,
        "prefill": prefill,
        "decode": gen - prefill,
        "other": 0.0,
        "features": feats,
    }


def batched(target, texts, max_new_tokens, layers, batch, mode) -> dict:
    """``train-dflash``'s data phase: ``self_distill`` into a scratch file."""
    times = GenerationTimes()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        rows = self_distill(
            target,
            texts,
            Path(tmp) / "data.jsonl",
            max_new_tokens=max_new_tokens,
            batch_size=batch,
            capture_layers=layers if mode == "capture" else None,
            times=times,
        )
        gen = time.perf_counter() - t0
    answers = [r["tokens"][r["prompt_tokens"] :] for r in rows]
    feats = 0.0 if mode == "capture" else feature_pass(target, [r["tokens"] for r in rows], layers)
    return {
        "answers": answers,
        "generation": gen,
        "prefill": times.prefill,
        "decode": times.decode,
        "other": gen - times.prefill - times.decode,
        "features": feats,
        "steps": times.steps,
        "row_steps": times.rows,
        "prefill_tokens": times.prefill_tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16, help="prompts of the default training set")
    ap.add_argument("--seed", type=int, default=0, help="seed of the default prompt set")
    ap.add_argument(
        "--batches",
        default="1,8,16,32",
        help="batch sizes, features captured while generating (train-dflash's way)",
    )
    ap.add_argument(
        "--pass-batches",
        default="8",
        help="batch sizes with a separate feature pass after generating ('' for none)",
    )
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=TrainConfig.max_new_tokens,
        help="answer budget (train-dflash's)",
    )
    ap.add_argument(
        "--single-method",
        default="ngram",
        help="generation method of the one-at-a-time reference (ngram: as train-dflash did; baseline: plain)",
    )
    ap.add_argument(
        "--single-prompts",
        type=int,
        default=None,
        help="answer only the first N prompts one at a time (default: all); rates are compared per hour",
    )
    ap.add_argument("--out", default=None, help="results file (JSON) to write")
    ap.add_argument("--lock", default=None, help="hold an exclusive flock on this file while timing")
    args = ap.parse_args()
    if args.out:
        check_writable(args.out, "--out file")
    try:
        settings = [(int(x), "pass") for x in args.pass_batches.split(",") if x.strip()]
        settings += [(int(x), "capture") for x in args.batches.split(",") if x.strip()]
    except ValueError:
        ap.error("--batches and --pass-batches take comma-separated integers")
    if not settings or min(b for b, _ in settings) < 1:
        ap.error("batch sizes must be >= 1")
    n_single = args.prompts if args.single_prompts is None else args.single_prompts
    if args.prompts < 1 or not 1 <= n_single <= args.prompts:
        ap.error("--prompts must be >= 1 and --single-prompts in [1, --prompts]")

    target = hf2q_py.load(dtype="float32")
    layers = TrainConfig(out="-").feature_layers(target)
    texts = default_prompts(args.prompts, seed=args.seed)
    prompts = [hf2q_py.encode_prompt(target, p, True) for p in texts]
    batched_answers(target, prompts[:2], max_new_tokens=4, batch_size=2, capture_layers=layers)  # warm-up
    if args.lock:
        import fcntl
        import os

        fcntl.flock(os.open(args.lock, os.O_WRONLY | os.O_CREAT, 0o644), fcntl.LOCK_EX)  # held until exit
    started = time.time()
    runs = {
        "one at a time": one_at_a_time(
            target, prompts[:n_single], args.max_new_tokens, layers, args.single_method
        )
    }
    print(f"one at a time: {runs['one at a time']['generation']:.1f} s", flush=True)
    for b, m in settings:
        label = f"batch {b}, {'features captured' if m == 'capture' else 'separate feature pass'}"
        runs[label] = batched(target, texts, args.max_new_tokens, layers, b, m)
        print(f"{label}: {runs[label]['generation']:.1f} s", flush=True)

    want = runs["one at a time"]["answers"]
    base = n_single / (runs["one at a time"]["generation"] + runs["one at a time"]["features"])  # answers/s
    rows, data = [], {}
    for label, r in runs.items():
        total = r["generation"] + r["features"]
        n_tokens = sum(len(a) for a in r["answers"])
        mismatches = [i for i, (a, w) in enumerate(zip(r["answers"], want)) if a != w]
        rate = len(r["answers"]) / total
        rows.append(
            [
                label,
                f"{rate * 3600:.0f}",
                f"{n_tokens / total:.1f}",
                f"{r['prefill']:.1f}",
                f"{r['decode']:.1f}",
                f"{r['other']:.1f}",
                f"{r['features']:.1f}",
                f"{total:.1f}",
                f"{rate / base:.2f}x",
                f"{len(mismatches)} of {min(len(r['answers']), n_single)}",
            ]
        )
        data[label] = {k: v for k, v in r.items() if k != "answers"} | {
            "answer_tokens": n_tokens,
            "mismatches": mismatches,
            "answer_lengths": [len(a) for a in r["answers"]],
        }
    columns = [
        "setting",
        "answers/hour",
        "answer tok/s",
        "prefill s",
        "decode s",
        "other s",
        "feature pass s",
        "total s",
        "speed-up",
        "answers differing from one at a time",
    ]
    prompt_tokens = [len(p) for p in prompts]
    notes = (
        f"Built-in SmolLM2-135M-Instruct, float32; {len(prompts)} prompts of the default training set "
        f"(seed {args.seed}, {min(prompt_tokens)}-{max(prompt_tokens)} tokens, {sum(prompt_tokens)} in all), "
        f"answers of at most {args.max_new_tokens} tokens; features at target layers {layers}. "
        f"One at a time: `generate(method={args.single_method!r})` per prompt (its prefill time from its stats), "
        f"then one target pass per sequence, over the first {n_single} prompts. Batched: train-dflash's data phase (`dflash_data.self_distill`, "
        "one continuous batch); 'other' is the time between forwards (cache merges and filters, capture "
        "assembly, the data file). Total = generation + feature pass; "
        f"{(time.time() - started) / 60:.1f} min of timing."
    )
    rec = results.record(
        shlex.join(["python", *sys.argv]),
        [results.table(columns, rows, "lrrrrrrrrr")],
        notes=notes,
        data={
            "prompt_tokens": prompt_tokens,
            "layers": layers,
            "max_new_tokens": args.max_new_tokens,
            "runs": data,
        },
    )
    print(results.render(rec))
    if args.out:
        results.write(args.out, rec)


if __name__ == "__main__":
    run_script(main)
