"""Cost of one DFlash drafter round on the built-in model (SmolLM2-135M,
float32): a drafter of the shape ``train-dflash`` builds (random weights: the
cost does not depend on them) drafting a block after a prompt, with the full
head (49152 rows) or a reduced draft vocabulary, against one target decode
measured in the same process (rounds and decodes interleaved).

    python benchmarks/bench_dflash_round.py --vocabs 0,4096,8192,16384 \\
        --out benchmarks/results/dflash_round_smollm2.json --lock /tmp/hf2q-cpu.lock
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

from hf2q_py.proposers.dflash import DFlashProposer  # noqa: E402
from hf2q_py.tools.dflash_make import drafter_for, frequency_vocab  # noqa: E402
from hf2q_py.sampling import Greedy  # noqa: E402
from hf2q_py.tools import results  # noqa: E402
from hf2q_py.tools.dflash_data import default_prompts  # noqa: E402
from hf2q_py.tools.dflash_train import TrainConfig  # noqa: E402
from hf2q_py.tools.files import check_writable  # noqa: E402
from hf2q_py.errors import run_script  # noqa: E402


def context(target, n: int, seed: int) -> list[int]:
    """``n`` tokens of chat-formatted default training prompts, concatenated."""
    out: list[int] = []
    for p in default_prompts(64, seed=seed):
        out += hf2q_py.encode_prompt(target, p, True)
        if len(out) >= n:
            return out[:n]
    raise SystemExit(f"the default prompts hold fewer than {n} tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocabs", default="0,4096,8192,16384", help="draft vocabulary sizes (0: the full head)")
    ap.add_argument("--context", type=int, default=400, help="prompt tokens before the rounds")
    ap.add_argument("--repeats", type=int, default=30, help="timed rounds (and decodes) per setting")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="results file (JSON) to write")
    ap.add_argument("--lock", default=None, help="hold an exclusive flock on this file while timing")
    args = ap.parse_args()
    if args.out:
        check_writable(args.out, "--out file")
    vocabs = [int(x) for x in args.vocabs.split(",") if x.strip()]
    if not vocabs or min(vocabs) < 0 or args.repeats < 1 or args.context < 2:
        ap.error("--vocabs needs sizes >= 0 (0: full), --repeats >= 1, --context >= 2")

    target = hf2q_py.load(dtype="float32")
    cfg = TrainConfig(out="-")  # train-dflash's drafter shape
    ctx = context(target, args.context, args.seed)
    text = [hf2q_py.encode_prompt(target, p, True) for p in default_prompts(240, seed=args.seed)]
    labels, proposers = [], []
    for v in vocabs:
        if v > target.vocab_size:
            ap.error(f"--vocabs {v} is larger than the target's vocabulary ({target.vocab_size})")
        drafter = drafter_for(target, layers=cfg.layers, block_size=cfg.block_size, seed=args.seed)
        if v:
            drafter.vocab = frequency_vocab(text, v, target.vocab_size)
        rt = target.runtime()
        fwd = rt.prefill(ctx[:-1], logits="none", capture_layers=drafter.config.target_layer_ids)
        p = DFlashProposer(target, drafter)
        p.start(rt, ctx, fwd.hidden, Greedy())
        p.propose(ctx, cfg.block_size - 1)  # takes in the prompt's features
        p.one = {
            i: h[:, -1:] for i, h in fwd.hidden.items()
        }  # one position's features: a round accepting nothing
        labels.append("full head" if v == 0 else f"draft vocabulary {v}")
        proposers.append(p)
    rt = target.runtime()
    rt.prefill(ctx[:-1], logits="none")

    def decode() -> float:
        t0 = time.perf_counter()
        mx.eval(rt.decode(ctx[-1], logits="last").logits)
        dt = time.perf_counter() - t0
        rt.trim(1)
        return dt

    def round_(p) -> float:
        p.update(ctx, cfg.block_size - 1, 0, p.one)  # as after a verify that accepted no draft
        t0 = time.perf_counter()
        p.propose(ctx, cfg.block_size - 1).ids()  # the drafts read, as a round's read does
        return time.perf_counter() - t0

    for p in proposers:  # warm-up
        round_(p)
    decode()
    if args.lock:
        import fcntl
        import os

        fcntl.flock(os.open(args.lock, os.O_WRONLY | os.O_CREAT, 0o644), fcntl.LOCK_EX)  # held until exit
    rounds = {lb: [] for lb in labels}
    decodes = []
    for _ in range(args.repeats):
        decodes.append(decode())
        for lb, p in zip(labels, proposers):
            rounds[lb].append(round_(p))
    dec = statistics.median(decodes) * 1e3
    full = statistics.median(rounds[labels[0]]) * 1e3 if vocabs[0] == 0 else None
    rows = [["target decode (reference)", "-", f"{dec:.1f}", "1.00", "-"]]
    for lb, v in zip(labels, vocabs):
        ms = statistics.median(rounds[lb]) * 1e3
        rows.append(
            [
                lb,
                str(v or target.vocab_size),
                f"{ms:.1f}",
                f"{ms / dec:.2f}",
                f"{ms / full:.2f}" if full else "-",
            ]
        )
    columns = ["drafter head", "rows", "ms per round", "in target decodes", "vs full head"]
    d = proposers[0].drafter.config
    notes = (
        f"Built-in SmolLM2-135M-Instruct, float32; drafter as train-dflash builds it ({d.num_hidden_layers} layers, "
        f"block {d.block_size}, target layers {list(d.target_layer_ids)}, random weights); one round = "
        f"`DFlashProposer.propose` of {d.block_size - 1} greedy drafts after a {len(ctx)}-token context "
        "(taking in one new position's target features, as after a verify that accepted nothing); "
        f"target decode = one token after the same context. Medians of {args.repeats}, interleaved; draft "
        "vocabularies ranked on the default training prompts."
    )
    rec = results.record(
        shlex.join(["python", *sys.argv]),
        [results.table(columns, rows, "lrrrr")],
        notes=notes,
        data={"decode_s": decodes, "round_s": rounds, "context": len(ctx), "vocabs": vocabs},
    )
    print(results.render(rec))
    if args.out:
        results.write(args.out, rec)


if __name__ == "__main__":
    run_script(main)
