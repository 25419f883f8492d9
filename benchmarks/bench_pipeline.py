"""What a break of the decode pipeline costs on this backend: greedy decoding
of the built-in model (float32) pipelined as mlx-lm does it (the next decode
is queued before the current token is read), synchronous (each token read
before the next decode is queued), and pipelined with a break every 8 tokens;
then the same 8-token stretches with one verify forward of W tokens in place
of a decode (the cache trimmed back after it), against the verify's own cost
measured alone. Medians of repeats, modes interleaved, in one process.

    python benchmarks/bench_pipeline.py [--tokens 96] [--repeats 5] [--widths 5,9] [--results PATH]
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

from hf2q_py.generation import encode_prompt  # noqa: E402
from hf2q_py.target import Runtime, Target  # noqa: E402
from hf2q_py.tools import results  # noqa: E402
from hf2q_py.tools.files import check_writable  # noqa: E402
from hf2q_py.tools.workloads import default_workloads  # noqa: E402
from hf2q_py.errors import run_script  # noqa: E402

STRETCH = 8  # tokens between breaks


def _next(rt: Runtime, token) -> mx.array:
    y = mx.argmax(rt.decode(token).logits[-1])
    mx.async_eval(y)
    return y


def pipelined(rt: Runtime, token: int, n: int, verify_width: int = 0) -> None:
    """``n`` tokens in stretches of ``STRETCH``: within a stretch each decode is
    queued before the previous token is read; a stretch ends by reading its
    last token (a break). ``verify_width`` > 0: each stretch then runs one
    verify forward of that many tokens and trims its drafts back."""
    done = 0
    while done < n:
        y = _next(rt, token)
        for _ in range(min(STRETCH, n - done) - 1):
            following = _next(rt, y)
            y.item()
            y = following
        token = y.item()
        done += STRETCH
        if verify_width:
            mx.eval(rt.verify([token] * verify_width).logits)
            rt.trim(verify_width)


def chained(rt: Runtime, token: int, n: int) -> None:
    """``n`` tokens, every decode queued before the previous token is read."""
    y = _next(rt, token)
    for _ in range(n - 1):
        following = _next(rt, y)
        y.item()
        y = following
    y.item()


def synchronous(rt: Runtime, token: int, n: int) -> None:
    """``n`` tokens, each read before the next decode is queued."""
    for _ in range(n):
        token = _next(rt, token).item()


def verify_alone(rt: Runtime, token: int, width: int, n: int) -> None:
    """``n`` verify forwards of ``width`` tokens, each trimmed back."""
    for _ in range(n):
        mx.eval(rt.verify([token] * width).logits)
        rt.trim(width)


def timed(target: Target, prompt: list[int], run) -> float:
    rt = target.runtime(slack=512)
    rt.prefill(prompt[:-1], logits="none")
    mx.eval(rt.state())
    t0 = time.perf_counter()
    run(rt, prompt[-1])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=96, help="tokens per timed run (a multiple of 8)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--widths", default="5,9", help="verify widths (tokens per verify forward)")
    ap.add_argument("--results", default=None, help="also write a results file (JSON) here")
    a = ap.parse_args()
    if a.results:
        check_writable(a.results, "--results file")
    n = max(STRETCH, a.tokens // STRETCH * STRETCH)
    widths = [int(w) for w in a.widths.split(",") if w]
    target = hf2q_py.load(dtype="float32")
    prompt = encode_prompt(target, default_workloads()[0].prompt)
    stretches = n // STRETCH
    modes = {
        "pipelined": lambda rt, t: chained(rt, t, n),
        "synchronous": lambda rt, t: synchronous(rt, t, n),
        f"pipelined, a break every {STRETCH}": lambda rt, t: pipelined(rt, t, n),
    }
    for w in widths:
        modes[f"verify of {w} alone"] = lambda rt, t, w=w: verify_alone(rt, t, w, stretches)
        modes[f"pipelined, a verify of {w} every {STRETCH}"] = lambda rt, t, w=w: pipelined(rt, t, n, w)
    timed(target, prompt, modes["pipelined"])  # warm-up
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(a.repeats):
        for m, run in modes.items():
            seconds[m].append(timed(target, prompt, run))
    med = {m: statistics.median(s) for m, s in seconds.items()}
    decode = med["pipelined"] / n
    rows = [[m, f"{med[m] / n * 1e3:.1f}", f"{med[m] / n / decode:.3f}"] for m in modes if "verify" not in m]
    breaks = (med[f"pipelined, a break every {STRETCH}"] - med["pipelined"]) / stretches / decode
    rows.append(["extra cost of one break, in decodes", "", f"{breaks:.2f}"])
    for w in widths:
        alone = med[f"verify of {w} alone"] / stretches
        mixed = (
            med[f"pipelined, a verify of {w} every {STRETCH}"] - med[f"pipelined, a break every {STRETCH}"]
        ) / stretches
        rows.append(
            [
                f"verify of {w}: alone / in the decode stream, in decodes",
                "",
                f"{alone / decode:.2f} / {mixed / decode:.2f}",
            ]
        )
    rec = results.record(
        shlex.join(["python", *sys.argv]),
        [results.table(["mode", "ms per token", "relative to pipelined"], rows, "lrr")],
        notes=f"Built-in model, float32, {n} tokens per run after the first code workload's prompt, "
        f"medians of {a.repeats} interleaved repeats.",
        data={"seconds": seconds, "tokens": n},
    )
    results.publish(rec, a.results)


if __name__ == "__main__":
    run_script(main)
