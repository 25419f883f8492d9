"""How a DFlash drafter's held-out acceptance grows with its training data:
``train-dflash``'s training (its default options, or those given) run on
the first N self-distilled answers of an earlier run's data file, for
several N, each for the same number of steps, all judged on the same
held-out answers (the file's first ``--holdout``). The target's pass over
each answer is taken once and shared by every run.

    python benchmarks/bench_dflash_data.py --data RUN/train-state/data.jsonl \\
        --sizes 36,72,144 --steps 1200 --results benchmarks/results/dflash_data_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hf2q_py

import hf2q_py  # noqa: E402  first: OpenBLAS before mlx.core

import mlx.core as mx  # noqa: E402

from hf2q_py.errors import Hf2qError, run_script  # noqa: E402
from hf2q_py.tools.dflash_make import drafter_for  # noqa: E402
from hf2q_py.tools import results  # noqa: E402
from hf2q_py.tools.dflash_data import CapturedPass  # noqa: E402
from hf2q_py.tools.dflash_train import TrainConfig, target_pass, train  # noqa: E402
from hf2q_py.tools.files import check_writable  # noqa: E402


def read_rows(path: str) -> list[dict]:
    """The data file's rows with at least two answer tokens (as training uses them)."""
    try:
        lines = Path(path).read_text().splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError) as e:
        raise Hf2qError(f"cannot read the data file {path}: {e}") from None
    return [r for r in rows if len(r["tokens"]) - r["prompt_tokens"] >= 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a train-dflash data file (train-state/data.jsonl)")
    ap.add_argument("--sizes", default="36,72,144", help="training answers per run")
    ap.add_argument("--steps", type=int, default=1200, help="training steps per run")
    ap.add_argument("--evals", type=int, default=4, help="held-out evaluations per run")
    ap.add_argument("--holdout", type=int, default=16)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--results", default=None, help="also write a results file (JSON) here")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",") if x.strip()]
    if not sizes or min(sizes) < 1 or a.steps < 1 or not 1 <= a.evals <= a.steps or a.holdout < 1:
        ap.error("--sizes need sizes >= 1, --steps >= 1, --evals in [1, steps], --holdout >= 1")
    if a.results:
        check_writable(a.results, "--results file")
    rows = read_rows(a.data)
    if len(rows) < a.holdout + max(sizes):
        raise Hf2qError(f"{a.data} holds {len(rows)} usable answers; --holdout + largest size needs more")
    target = hf2q_py.load(dtype="float32")
    layer_ids = tuple(drafter_for(target, layers=2, block_size=8).config.target_layer_ids)
    t0 = time.perf_counter()
    for r in rows[: a.holdout + max(sizes)]:
        features, agrees, finals = target_pass(target, r["tokens"], layer_ids)
        mx.eval(features, agrees, finals)
        r["captured"] = CapturedPass(layer_ids, features, agrees, finals)
    pass_s = time.perf_counter() - t0
    histories, table_rows = {}, []
    every = a.steps // a.evals
    for n in sizes:
        with tempfile.TemporaryDirectory() as out:
            cfg = TrainConfig(
                out=out,
                samples=a.holdout + n,
                holdout=a.holdout,
                draft_vocab=a.draft_vocab,
                warm_start=True,
                steps=a.steps,
                lr=a.lr,
                eval_every=every,
                checkpoint_every=a.steps,
            )
            t1 = time.perf_counter()
            train(target, cfg, rows[: a.holdout + n], progress=False, log=lambda line: None)
            seconds = time.perf_counter() - t1
            history = json.loads((Path(out) / "train-state" / "trainer.json").read_text())["history"]
        histories[n] = history
        answer_tokens = sum(len(r["tokens"]) - r["prompt_tokens"] for r in rows[a.holdout : a.holdout + n])
        table_rows.append(
            [
                str(n),
                str(answer_tokens),
                " / ".join(f"{h['loss']:.2f}" for h in history),
                " / ".join(f"{h['held_out_mal']:.3f}" for h in history),
                f"{seconds / 60:.1f}",
            ]
        )
        print(table_rows[-1], flush=True)
    steps = " / ".join(str(h["step"]) for h in histories[sizes[0]])
    rec = results.record(
        shlex.join(["python", *sys.argv]),
        [
            results.table(
                [
                    "training answers",
                    "answer tokens",
                    f"loss at steps {steps}",
                    "held-out mean accepted length",
                    "training minutes",
                ],
                table_rows,
                "rrrrr",
            )
        ],
        notes=f"Built-in SmolLM2-135M-Instruct, float32; the first {a.holdout} answers of the data file held "
        f"out, the next N trained on; train-dflash's drafter (2 layers, block 8, target layers "
        f"{list(layer_ids)}), --draft-vocab {a.draft_vocab} (ranked on the N answers), --warm-start, lr "
        f"{a.lr}, {a.steps} steps. The target's pass over the answers took {pass_s / 60:.1f} min, once.",
        data={"history": histories, "target_pass_seconds": pass_s},
    )
    results.publish(rec, a.results)


if __name__ == "__main__":
    run_script(main)
