"""The loop's own cost: blocking reads and host time per round, for every
method and for mlx-lm's ``generate_step`` and ``speculative_generate_step``,
on tiny random llamas (width 64, vocabulary 512, float32) of 1, 4 and 32
layers, where a forward costs from half a millisecond to tens of them.

A blocking read is every ``mx.eval``, ``array.item()`` and ``array.tolist()``
(``hf2q_py.tools.reads``; the prefill's one included); host time per round
is the wall time outside those reads and outside ``mx.async_eval`` (which on
MLX's CPU backend computes inline once its queue is full) divided by the
rounds: building graphs, drafting, bookkeeping. Every method's tokens are
checked against hf2q-py's plain decoding.

    python benchmarks/bench_loop.py [--tokens 200] [--repeats 3] [--results benchmarks/results/loop.json]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import hf2q_py  # first: loads OpenBLAS before mlx.core

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.utils import _get_classes

from hf2q_py.errors import run_script
from hf2q_py.target import Target
from hf2q_py.tools import results
from hf2q_py.tools.files import check_writable
from hf2q_py.tools.reads import count_reads

VOCAB = 512


def tiny_llama(layers: int, seed: int = 0):
    cfg = dict(model_type="llama", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=True)  # fmt: skip
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    keys = iter(mx.random.split(mx.random.key(seed), 10_000))
    model.update(tree_map(lambda x: x if x.ndim < 2 else mx.random.normal(x.shape, key=next(keys)) / 8,
                          model.parameters()))  # fmt: skip
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def prompt_ids(n: int = 64) -> list[int]:
    """A prompt that repeats itself, so copies find drafts."""
    base = [(i * 37 + 11) % VOCAB for i in range(16)]
    return (base * (n // 16 + 1))[:n]


def run_hf2q(target, ids, tokens, method, options):
    if method == "ngram":
        options = dict(options, memory=False)  # each run drafts from its own context only
    with count_reads() as reads:
        t0 = time.perf_counter()
        r = hf2q_py.generate(target, ids, max_tokens=tokens, method=method, **options)
        wall = time.perf_counter() - t0
    return r.tokens, r.stats.rounds, wall, reads, len(r.tokens) / wall


def run_mlx_lm(model, draft, ids, tokens):
    prompt = mx.array(ids)
    with count_reads() as reads:
        t0 = time.perf_counter()
        if draft is None:
            out = [int(t) for t, _ in generate_step(prompt, model, max_tokens=tokens)]
            rounds = len(out)
        else:
            out, rounds = [], 0
            for t, _, from_draft in speculative_generate_step(prompt, model, draft, num_draft_tokens=4,
                                                              max_tokens=tokens):  # fmt: skip
                out.append(int(t))
                rounds += 0 if from_draft else 1
        wall = time.perf_counter() - t0
    return out, rounds, wall, reads, len(out) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", default="1,4,32")
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    if args.results:
        check_writable(args.results, "--results file")
    rows = []
    for layers in [int(x) for x in args.layers.split(",")]:
        model = tiny_llama(layers)
        target = Target.from_mlx_lm(model)
        draft_target = Target.from_mlx_lm(tiny_llama(1, seed=1))
        ids = prompt_ids()
        plain = hf2q_py.generate(target, ids, max_tokens=args.tokens, method="baseline").tokens
        runs = {
            "hf2q-py baseline": lambda: run_hf2q(target, ids, args.tokens, "baseline", {}),
            "hf2q-py ngram": lambda: run_hf2q(target, ids, args.tokens, "ngram", {}),
            "hf2q-py draft (k=4, no confidence rule)": lambda: run_hf2q(
                target, ids, args.tokens, "draft",
                dict(draft=draft_target, k=4, adaptive=False, draft_min_prob=0.0, draft_suffix_depth=0)),
            "hf2q-py draft (k=4, confidence rule 0.5)": lambda: run_hf2q(
                target, ids, args.tokens, "draft",
                dict(draft=draft_target, k=4, adaptive=False, draft_suffix_depth=0)),
            "hf2q-py layerskip (k=4)": lambda: run_hf2q(
                target, ids, args.tokens, "layerskip", dict(skip_layers=[layers // 2], k=4, adaptive=False)),
            "mlx-lm generate_step": lambda: run_mlx_lm(model, None, ids, args.tokens),
            "mlx-lm speculative_generate_step (k=4)": lambda: run_mlx_lm(model, draft_target.model, ids, args.tokens),
        }  # fmt: skip
        if layers < 2:
            del runs["hf2q-py layerskip (k=4)"]  # nothing left to draft with
        for name, fn in runs.items():
            fn()  # warm-up
            samples = [fn() for _ in range(args.repeats)]
            out, rounds, wall, reads, tps = samples[-1]
            host = statistics.median(
                (w - r.seconds - r.async_seconds) / max(n, 1) for _, n, w, r, _ in samples
            )
            inside = statistics.median(r.async_seconds / max(n, 1) for _, n, _, r, _ in samples)
            rows.append(dict(
                layers=layers, loop=name, rounds=rounds, tokens=len(out),
                reads_per_round=round(reads.reads / max(rounds, 1), 3),
                host_ms_per_round=round(host * 1e3, 3),
                async_eval_ms_per_round=round(inside * 1e3, 3),
                tokens_per_second=round(statistics.median(s[4] for s in samples), 1),
                same_as_plain=out[: len(plain)] == plain[: len(out)],
            ))  # fmt: skip
            print(rows[-1], flush=True)
    columns = ["layers", "loop", "rounds", "tokens", "reads / round", "host ms / round",
               "in async_eval ms / round", "tok/s", "same as plain"]  # fmt: skip
    body = [[r["layers"], r["loop"], r["rounds"], r["tokens"], r["reads_per_round"], r["host_ms_per_round"],
             r["async_eval_ms_per_round"], r["tokens_per_second"], "yes" if r["same_as_plain"] else "no"]
            for r in rows]  # fmt: skip
    rec = results.record(
        "python " + shlex.join(sys.argv),
        [results.table(columns, body, align="rlrrrrrrl")],
        notes=f"Tiny random llamas (width 64, vocabulary {VOCAB}, float32), {args.tokens} tokens, "
        f"median of {args.repeats}; mlx-lm's speculative loop counts a round per verify.",
        data={"rows": rows},
    )
    results.publish(rec, args.results)


if __name__ == "__main__":
    run_script(main)
