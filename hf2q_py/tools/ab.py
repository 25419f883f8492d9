"""A/B checks: each speculative method against plain greedy decoding, token
for token, with every difference explained as a numerical near-tie or
reported as a MISMATCH (a real fault).

Batched verification computes logits with matrix kernels whose reduction
order differs from single-token decoding, so logits differ by a small,
measurable amount. A method may then pick a different token only where the
target's top-2 margin is within twice that difference. ``near_tie_bound``
measures it for the model and dtype at hand.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any
from collections.abc import Callable, Sequence

import mlx.core as mx

from ..errors import Hf2qError
from ..generation import generate
from ..target import Target


@dataclass
class NoiseMeasurement:
    """Largest |batched - single-token| logit difference seen, and the bound."""

    max_logit_diff: float
    positions: int
    bound: float


@dataclass
class Divergence:
    position: int
    baseline_token: int
    method_token: int
    context: str
    baseline_top2: list[tuple[int, float]]  # single-token decode logits
    batched_top2: list[tuple[int, float]]  # one batched forward over the same prefix
    margin: float  # baseline top-1 minus top-2 logit


@dataclass
class ABResult:
    prompt: str
    method: str
    verdict: str  # "identical", "near-tie" or "MISMATCH"
    baseline_tokens: int
    method_tokens: int
    min_margin: float  # smallest top-2 margin over the baseline's committed positions
    divergence: Divergence | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _top2(logits: mx.array) -> list[tuple[int, float]]:
    idx = mx.argsort(logits)[-2:].tolist()[::-1]
    vals = logits[mx.array(idx)].tolist()
    return [(int(i), float(v)) for i, v in zip(idx, vals)]


def baseline_trace(
    target: Target, prompt: list[int], max_tokens: int
) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """Plain greedy decoding (the baseline's single-token forwards) with the
    top-2 logits of every step."""
    rt = target.runtime()
    if len(prompt) > 1:
        rt.prefill(prompt[:-1], logits="none")
    tokens, tops = [], []
    last = prompt[-1]
    for _ in range(max_tokens):
        logits = rt.decode(last).logits[-1].astype(mx.float32)
        top = _top2(logits)
        tops.append(top)
        last = top[0][0]
        if last in target.eos_token_ids:
            break
        tokens.append(last)
    return tokens, tops


def near_tie_bound(target: Target, tokens: Sequence[int], max_positions: int = 96) -> NoiseMeasurement:
    """Measure batched vs single-token logits on ``tokens`` (prompt plus
    output): the bound is twice the largest difference seen."""
    tokens = list(tokens)[: max_positions + 1]
    batched = target.runtime().prefill(tokens, logits="all").logits.astype(mx.float32)
    rt = target.runtime()
    worst = 0.0
    for i, t in enumerate(tokens):
        single = rt.decode(t).logits[-1].astype(mx.float32)
        worst = max(worst, mx.abs(single - batched[i]).max().item())
    return NoiseMeasurement(worst, len(tokens), 2.0 * worst)


def compare(
    target: Target,
    prompt_ids: list[int],
    base_tokens: list[int],
    base_tops: list[list[tuple[int, float]]],
    method_tokens: list[int],
    bound: float,
    *,
    label: str,
    prompt_text: str = "",
) -> ABResult:
    """Classify one method's output against the baseline trace."""
    n = min(len(base_tokens), len(method_tokens))
    i = next((j for j in range(n) if base_tokens[j] != method_tokens[j]), None)
    if i is None and len(base_tokens) != len(method_tokens):
        i = n  # one stopped (EOS) where the other went on
    margins = [t[0][1] - t[1][1] for t in base_tops[: len(base_tokens)]]
    min_margin = min(margins) if margins else float("inf")
    if i is None:
        return ABResult(prompt_text, label, "identical", len(base_tokens), len(method_tokens), min_margin)
    prefix = prompt_ids + base_tokens[:i]
    batched = target.runtime().prefill(prefix, logits="last").logits[-1].astype(mx.float32)
    top = base_tops[i]
    margin = top[0][1] - top[1][1]
    tok = target.tokenizer

    def text(ids):
        return tok.decode(ids) if tok is not None else " ".join(map(str, ids))

    mt = method_tokens[i] if i < len(method_tokens) else -1
    bt = base_tokens[i] if i < len(base_tokens) else top[0][0]
    context = f"...{text(base_tokens[max(0, i - 8) : i])}[ baseline: {text([bt])!r} | method: {text([mt]) if mt >= 0 else '<end>'!r} ]"
    div = Divergence(i, bt, mt, context, top, _top2(batched), margin)
    verdict = "near-tie" if margin <= bound else "MISMATCH"
    return ABResult(prompt_text, label, verdict, len(base_tokens), len(method_tokens), min_margin, div)


def mlx_lm_draft_tokens(
    target: Target, draft: Target, prompt: list[int], max_tokens: int, k: int
) -> list[int]:
    """mlx-lm's own ``speculative_generate_step`` with the same pair, for comparison."""
    from mlx_lm.generate import speculative_generate_step

    out = []
    for tok, _, _ in speculative_generate_step(
        mx.array(prompt), target.model, draft.model, num_draft_tokens=k, max_tokens=max_tokens
    ):
        tok = int(tok)
        if tok in target.eos_token_ids:
            break
        out.append(tok)
    return out


def run_ab(
    target: Target,
    prompts: Sequence[tuple[str, list[int]]],
    methods: Sequence[tuple[str, dict[str, Any]]],
    *,
    max_tokens: int = 128,
    log: Callable[[str], None] = lambda s: None,
) -> tuple[list[ABResult], NoiseMeasurement]:
    """Every method on every prompt against the greedy baseline.

    ``methods``: (label, generate options); a label starting ``mlx-lm-draft``
    runs mlx-lm's speculative decoding with options ``draft`` (a Target) and ``k``.
    """
    if not prompts:
        raise Hf2qError("no prompts to compare")
    results: list[ABResult] = []
    noise: NoiseMeasurement | None = None
    for text, ids in prompts:
        base, tops = baseline_trace(target, ids, max_tokens)
        if noise is None:
            noise = near_tie_bound(target, ids + base)
            log(
                f"near-tie bound {noise.bound:.3g} (2 x max |batched - single| logit difference "
                f"{noise.max_logit_diff:.3g} over {noise.positions} positions)"
            )
        for label, opts in methods:
            if label.startswith("mlx-lm-draft"):
                toks = mlx_lm_draft_tokens(target, opts["draft"], ids, max_tokens, opts.get("k", 4))
                stats = {}
            else:
                r = generate(target, ids, max_tokens=max_tokens, **opts)
                toks, stats = r.tokens, r.stats.to_dict()
            res = compare(target, ids, base, tops, toks, noise.bound, label=label, prompt_text=text[:60])
            res.stats = stats
            results.append(res)
            log(f"{text[:40]!r} {label}: {res.verdict}")
    return results, noise


def table(results: Sequence[ABResult]) -> str:
    rows = [
        "| prompt | method | verdict | tokens (base/method) | first diff | margin there | batched top-2 | min margin |",
        "|---|---|---|---|---:|---:|---|---:|",
    ]
    for r in results:
        d = r.divergence
        first = str(d.position) if d else "-"
        margin = f"{d.margin:.3g}" if d else "-"
        btop = ", ".join(f"{t}:{v:.3f}" for t, v in d.batched_top2) if d else "-"
        prompt = r.prompt.replace("\n", " ").replace("|", "\\|")
        rows.append(
            f"| {prompt} | {r.method} | {r.verdict} | {r.baseline_tokens}/{r.method_tokens} | "
            f"{first} | {margin} | {btop} | {r.min_margin:.3g} |"
        )
    return "\n".join(rows)
