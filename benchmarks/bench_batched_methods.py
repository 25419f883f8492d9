"""Layer skip and DFlash batched: ``hf2q-py serve --method M`` answering
concurrent clients in one batch (the default ``--max-batch``) against the
same method answering them one at a time (``--max-batch 1``), on the same
model folder, the same requests, greedy.

For each method and repeat, both servers start afresh (nothing remembered),
answer a warm-up question, then get ``--clients`` requests at once: code
edits of standard-library functions (as ``bench_concurrency.py`` asks).
Measured: the wall time until every answer is in (aggregate tokens per
second), each request's latency, and whether each answer equals the same
request's answer alone (plain greedy decoding in this process). The model
is the built-in SmolLM2 saved as an MLX folder (float32), OpenBLAS loaded.
DFlash drafts with ``--drafter DIR``, else with a drafter made here by
``hf2q_py.tools.dflash_make`` (2 layers, block 16, warm-started from the
target's last layers, never trained: its acceptance is a random drafter's).
``--old-tree`` also runs one request alone with each method on an older
checkout, against this one.

    python benchmarks/bench_batched_methods.py [--methods 'layerskip;dflash'] [--clients 4] [--repeats 2] [--max-tokens 128] [--drafter DIR] [--old-tree DIR] [--results FILE]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

import hf2q_py  # first: loads OpenBLAS before mlx.core

import openai

from hf2q_py.errors import Hf2qError, run_script
from hf2q_py.tools import results
from hf2q_py.tools.files import check_writable

sys.path.insert(0, str(Path(__file__).parent))
from bench_concurrency import WARM_UP, at_once, references, requests_for  # noqa: E402
from bench_server import ask, export_builtin, served_name, start, stop  # noqa: E402

#: How each server of a method runs: batched (the default batch) or one request at a time.
MODES = {"batched": (), "one at a time": ("--max-batch", "1")}


def make_drafter(folder: Path, out: Path) -> Path:
    """A never-trained drafter for the model in ``folder``, shaped as ``train-dflash`` makes one."""
    from hf2q_py.tools.dflash_make import drafter_for, save_drafter

    target = hf2q_py.load(str(folder))
    save_drafter(drafter_for(target, layers=2, block_size=16, warm_start=True), out)
    return out


def method_flags(method: str, drafter: Path | None) -> tuple[str, ...]:
    """``serve``'s flags for a method spec (DFlash: with the drafter, unless the spec names one)."""
    dflash = method.split(":")[0] == "dflash" and "drafter=" not in method
    return ("--method", method, *(("--drafter", str(drafter)) if dflash else ()))


def serve_once(folder: Path, flags: tuple[str, ...], asks: list[tuple[str, str]], max_tokens: int, log,
               tree: str | None = None) -> tuple[float, list[dict]]:  # fmt: skip
    """A fresh server with ``flags``: a warm-up question, then ``asks`` at once."""
    proc, url = start("hf2q-py", folder, log, *flags, tree=tree)
    try:
        model = served_name("hf2q-py", url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1200)
        ask(client, model, [{"role": "user", "content": WARM_UP}], 8)
        return at_once(url, model, asks, max_tokens)
    finally:
        stop(proc)


def run(folder: Path, methods: list[str], drafter: Path | None, clients: int, repeats: int, max_tokens: int,
        log, old_tree: str | None) -> dict:  # fmt: skip
    runs: dict = {}
    for method in methods:
        flags = method_flags(method, drafter)
        for r in range(repeats):
            asks = requests_for(clients, r * clients)
            modes = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
            for mode in modes:
                wall, answers = serve_once(folder, flags + MODES[mode], asks, max_tokens, log)
                runs.setdefault(method, {}).setdefault(mode, []).append(
                    {"wall": wall, "prompts": [a[1] for a in asks], "answers": answers}
                )
                tokens = sum(a["completion_tokens"] or 0 for a in answers)
                print(f"{method}, {mode}, repeat {r + 1}/{repeats}: {wall:.1f} s, {tokens} tokens",
                      file=sys.stderr, flush=True)  # fmt: skip
            if old_tree:
                one = requests_for(1, r)
                for name, tree in (("alone, older tree", old_tree), ("alone", None)):
                    wall, answers = serve_once(folder, flags, one, max_tokens, log, tree=tree)
                    runs[method].setdefault(name, []).append(
                        {"wall": wall, "prompts": [a[1] for a in one], "answers": answers}
                    )
    return runs


