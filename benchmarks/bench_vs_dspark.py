"""hf2q-py's ``ngram`` method against mlx-dspark's drafter-free lookup, head to head.

One loaded model serves both engines (the same mlx-lm model object, the same
prompt token ids); per workload, plain decoding, hf2q-py's ``ngram`` on a
freshly made Target (a first request: no forward cost measured yet, no
memory), hf2q-py's ``ngram`` on a warm Target (the forward costs an earlier
generation measured, memory cleared) and mlx-dspark 0.20.3's
``lookup_generate`` at its defaults run one after the other, the order
reversed every other repeat. Tokens per second are whole-call (prefill
included, as a user waits for it); every output is compared with plain
decoding's tokens. A session's later requests (an agent's next edit, a
retry) run on the same hf2q-py Target, so they draft from its memory;
mlx-dspark has no memory across calls.

    pip install --no-deps mlx-dspark==0.20.3 mlx-vlm==0.7.10 && pip install requests Pillow
    python benchmarks/bench_vs_dspark.py [--model PATH] [--only code:,agent:] [--max-tokens 160]
        [--repeats 3] [--results PATH]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hf2q_py

import hf2q_py  # first: OpenBLAS before mlx.core
from hf2q_py.errors import Hf2qError, run_script
from hf2q_py.generation import encode_prompt
from hf2q_py.target import Target
from hf2q_py.tools import results
from hf2q_py.tools.workloads import Workload, default_workloads

ENGINES = ("plain", "hf2q first request", "hf2q warm", "mlx-dspark lookup")


def dspark():
    try:
        from mlx_dspark.lookup import lookup_generate
        from mlx_dspark.target import Target as DSparkTarget
    except ImportError as e:
        raise Hf2qError(
            f"mlx-dspark is not installed ({e}): pip install --no-deps mlx-dspark==0.20.3 mlx-vlm==0.7.10 && "
            "pip install requests Pillow"
        ) from None
    return lookup_generate, DSparkTarget


def fresh(target: Target) -> Target:
    """A new Target over the same model: nothing measured, nothing remembered."""
    t = Target(target.model, target.tokenizer, source=str(target.source))
    t.eos_token_ids = set(target.eos_token_ids)
    return t


class Engines:
    """Each engine's one call: (tokens without end tokens, whole-call seconds, rounds)."""

    def __init__(self, target: Target, max_tokens: int):
        self.target, self.max_tokens = target, max_tokens
        lookup_generate, DSparkTarget = dspark()
        self.lookup = lookup_generate
        self.dspark_target = DSparkTarget(target.model, target.tokenizer)
        self.warm = fresh(target)
        self.session: Target | None = None

    def start_session(self) -> None:
        self.session = fresh(self.target)
        self.warm.memory.clear()

    def run(self, engine: str, ids: list[int]) -> tuple[list[int], float, list]:
        """Tokens (end tokens left out), whole-call seconds, and the round
        trace: (drafted, accepted) per round."""
        trace: list = []
        t0 = time.perf_counter()
        if engine == "mlx-dspark lookup":
            r = self.lookup(self.dspark_target, self.target.tokenizer, prompt_ids=ids,
                            max_new_tokens=self.max_tokens, apply_chat_template=False,
                            on_round=lambda **kw: trace.append((kw["drafted"], kw["accepted"])))  # fmt: skip
            tokens = list(r.token_ids)
        else:
            on = {"plain": self.target, "hf2q first request": self.session, "hf2q warm": self.warm}[engine]
            method = "baseline" if engine == "plain" else "ngram"
            res = hf2q_py.generate(on, ids, max_tokens=self.max_tokens, method=method,
                                   on_round=lambda rd: trace.append((rd.drafted, rd.accepted)))  # fmt: skip
            tokens = list(res.tokens)
        seconds = time.perf_counter() - t0
        return [t for t in tokens if t not in self.target.eos_token_ids], seconds, trace


