"""What makes a wider forward cost more on this backend: the built-in model
(SmolLM2-135M, float32) runs a forward of W new tokens after a context (a
verify of W - 1 drafts; W = 1 is a decode) and a one-token step of a batch of
B rows (the batched decoding of ``train-dflash``'s data phase); each is timed
as it is and with one part of every layer replaced by a stand-in of the same
shapes that skips the work (attention returns its queries; the MLP's SiLU
gate, one exp per element, becomes a product), so the difference is the time
that part takes inside the forward. Then the element-wise ``exp`` (attention's
softmax and the SiLU gate run it), per element, against NumPy's on the same
numbers. Medians of repeats, settings interleaved, in one process.

    python benchmarks/bench_attention_share.py [--context 500] [--widths 1,2,4,8,16,32]
        [--batch 32] [--repeats 15] [--results PATH] [--lock /tmp/hf2q-cpu.lock]
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hf2q_py

import hf2q_py  # noqa: E402  first: OpenBLAS before mlx.core

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from hf2q_py.errors import run_script  # noqa: E402
from hf2q_py.tools import results  # noqa: E402
from hf2q_py.tools.files import check_writable  # noqa: E402


#: Stand-ins that keep the shapes and skip the work: attention returns its
#: queries; the MLP's SiLU gate (a sigmoid: one exp per element) multiplies.
STAND_INS = {
    "attention": ("scaled_dot_product_attention", lambda queries, *a, **kw: queries),
    "MLP gate": ("swiglu", lambda gate, x: gate * x),
}


@contextlib.contextmanager
def replaced(model, part: str):
    """The model's ``part`` (a key of ``STAND_INS``) replaced by its stand-in."""
    module = sys.modules[type(model).__module__]
    name, stand_in = STAND_INS[part]
    real = getattr(module, name)
    setattr(module, name, stand_in)
    try:
        yield
    finally:
        setattr(module, name, real)


def timed(run, repeats: int, model) -> dict[str, list[float]]:
    """Seconds per run as it is ("all") and with each part replaced, interleaved."""
    run()  # warm-up
    seconds: dict[str, list[float]] = {"all": [], **{part: [] for part in STAND_INS}}
    for _ in range(repeats):
        for part in seconds:
            with replaced(model, part) if part != "all" else contextlib.nullcontext():
                t0 = time.perf_counter()
                run()
                seconds[part].append(time.perf_counter() - t0)
    return seconds


def forward_run(target, context: list[int], width: int):
    """One forward of ``width`` tokens after ``context``, trimmed back."""
    rt = target.runtime(slack=width + 8)
    rt.prefill(context, logits="none")
    mx.eval(rt.state())

    def run() -> None:
        fwd = rt.verify(context[-width:]) if width > 1 else rt.decode(context[-1])
        mx.eval(fwd.logits, rt.state())  # the cache writes count in both timings
        rt.trim(width)

    return run