def tables(runs: dict, refs: dict[str, str], clients: int) -> list[dict]:
    def agg(reps):
        return statistics.median(sum(a["completion_tokens"] or 0 for a in rep["answers"]) / rep["wall"]
                                 for rep in reps)  # fmt: skip

    def latency(reps):
        return statistics.median(a["total"] for rep in reps for a in rep["answers"])

    def same(reps):
        pairs = [(p, a["text"]) for rep in reps for p, a in zip(rep["prompts"], rep["answers"])]
        return f"{sum(refs[p] == t for p, t in pairs)}/{len(pairs)}"

    rows, alone = [], []
    for method, per in runs.items():
        one, batched = per["one at a time"], per["batched"]
        rows.append([method, f"{agg(one):.1f}", f"{agg(batched):.1f}", f"**{agg(batched) / agg(one):.2f}x**",
                     f"{latency(one):.1f}", f"{latency(batched):.1f}", same(one), same(batched)])  # fmt: skip
        if "alone" in per:
            a, o = agg(per["alone"]), agg(per["alone, older tree"])
            alone.append([method, f"{o:.1f}", f"{a:.1f}", f"{a / o:.2f}x"])
    cols = ["method", "one at a time tok/s", "batched tok/s", "batched / one at a time",
            "one at a time latency s", "batched latency s", "one at a time = alone", "batched = alone"]  # fmt: skip
    out = [
        results.table(cols, rows, "lrrrrrll", title=f"{clients} clients at once, aggregate tokens per second")
    ]
    if alone:
        out.append(results.table(["method", "older tree tok/s", "this tree tok/s", "this / older"], alone,
                                 "lrrr", title="One request alone against the older checkout"))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="layerskip;dflash", help="method specs, separated by ';'")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--drafter", default=None, help="a DFlash drafter folder (default: a never-trained one)")
    ap.add_argument(
        "--old-tree", default=None, help="an older hf2q-py checkout to compare one request alone with"
    )
    ap.add_argument("--folder", default=None, help="where to save the MLX folder (default: a temporary one)")
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    methods = [m.strip() for m in args.methods.split(";") if m.strip()]
    if args.repeats < 1 or args.max_tokens < 1 or not 1 <= args.clients <= 8 or not methods:
        raise Hf2qError(
            "--repeats and --max-tokens must be >= 1, --clients between 1 and 8, --methods not empty"
        )
    if args.results:
        check_writable(args.results, "--results file")
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "servers.log", "w") as log:
        folder = Path(args.folder or Path(tmp) / "smollm2-mlx")
        if not (folder / "config.json").is_file():
            export_builtin(folder)
        drafter = Path(args.drafter) if args.drafter else None
        if drafter is None and any(m.split(":")[0] == "dflash" for m in methods):
            drafter = make_drafter(folder, Path(tmp) / "drafter")
        runs = run(folder, methods, drafter, args.clients, args.repeats, args.max_tokens, log, args.old_tree)
        refs = references(folder, runs, args.max_tokens)
    made = "a never-trained drafter made by hf2q_py.tools.dflash_make (2 layers, block 16, warm-started)"
    notes = (
        f"Built-in SmolLM2-135M-Instruct saved as an MLX folder (float32), OpenBLAS loaded; hf2q-py serve "
        f"--method M at its defaults (--max-batch 8: the clients' requests share one batch) against "
        f"--max-batch 1 (one request at a time, the others queued); fresh servers per repeat, a warm-up "
        f"question, then {args.clients} code edits at once; at most {args.max_tokens} new tokens, greedy, "
        f"streamed; medians of {args.repeats} repeats, alternating which server runs first. DFlash drafter: "
        f"{args.drafter or made}. '= alone': answers equal to plain greedy decoding of the same request in "
        f"this process."
    )
    rec = results.record(shlex.join(["python", *sys.argv]), tables(runs, refs, args.clients), notes=notes,
                         data={"runs": runs})  # fmt: skip
    results.publish(rec, args.results)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_script(main)