def run_workload(eng: Engines, w: Workload, repeats: int, log) -> list[dict]:
    """Rows for every request of ``w``: each engine's median tok/s and whether
    its tokens equal plain decoding's."""
    runs: dict[str, list[list]] = {e: [] for e in ENGINES}
    for r in range(repeats):
        order = ENGINES if r % 2 == 0 else ENGINES[::-1]
        for e in order:
            eng.start_session()
            answers: list[str] = []
            session = []
            for j in range(1 + len(w.then)):
                label, prompt = w.requests(answers)[j]
                ids = encode_prompt(eng.target, prompt)
                tokens, seconds, trace = eng.run(e, ids)
                answers.append(eng.target.tokenizer.decode(tokens))
                session.append((label, tokens, seconds, trace))
            runs[e].append(session)
    rows = []
    for j in range(1 + len(w.then)):
        label = runs["plain"][0][j][0]
        plain_tokens = runs["plain"][0][j][1]
        row = dict(workload=label, kind=w.kind, tokens=len(plain_tokens))
        for e in ENGINES:
            calls = [s[j] for s in runs[e]]
            row[e] = statistics.median(len(c[1]) / c[2] for c in calls)
            row[e + " rounds"] = len(calls[0][3])
            row[e + " drafted"] = sum(d for d, _ in calls[0][3])
            row[e + " accepted"] = sum(a for _, a in calls[0][3])
            row[e + " trace"] = calls[0][3]
            row[e + " identical"] = all(c[1][: len(plain_tokens)] == plain_tokens for c in calls)
        log(f"{label}: " + ", ".join(f"{e} {row[e]:.1f} tok/s" for e in ENGINES))
        rows.append(row)
    return rows


def _rounds(row: dict, engine: str) -> str:
    return f"{row[engine + ' rounds']}, {row[engine + ' drafted']}, {row[engine + ' accepted']}"


def tables(rows: list[dict]) -> list[dict]:
    body = []
    for r in rows:
        p = r["plain"]
        ours, warm, theirs = r["hf2q first request"] / p, r["hf2q warm"] / p, r["mlx-dspark lookup"] / p
        same = all(r[e + " identical"] for e in ENGINES[1:])
        body.append([r["workload"], r["tokens"], f"{p:.1f}", f"{ours:.2f}x", f"{warm:.2f}x", f"{theirs:.2f}x",
                     f"{ours / theirs:.2f}", f"{warm / theirs:.2f}",
                     f"{_rounds(r, 'hf2q first request')} / {_rounds(r, 'mlx-dspark lookup')}",
                     "yes" if same else "NO"])  # fmt: skip
    per = results.table(
        ["workload", "tokens", "plain tok/s", "hf2q first", "hf2q warm", "mlx-dspark", "first / dspark",
         "warm / dspark", "rounds, drafted, accepted (hf2q first / dspark)", "identical"],
        body, "lrrrrrrrrl", "whole-call speed-up over plain decoding, median of the repeats",
    )  # fmt: skip
    summary = []
    for kind in sorted({r["kind"] for r in rows}):
        rs = [r for r in rows if r["kind"] == kind]
        ratio = [r["hf2q first request"] / r["mlx-dspark lookup"] for r in rs]
        summary.append([kind, len(rs),
                        f"{statistics.median(r['hf2q first request'] / r['plain'] for r in rs):.2f}x",
                        f"{statistics.median(r['hf2q warm'] / r['plain'] for r in rs):.2f}x",
                        f"{statistics.median(r['mlx-dspark lookup'] / r['plain'] for r in rs):.2f}x",
                        f"{statistics.median(ratio):.2f}", f"{min(ratio):.2f}"])  # fmt: skip
    total = results.table(
        ["kind", "requests", "hf2q first (median)", "hf2q warm (median)", "mlx-dspark (median)",
         "first / dspark (median)", "first / dspark (lowest)"],
        summary, "lrrrrrr", "per workload kind",
    )  # fmt: skip
    return [per, total]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a GGUF file or model folder (default: the built-in model)")
    p.add_argument("--only", default="", help="workload name prefixes, comma-separated (default: all)")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--results", default=None)
    args = p.parse_args()
    dspark()  # refuse before loading when it is missing
    target = hf2q_py.load(args.model)
    prefixes = [x for x in args.only.split(",") if x]
    workloads = [w for w in default_workloads() if not prefixes or w.name.startswith(tuple(prefixes))]
    if not workloads:
        raise Hf2qError(f"no workload's name starts with one of {prefixes}")
    eng = Engines(target, args.max_tokens)
    eng.run("hf2q warm", encode_prompt(target, workloads[0].prompt))  # the warm Target measures its forwards
    rows = []
    for w in workloads:
        rows += run_workload(eng, w, args.repeats, lambda s: print(s, file=sys.stderr, flush=True))
    command = "python benchmarks/bench_vs_dspark.py " + shlex.join(sys.argv[1:])
    import mlx_dspark

    notes = (
        f"Model {Path(str(target.source)).name}, at most {args.max_tokens} new tokens, greedy, median of "
        f"{args.repeats} alternating run(s); whole-call tok/s (prefill included); mlx-dspark "
        f"{getattr(mlx_dspark, '__version__', '?')} lookup_generate at its defaults; identical: every "
        "run's tokens equal plain decoding's."
    )
    rec = results.record(command, tables(rows), notes=notes, data=dict(rows=rows))
    print(results.render(rec))
    if args.results:
        results.write(args.results, rec)


if __name__ == "__main__":
    run_script(main)
