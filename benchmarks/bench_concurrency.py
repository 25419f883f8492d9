"""Concurrent clients: ``hf2q-py serve`` (continuous batching with n-gram
speculation per row) against ``mlx_lm.server`` (continuous batching) on the
same model folder, the same requests, greedy.

For each number of clients (1, 2, 4, 8) and each repeat, both servers start
afresh (nothing remembered), answer a warm-up question, then get that many
requests at once, each one a request neither has seen: code edits of
standard-library functions (rename a variable, reply with the whole
function) and, with 8 clients, 2 of the 8 are stories. Measured: the wall
time until every answer is in (aggregate tokens per second), each request's
latency and time to first token, and whether each answer equals the same
request's answer alone (hf2q-py's plain greedy decoding in this process).
Both servers load the built-in model saved as an MLX folder (float32) with
OpenBLAS loaded. ``--old-tree`` also runs an older checkout's ``hf2q-py
serve`` (one client) to compare one request alone with it.

    python benchmarks/bench_concurrency.py [--clients 1,2,4,8] [--repeats 2] [--max-tokens 128] [--results benchmarks/results/concurrency.json]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import hf2q_py  # first: loads OpenBLAS before mlx.core

import openai

from hf2q_py.errors import Hf2qError, run_script
from hf2q_py.tools import results
from hf2q_py.tools.files import check_writable

sys.path.insert(0, str(Path(__file__).parent))
from bench_server import ask, export_builtin, served_name, start, stop  # noqa: E402

#: Code edits: (module, function, name to rename, new name).
EDITS = (
    ("textwrap", "indent", "predicate", "should_indent"),
    ("heapq", "nsmallest", "result", "smallest"),
    ("shlex", "split", "posix", "use_posix"),
    ("statistics", "median", "n", "count"),
    ("textwrap", "dedent", "margin", "common_prefix"),
    ("statistics", "variance", "xbar", "center"),
    ("heapq", "nlargest", "result", "largest"),
    ("json", "dumps", "cls", "encoder_class"),
)
STORIES = ("Write a story about a lighthouse keeper who finds a map.",
           "Write a story about a robot that learns to paint.")  # fmt: skip
WARM_UP = "What is the capital of France?"


def edit(module: str, function: str, old: str, new: str) -> str:
    code = inspect.getsource(getattr(importlib.import_module(module), function))
    return f"Rename `{old}` to `{new}` in this function. Reply with the full function only.\n\n```python\n{code}```"


def requests_for(clients: int, offset: int) -> list[tuple[str, str]]:
    """``clients`` requests: code edits (with 8 clients, 6 edits and 2 stories),
    starting at ``offset`` in the list so repeats ask different things."""
    if clients == 8:
        picks = [EDITS[(offset + i) % len(EDITS)] for i in range(6)]
        return [(f"{m}.{f}", edit(m, f, o, n)) for m, f, o, n in picks] + [("story", s) for s in STORIES]
    picks = [EDITS[(offset + i) % len(EDITS)] for i in range(clients)]
    return [(f"{m}.{f}", edit(m, f, o, n)) for m, f, o, n in picks]


def at_once(url: str, model: str, asks: list[tuple[str, str]], max_tokens: int) -> tuple[float, list[dict]]:
    """Send every request at the same moment; (seconds until all answered, answers)."""
    out: list[dict | None] = [None] * len(asks)
    barrier = threading.Barrier(len(asks) + 1)

    def one(i: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1200)
        barrier.wait()
        out[i] = ask(client, model, [{"role": "user", "content": asks[i][1]}], max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if any(o is None for o in out):
        raise Hf2qError("a request failed (see the servers' log)")
    return time.perf_counter() - t0, out


def run(folder: Path, clients: list[int], repeats: int, max_tokens: int, log, old_tree: str | None) -> dict:
    engines = ["hf2q-py", "mlx_lm.server"] + (["hf2q-py (old tree)"] if old_tree else [])
    runs: dict = {}
    for c in clients:
        for r in range(repeats):
            asks = requests_for(c, r * c)
            order = engines if r % 2 == 0 else engines[::-1]
            for name in order:
                if name == "hf2q-py (old tree)" and c != 1:
                    continue
                tree = old_tree if name == "hf2q-py (old tree)" else None
                proc, url = start("hf2q-py" if name.startswith("hf2q") else name, folder, log, tree=tree)
                try:
                    model = served_name("hf2q-py" if name.startswith("hf2q") else name, url)
                    ask(openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600),
                        model, [{"role": "user", "content": WARM_UP}], 8)  # fmt: skip
                    wall, answers = at_once(url, model, asks, max_tokens)
                finally:
                    stop(proc)
                runs.setdefault(name, {}).setdefault(c, []).append(
                    {"wall": wall, "asks": [a[0] for a in asks], "prompts": [a[1] for a in asks], "answers": answers}
                )  # fmt: skip
                tokens = sum(a["completion_tokens"] or 0 for a in answers)
                print(f"{c} clients, repeat {r + 1}/{repeats}, {name}: {wall:.1f} s, {tokens} tokens",
                      file=sys.stderr, flush=True)  # fmt: skip
    return runs


def references(folder: Path, runs: dict, max_tokens: int) -> dict[str, str]:
    """Each prompt's answer alone: hf2q-py's plain greedy decoding in this process."""
    target = hf2q_py.load(str(folder))
    prompts = {p for per in runs.values() for reps in per.values() for rep in reps for p in rep["prompts"]}
    return {p: hf2q_py.generate(target, p, max_tokens=max_tokens, method="baseline").text for p in prompts}


def tables(runs: dict, refs: dict[str, str]) -> list[dict]:
    ours, theirs = runs["hf2q-py"], runs["mlx_lm.server"]
    rows = []
    for c in sorted(ours):

        def agg(reps):
            return statistics.median(sum(a["completion_tokens"] or 0 for a in rep["answers"]) / rep["wall"]
                                     for rep in reps)  # fmt: skip

        def med(reps, key):
            return statistics.median(a[key] for rep in reps for a in rep["answers"])

        def same(reps):
            pairs = [(p, a["text"]) for rep in reps for p, a in zip(rep["prompts"], rep["answers"])]
            return f"{sum(refs[p] == t for p, t in pairs)}/{len(pairs)}"

        o, t = agg(ours[c]), agg(theirs[c])
        kind = "6 edits + 2 stories" if c == 8 else "code edits"
        rows.append([str(c), kind, f"{t:.1f}", f"{o:.1f}", f"**{o / t:.2f}x**",
                     f"{med(theirs[c], 'total'):.1f}", f"{med(ours[c], 'total'):.1f}",
                     f"{med(theirs[c], 'ttft'):.2f}", f"{med(ours[c], 'ttft'):.2f}",
                     same(theirs[c]), same(ours[c])])  # fmt: skip
    cols = ["clients", "requests", "mlx_lm.server tok/s", "hf2q-py tok/s", "hf2q-py / mlx_lm",
            "mlx_lm latency s", "hf2q-py latency s", "mlx_lm TTFT s", "hf2q-py TTFT s",
            "mlx_lm = alone", "hf2q-py = alone"]  # fmt: skip
    out = [results.table(cols, rows, "llrrrrrrrll", title="Concurrent clients, aggregate tokens per second")]
    old = runs.get("hf2q-py (old tree)", {}).get(1)
    if old:
        o, p = statistics.median(r["wall"] for r in ours[1]), statistics.median(r["wall"] for r in old)
        out.append(results.table(["one request alone", "older hf2q-py s", "hf2q-py s", "older / now"],
                                 [["code edit", f"{p:.2f}", f"{o:.2f}", f"{p / o:.2f}x"]], "lrrr",
                                 title="One request alone against the older checkout"))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--old-tree", default=None, help="an older hf2q-py checkout to compare one request alone with"
    )
    ap.add_argument("--folder", default=None, help="where to save the MLX folder (default: a temporary one)")
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    clients = [int(x) for x in args.clients.split(",")]
    if args.repeats < 1 or args.max_tokens < 1 or any(c < 1 or c > 8 for c in clients):
        raise Hf2qError("--repeats and --max-tokens must be >= 1; clients between 1 and 8")
    if args.results:
        check_writable(args.results, "--results file")
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "servers.log", "w") as log:
        folder = Path(args.folder or Path(tmp) / "smollm2-mlx")
        if not (folder / "config.json").is_file():
            export_builtin(folder)
        runs = run(folder, clients, args.repeats, args.max_tokens, log, args.old_tree)
        refs = references(folder, runs, args.max_tokens)
    notes = (
        f"Built-in SmolLM2-135M-Instruct saved as an MLX folder (float32), OpenBLAS in both servers; "
        f"hf2q-py serve at its defaults (method ngram, --max-batch 8), mlx_lm.server at its defaults "
        f"(continuous batching); fresh servers per repeat, a warm-up question, then every request at once; "
        f"at most {args.max_tokens} new tokens, greedy, streamed; medians of {args.repeats} repeats "
        f"(repeats go on through the 8 edits: a later repeat may ask what an earlier asked, of fresh servers), "
        f"alternating which server runs first. '= alone': answers equal "
        f"to hf2q-py's plain greedy decoding of the same request in this process."
    )
    rec = results.record(shlex.join(["python", *sys.argv]), tables(runs, refs), notes=notes,
                         data={"runs": {k: {str(c): v for c, v in per.items()} for k, per in runs.items()}})  # fmt: skip
    results.publish(rec, args.results)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_script(main)
