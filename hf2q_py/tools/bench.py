"""``hf2q-py bench``: every method against plain decoding on the same prompts,
side by side in one run, as a Markdown table (and a PNG chart with matplotlib)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Sequence

import mlx.core as mx

from ..generation import encode_prompt, generate
from ..method_spec import MethodSpec
from ..target import Target
from .workloads import Workload


@dataclass
class BenchRow:
    workload: str
    kind: str
    method: str
    tokens: int
    tok_s: float
    baseline_tok_s: float
    acceptance: float
    mean_accepted_length: float
    identical: bool | None  # None when sampling: outputs differ by design
    first_diff: int | None = None
    margin: float | None = None
    drafted_per_accepted: float = 0.0  # drafted tokens per accepted draft token

    @property
    def speedup(self) -> float:
        return self.tok_s / self.baseline_tok_s if self.baseline_tok_s else 0.0


def top2_margin(target: Target, tokens: Sequence[int]) -> float:
    """Target's top-1 minus top-2 logit for the token after ``tokens``."""
    logits = target.runtime().prefill(list(tokens), logits="last").logits[-1].astype(mx.float32)
    top = mx.sort(logits)[-2:].tolist()
    return top[1] - top[0]


def _run_session(target: Target, w: Workload, max_tokens: int, options: dict[str, Any]) -> list:
    """Every request of ``w`` in order on ``target``, starting from an empty
    draft memory: [(label, prompt ids, GenerationResult)]."""
    target.memory.clear()
    answers: list[str] = []
    out = []
    for j in range(1 + len(w.then)):
        label, prompt = w.requests(answers)[j]
        ids = encode_prompt(target, prompt)
        res = generate(target, ids, max_tokens=max_tokens, **options)
        answers.append(res.text)
        out.append((label, ids, res))
    return out


def run_bench(
    target: Target,
    workloads: Sequence[Workload],
    methods: Sequence[MethodSpec],
    *,
    max_tokens: int = 256,
    repeats: int = 1,
    common: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> list[BenchRow]:
    """Baseline and each method alternate on every workload; tok/s are decode
    rates (prefill excluded: it is the same forward for every method), the
    median over ``repeats``. ``common`` options (e.g. ``temperature``, ``seed``)
    apply to every run, the baseline's included. Each run starts with an
    empty draft memory on the Target; a session's later requests (an agent's
    next edit, a retry) draft from what its earlier ones generated."""
    common = dict(common or {})
    rows: list[BenchRow] = []
    for w in workloads:
        runs = _alternating_runs(target, w, methods, max_tokens, repeats, common)
        for j in range(1 + len(w.then)):
            name, ids, _ = runs["baseline"][0][j]
            base = [x[j][2] for x in runs["baseline"]]
            base_rate = _median([x.stats.tokens_per_second for x in base])
            log(f"{name}: {len(ids)} prompt tokens, baseline {base_rate:.1f} tok/s")
            for m in methods:
                res = [x[j][2] for x in runs[m.label]]
                row = _method_row(target, w, m, name, ids, res, base, base_rate, common)
                rows.append(row)
                s = res[0].stats
                log(
                    f"  {m.label}: {row.tok_s:.1f} tok/s ({row.speedup:.2f}x), "
                    f"acceptance {s.acceptance_rate:.0%}, mean accepted length {s.mean_accepted_length:.2f}, "
                    f"identical={row.identical}"
                )
    return rows


def _alternating_runs(
    target: Target,
    w: Workload,
    methods: Sequence[MethodSpec],
    max_tokens: int,
    repeats: int,
    common: dict[str, Any],
) -> dict[str, list]:
    """``repeats`` sessions of ``w`` per method label ("baseline" included),
    the order of methods reversed every other repeat."""
    runs: dict[str, list] = {"baseline": []}
    for m in methods:
        runs[m.label] = []
    for r in range(repeats):
        order = [("baseline", {"method": "baseline"})] + [(m.label, m.options) for m in methods]
        if r % 2:
            order.reverse()
        for label, opts in order:
            runs[label].append(_run_session(target, w, max_tokens, {**common, **opts}))
    return runs


def _method_row(
    target: Target,
    w: Workload,
    m: MethodSpec,
    name: str,
    ids: list[int],
    res: list,
    base: list,
    base_rate: float,
    common: dict[str, Any],
) -> BenchRow:
    """The row of method ``m`` on request ``name``: ``res`` and ``base`` are
    its and the baseline's results over the repeats; where greedy outputs
    differ, the first differing position and the target's top-2 margin there."""
    rate = _median([x.stats.tokens_per_second for x in res])
    s = res[0].stats
    sampled = common.get("temperature", 0) > 0
    ident = None if sampled else res[0].tokens == base[0].tokens
    row = BenchRow(
        name,
        w.kind,
        m.label,
        len(res[0].tokens),
        rate,
        base_rate,
        s.acceptance_rate,
        s.mean_accepted_length,
        ident,
        drafted_per_accepted=s.drafted / s.accepted if s.accepted else 0.0,
    )
    if ident is False:
        a, b = res[0].tokens, base[0].tokens
        i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        row.first_diff = i
        row.margin = top2_margin(target, ids + b[:i])
    return row


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def bench_tables(rows: Sequence[BenchRow]) -> list[dict]:
    """The per-workload table and the per-kind summary (results-file tables)."""
    from .results import speedup_summary, table

    cells = []
    for r in rows:
        if r.identical is None:
            ident = "n/a (sampled)"
        elif r.identical:
            ident = "yes"
        else:
            ident = f"no: first diff at {r.first_diff}, top-2 margin {r.margin:.3g}"
        cells.append(
            [
                r.workload,
                r.method,
                r.tokens,
                f"{r.baseline_tok_s:.1f}",
                f"{r.tok_s:.1f}",
                f"{r.speedup:.2f}x",
                f"{r.acceptance:.0%}",
                f"{r.mean_accepted_length:.2f}",
                f"{r.drafted_per_accepted:.2f}",
                ident,
            ]
        )
    return [
        table(
            [
                "workload",
                "method",
                "tokens",
                "baseline tok/s",
                "method tok/s",
                "speed-up",
                "acceptance",
                "mean accepted length",
                "drafted per accepted",
                "identical",
            ],
            cells,
            "llrrrrrrrl",
        ),
        speedup_summary(rows, "workload kind", "lowest speed-up"),
    ]


def markdown_table(rows: Sequence[BenchRow]) -> str:
    from .results import render_tables

    return render_tables(bench_tables(rows))


def save_chart(rows: Sequence[BenchRow], path: str) -> bool:
    """A grouped bar chart of tok/s per workload and method; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    workloads = list(dict.fromkeys(r.workload for r in rows))
    methods = ["baseline", *dict.fromkeys(r.method for r in rows)]
    rate = {(r.workload, r.method): r.tok_s for r in rows}
    for r in rows:
        rate[(r.workload, "baseline")] = r.baseline_tok_s
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(8, len(workloads) * 1.3), 5))
    for i, m in enumerate(methods):
        xs = [j + i * width for j in range(len(workloads))]
        ax.bar(xs, [rate.get((w, m), 0) for w in workloads], width, label=m)
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(workloads))])
    ax.set_xticklabels(workloads, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tokens / second (decode)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def timestamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M")