def batch_run(target, context: list[int], rows: int):
    """One greedy step of ``rows`` left-padded rows of 3/4 to all of
    ``context`` (mlx-lm's batch KV cache, as ``train-dflash`` decodes)."""
    from mlx_lm.models.cache import make_prompt_cache

    model = target.model
    singles = [make_prompt_cache(model) for _ in range(rows)]
    cache = [singles[0][j].merge([s[j] for s in singles]) for j in range(len(singles[0]))]
    n = len(context)
    lengths = [n - (r * n // 4) // rows for r in range(rows)]
    for c in cache:
        c.prepare(lengths=lengths, right_padding=[n - m for m in lengths])
    x = mx.array([context[:m] + [0] * (n - m) for m in lengths], dtype=mx.uint32)
    for lo in range(0, n, 64):
        model(x[:, lo : lo + 64], cache=cache)
        mx.eval([c.state for c in cache])
    for c in cache:
        c.finalize()
    step = mx.array([[context[-1]]] * rows, dtype=mx.uint32)

    def run() -> None:
        mx.eval(mx.argmax(model(step, cache=cache)[:, -1], axis=-1), [c.state for c in cache])
        for c in cache:
            c.trim(1)

    return run


def exp_ns(n: int, repeats: int) -> tuple[float, float, float]:
    """Nanoseconds per element: MLX ``exp``, NumPy ``exp``, MLX multiply."""
    x = mx.random.uniform(-30.0, 0.0, (n,))
    mx.eval(x)
    xn = np.array(x)

    def med(f) -> float:
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) / n * 1e9

    return (
        med(lambda: mx.eval(mx.exp(x))),
        med(lambda: np.exp(xn)),
        med(lambda: mx.eval(x * x)),
    )


def context_tokens(target, n: int) -> list[int]:
    """``n`` tokens of this repository's own source (any text serves)."""
    text = "".join(p.read_text() for p in sorted(Path(hf2q_py.__file__).parent.glob("*.py")))
    ids = target.tokenizer.encode(text)
    if len(ids) < n:
        raise SystemExit(f"--context {n}: only {len(ids)} tokens of text to draw from")
    return ids[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=500, help="tokens in the cache before each forward")
    ap.add_argument("--widths", default="1,2,4,8,16,32", help="tokens per forward")
    ap.add_argument("--batch", type=int, default=32, help="rows of the batched step (0: none)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--results", default=None, help="also write a results file (JSON) here")
    ap.add_argument("--lock", default=None, help="hold an exclusive flock on this file while timing")
    a = ap.parse_args()
    widths = [int(w) for w in a.widths.split(",") if w.strip()]
    if not widths or min(widths) < 1 or a.context < 2 or a.repeats < 1 or a.batch < 0:
        ap.error("--widths needs sizes >= 1, --context >= 2, --repeats >= 1, --batch >= 0")
    if a.results:
        check_writable(a.results, "--results file")
    target = hf2q_py.load(dtype="float32")
    ctx = context_tokens(target, a.context + max(widths))
    if a.lock:
        import fcntl
        import os

        fcntl.flock(os.open(a.lock, os.O_WRONLY | os.O_CREAT, 0o644), fcntl.LOCK_EX)  # held until exit
    runs = {f"forward of {w}": forward_run(target, ctx[: a.context + w], w) for w in widths}
    if a.batch:
        runs[f"batched step, {a.batch} rows"] = batch_run(target, ctx[: a.context], a.batch)
    seconds = {name: timed(run, a.repeats, target.model) for name, run in runs.items()}
    med = {name: {part: statistics.median(t) for part, t in s.items()} for name, s in seconds.items()}
    one = med.get("forward of 1")
    rows = []
    for name, m in med.items():
        cells = [name, f"{m['all'] * 1e3:.1f}", f"{m['all'] / one['all']:.2f}" if one else "-"]
        extra = m["all"] - one["all"] if one and name != "forward of 1" else 0.0
        for part in STAND_INS:
            spent = m["all"] - m[part]
            cells.append(f"{spent * 1e3:.1f}")
            # the part's own growth over a decode, as a share of the forward's growth
            grown = spent - (one["all"] - one[part]) if one else 0.0
            cells.append(f"{grown / extra:.0%}" if extra > 0 else "-")
        rows.append(cells)
    mlx_exp, np_exp, mul = exp_ns(1 << 17, a.repeats)
    rec = results.record(
        shlex.join(["python", *sys.argv]),
        [
            results.table(
                [
                    "forward",
                    "ms",
                    "in decodes",
                    "attention ms",
                    "its share of the growth over a decode",
                    "MLP gate ms",
                    "its share of the growth",
                ],
                rows,
                "lrrrrrr",
            ),
            results.table(
                ["element-wise op (131072 float32)", "ns per element"],
                [
                    ["MLX exp", f"{mlx_exp:.1f}"],
                    ["NumPy exp", f"{np_exp:.1f}"],
                    ["MLX multiply", f"{mul:.1f}"],
                ],
                "lr",
            ),
        ],
        notes=f"Built-in SmolLM2-135M-Instruct, float32; {a.context} tokens in the cache before each forward; "
        f"a part's ms = the forward's time minus the same forward with that part replaced in every layer "
        f"(attention by its queries, the MLP's SiLU gate by a product); its share of the growth = how much "
        f"more that part takes than in a decode, over how much more the whole forward takes. Medians of {a.repeats}, interleaved.",
        data={"seconds": seconds, "exp_ns": {"mlx": mlx_exp, "numpy": np_exp, "mlx_multiply": mul}},
    )
    results.publish(rec, a.results)


if __name__ == "__main__":
    run_script(main)
