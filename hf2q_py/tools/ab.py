"""A/B checks: hf2q-py's plain greedy decoding against each speculative method,
another engine's greedy decoding (``engines.py``) or another engine's recorded
output (``ab_reference.py``), token for token (or byte for byte), with every
difference explained as a numerical near-tie or reported as a MISMATCH.

At the first difference the other side chose token b where plain decoding chose
a. Under plain decoding's logits L there, ``gap = L[a] - L[b]`` (the top-2 margin
when b is the runner-up). If the other side's logits differ from L by at most d
(after a shift), it can prefer b only when ``gap <= 2 d``: that is a near-tie.
The bound 2 d is measured, not assumed:

- methods: batched verification and single-token decoding use kernels whose
  reduction order differs; ``near_tie_bound`` measures twice the largest
  difference for the model and dtype at hand (the noise bound);
- engines that return logits: the noise bound plus twice the largest
  difference between the engines' logits (``logit_difference``: over each
  position's leading tokens, after a common shift) measured on the same prompt
  and on the tokens both produced before the difference;
- reference files (no logits): ``REFERENCE_FACTOR`` times the noise bound, or
  a bound the user gives.

With a quantized KV cache (the Target's ``kv``), plain decoding, the noise
bound and every method run with it, and each case is also decoded at full
precision (``KVEffect``): how often, and from which token on, quantizing the
cache changes the answer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any
from collections.abc import Callable, Sequence

import mlx.core as mx

from ..errors import Hf2qError
from ..generation import encode_prompt, generate
from ..kv import FULL_PRECISION, KVConfig
from ..target import Target
from .ab_reference import Reference, record_line
from .engines import Engine, EngineOutput, open_engine

#: A reference file's near-tie bound, in units of the measured noise bound.
REFERENCE_FACTOR = 10.0
#: Leading tokens per position (each side's) over which engines' logits are compared.
CANDIDATES = 10
#: Bytes of text shown either side of a text difference.
CONTEXT_BYTES = 24


@dataclass
class NoiseMeasurement:
    """Largest |batched - single-token| logit difference seen, and the bound."""

    max_logit_diff: float
    positions: int
    bound: float


@dataclass
class Trace:
    """hf2q-py's plain greedy decoding of one prompt: its tokens, whether it
    ended at an end-of-sequence token, and each step's logits (float32) and top 2
    (one more step than tokens when it ended: the step that chose the end)."""

    tokens: list[int]
    tops: list[list[tuple[int, float]]]
    rows: list[mx.array]
    ended: bool


@dataclass
class Case:
    """One prompt to check: its text (None when given as ids), ids, the tokens
    to decode, and another engine's recorded output when there is one."""

    prompt: str | None
    ids: list[int]
    max_tokens: int
    chat_template: bool = True
    reference: Reference | None = None

    @property
    def label(self) -> str:
        return self.prompt if self.prompt is not None else self.reference.label if self.reference else "ids"


@dataclass
class Divergence:
    """The first difference. Logits are plain decoding's at ``position``;
    ``method_token`` -1 means the other side ended there (its logit is then
    the best end-of-sequence id's)."""

    position: int
    baseline_token: int
    method_token: int
    context: str
    baseline_top2: list[tuple[int, float]]  # single-token decode logits
    batched_top2: list[tuple[int, float]]  # one batched forward over the same prefix
    margin: float  # baseline top-1 minus top-2 logit
    baseline_logit: float = 0.0
    method_logit: float | None = None  # None: unknown (no end-of-sequence id, or no tokenizer)
    method_rank: int | None = None  # 1 = plain decoding's own choice
    gap: float = float("inf")  # baseline_logit - method_logit
    byte_offset: int | None = None  # text comparisons: the first byte that differs


@dataclass
class ABResult:
    prompt: str
    method: str
    verdict: str  # "identical", "near-tie" or "MISMATCH"
    baseline_tokens: int  # output lengths, in ``unit``
    method_tokens: int
    min_margin: float  # smallest top-2 margin over the baseline's committed positions
    divergence: Divergence | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    kind: str = "method"  # "method", "engine" or "reference"
    bound: float = 0.0  # the near-tie bound this comparison used
    logit_diff: float | None = None  # engines: the measured logit difference (``logit_difference``)
    unit: str = "tokens"  # "bytes" for text references

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class KVEffect:
    """Plain greedy decoding of one case with the quantized KV cache against
    full precision: where the answers first differ (None: they do not)."""

    prompt: str
    kv: str
    first_difference: int | None
    quantized_tokens: int
    full_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ABReport:
    results: list[ABResult]
    noise: NoiseMeasurement | None  # None when nothing was compared (recording only)
    traces: list[Trace]  # plain greedy decoding of each case
    kv_effects: list[KVEffect] = field(default_factory=list)  # with a quantized KV cache

    def count(self, verdict: str) -> int:
        return sum(r.verdict == verdict for r in self.results)


def _top2(logits: mx.array) -> list[tuple[int, float]]:
    idx = mx.argsort(logits)[-2:].tolist()[::-1]
    vals = logits[mx.array(idx)].tolist()
    return [(int(i), float(v)) for i, v in zip(idx, vals)]


def baseline_trace(target: Target, prompt: list[int], max_tokens: int, kv: KVConfig | None = None) -> Trace:
    """Plain greedy decoding (the baseline's single-token forwards), keeping
    every step's logits; ``kv``: the caches' storage (default: the Target's)."""
    rt = target.runtime(kv=kv)
    if len(prompt) > 1:
        rt.prefill(prompt[:-1], logits="none")
    trace = Trace([], [], [], False)
    last = prompt[-1]
    for _ in range(max_tokens):
        row = rt.decode(last).logits[-1].astype(mx.float32)
        top = _top2(row)
        trace.rows.append(row)
        trace.tops.append(top)
        last = top[0][0]
        if last in target.eos_token_ids:
            trace.ended = True
            break
        trace.tokens.append(last)
    return trace


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


def first_difference(base: Trace, tokens: Sequence[int], ended: bool | None) -> int | None:
    """Where ``tokens`` first differ from the trace: a different token, or one
    side ending where the other goes on (``ended`` None: not known whether the
    other side ended, so a shorter output is compared as far as it goes)."""
    n = min(len(base.tokens), len(tokens))
    i = next((j for j in range(n) if base.tokens[j] != tokens[j]), None)
    if i is not None:
        return i
    if len(tokens) > len(base.tokens) and base.ended:
        return n
    if len(tokens) < len(base.tokens) and ended:
        return n
    return None


def _min_margin(base: Trace) -> float:
    margins = [t[0][1] - t[1][1] for t in base.tops[: len(base.tokens)]]
    return min(margins) if margins else float("inf")


def _decode(target: Target, ids: Sequence[int]) -> str:
    tok = target.tokenizer
    return tok.decode(list(ids)) if tok is not None else " ".join(map(str, ids))


def _divergence(
    target: Target, prompt_ids: list[int], base: Trace, i: int, other: int, context: str
) -> Divergence:
    """The logits at position ``i`` for plain decoding's token and ``other``
    (-1: the other side ended)."""
    row = base.rows[i]
    top = base.tops[i]
    bt = base.tokens[i] if i < len(base.tokens) else top[0][0]
    scored = other
    if other < 0:  # ended: the best end-of-sequence id stands for it
        eos = sorted(target.eos_token_ids)
        scored = max(eos, key=lambda t: row[t].item()) if eos else -1
    batched = target.runtime().prefill(prompt_ids + base.tokens[:i], logits="last").logits[-1]
    div = Divergence(
        i, bt, other, context, top, _top2(batched.astype(mx.float32)), top[0][1] - top[1][1], row[bt].item()
    )
    if 0 <= scored < row.shape[0] and scored != bt:
        div.method_logit = row[scored].item()
        div.method_rank = int((row > row[scored]).sum().item()) + 1
        div.gap = div.baseline_logit - div.method_logit
    return div


def compare(
    target: Target,
    prompt_ids: list[int],
    base: Trace,
    other: EngineOutput,
    bound: float,
    *,
    label: str,
    prompt_text: str = "",
    kind: str = "method",
) -> ABResult:
    """Classify another output against the baseline trace, token by token."""
    result = ABResult(
        prompt_text, label, "identical", len(base.tokens), len(other.tokens), _min_margin(base), kind=kind
    )
    result.bound = bound
    i = first_difference(base, other.tokens, other.ended)
    if i is None:
        return result
    mt = other.tokens[i] if i < len(other.tokens) else -1
    bt = base.tokens[i] if i < len(base.tokens) else base.tops[i][0][0]
    shown = _decode(target, [mt]) if mt >= 0 else "<end>"
    context = f"...{_decode(target, base.tokens[max(0, i - 8) : i])}[ baseline: {_decode(target, [bt])!r} | {label}: {shown!r} ]"
    result.divergence = _divergence(target, prompt_ids, base, i, mt, context)
    result.verdict = "near-tie" if result.divergence.gap <= bound else "MISMATCH"
    return result


def text_and_ends(target: Target, ids: Sequence[int]) -> tuple[str, list[int]]:
    """The text of ``ids`` as generation streams it, and the UTF-8 byte offset
    where each token's text ends."""
    if target.tokenizer is None:
        raise Hf2qError("this model has no tokenizer, so its output cannot be compared as text")
    detok = target.tokenizer.detokenizer
    detok.reset()
    text, ends, size = "", [], 0
    for t in ids:
        detok.add_token(t)
        piece = detok.last_segment  # read once: reading it moves the detokenizer on
        text += piece
        size += len(piece.encode("utf-8"))
        ends.append(size)
    detok.finalize()
    piece = detok.last_segment
    text += piece
    if ends:
        ends[-1] += len(piece.encode("utf-8"))
    return text, ends


def compare_text(
    target: Target,
    prompt_ids: list[int],
    base: Trace,
    text: str,
    ended: bool | None,
    bound: float,
    *,
    label: str,
    prompt_text: str = "",
) -> ABResult:
    """Classify another engine's text against the baseline's, byte by byte.

    At the first differing byte, the token of plain decoding that holds it is
    the position; the other side's token there is the first token of the
    other text from that token's start (as this model's tokenizer splits it).
    """
    mine, ends = text_and_ends(target, base.tokens)
    a, b = mine.encode("utf-8"), text.encode("utf-8")
    result = ABResult(prompt_text, label, "identical", len(a), len(b), _min_margin(base), kind="reference")
    result.bound, result.unit = bound, "bytes"
    n = min(len(a), len(b))
    off = next((j for j in range(n) if a[j] != b[j]), None)
    if off is None and ((len(b) > len(a) and base.ended) or (len(b) < len(a) and ended)):
        off = n
    if off is None:
        return result
    i = next((k for k, e in enumerate(ends) if e > off), len(base.tokens))
    start = ends[i - 1] if i > 0 else 0
    rest = b[start:].decode("utf-8", errors="replace")
    pieces = target.tokenizer.encode(rest, add_special_tokens=False) if rest else []
    other = pieces[0] if pieces else -1

    def show(data: bytes) -> str:
        return repr(data.decode("utf-8", errors="replace"))

    before = a[max(0, off - CONTEXT_BYTES) : off]
    context = (
        f"byte {off}: ...{show(before)}[ baseline: {show(a[off : off + CONTEXT_BYTES])} | "
        f"{label}: {show(b[off : off + CONTEXT_BYTES])} ]"
    )
    result.divergence = _divergence(target, prompt_ids, base, i, other, context)
    result.divergence.byte_offset = off
    result.verdict = "near-tie" if result.divergence.gap <= bound else "MISMATCH"
    return result


def logit_difference(pairs: Sequence[tuple[mx.array, mx.array]]) -> float:
    """How far two engines' logits are apart where a greedy choice is made:
    for each pair of rows, over each side's ``CANDIDATES`` highest logits, half
    the range of (ours - theirs), i.e. the largest difference left after the
    best common shift (so log-probabilities and logits compare alike). Two
    candidates' gaps then differ by at most twice it. The largest over the rows."""
    worst = 0.0
    for ours, theirs in pairs:
        if ours.shape[0] == 0 or theirs.shape[0] == 0:
            continue
        width = min(ours.shape[-1], theirs.shape[-1])
        ours, theirs = ours[:, :width].astype(mx.float32), theirs[:, :width].astype(mx.float32)
        k = min(CANDIDATES, width)
        idx = mx.concatenate(
            [mx.argpartition(-ours, k - 1, axis=-1)[:, :k], mx.argpartition(-theirs, k - 1, axis=-1)[:, :k]],
            axis=-1,
        )
        delta = mx.take_along_axis(ours, idx, axis=-1) - mx.take_along_axis(theirs, idx, axis=-1)
        worst = max(worst, ((delta.max(axis=-1) - delta.min(axis=-1)) / 2).max().item())
    return worst


def engine_difference(target: Target, ids: list[int], base: Trace, out: EngineOutput) -> float:
    """How far an engine's logits are from hf2q-py's on this case: at its
    prompt positions (against one batched forward) and at the steps before the
    first difference (against plain decoding's), where it returned them."""
    pairs = []
    if out.prompt_logits is not None and out.prompt_logits.shape[0]:
        first = len(ids) - 1 - out.prompt_logits.shape[0]  # rows for positions first .. len - 2
        rt = target.runtime()
        if first > 0:
            rt.prefill(ids[:first], logits="none")
        pairs.append((rt.prefill(ids[first:-1], logits="all").logits, out.prompt_logits))
    if out.logits is not None:
        i = first_difference(base, out.tokens, out.ended)
        n = min(len(base.rows), out.logits.shape[0]) if i is None else i
        if n:
            pairs.append((mx.stack(base.rows[:n]), out.logits[:n]))
    return logit_difference(pairs)


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


def prompt_cases(prompts: Sequence[tuple[str, list[int]]], max_tokens: int) -> list[Case]:
    """Cases for prompts (text, ids) without references."""
    return [Case(text, list(ids), max_tokens) for text, ids in prompts]


def reference_case(target: Target, ref: Reference) -> Case:
    """The case a reference describes, checked against the model: prompt ids,
    ids within the vocabulary, and the tokens to decode (the reference's
    ``max_tokens``; else as many as it holds, one more when it ended, or for
    text, as many as this model's tokenizer needs for it plus 16)."""
    ref.check_vocabulary(target.vocab_size)
    try:
        ids = ref.prompt_ids or encode_prompt(target, ref.prompt or "", ref.chat_template)
    except Hf2qError as e:
        raise Hf2qError(f"{ref.where}: {e}") from None
    tokens, ended = reference_tokens(target, ref)
    if ref.max_tokens is not None:
        n = ref.max_tokens
    elif tokens is not None:
        n = len(tokens) + (1 if ended else 0)
    else:
        if target.tokenizer is None:
            raise Hf2qError(f"{ref.where}: this model has no tokenizer to compare text with; give tokens")
        n = len(target.tokenizer.encode(ref.text or "", add_special_tokens=False)) + 16
    return Case(ref.prompt, list(ids), max(1, n), ref.chat_template, ref)


def reference_tokens(target: Target, ref: Reference) -> tuple[list[int] | None, bool | None]:
    """The reference's tokens (a final end-of-sequence id removed) and whether
    it ended: by ``finish_reason``, that final id, stopping short of
    ``max_tokens``, or having no output; None when not known."""
    out = ref.tokens if ref.tokens is not None else None
    eos_last = bool(out) and out[-1] in target.eos_token_ids
    if eos_last:
        out = out[:-1]
    if ref.finish_reason is not None:
        return out, ref.finish_reason == "stop"
    length = len(ref.tokens) if ref.tokens is not None else None
    if eos_last or length == 0 or (ref.text == "" and ref.tokens is None):
        return out, True
    if ref.max_tokens is not None and length is not None:
        return out, length < ref.max_tokens
    return out, None


def run_ab(
    target: Target,
    cases: Sequence[Case],
    methods: Sequence[tuple[str, dict[str, Any]]] = (),
    *,
    engines: Sequence[str | Engine] = (),
    reference_bound: float | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> ABReport:
    """Plain greedy decoding of every case against each method, each engine
    and the case's reference.

    ``methods``: (label, generate options); a label starting ``mlx-lm-draft``
    runs mlx-lm's speculative decoding with options ``draft`` (a Target) and ``k``.
    ``engines``: names from ``engines.ENGINES`` (opened and closed here) or
    ``Engine`` objects (the caller's to close). ``reference_bound``: the
    near-tie bound for references (default ``REFERENCE_FACTOR`` x the noise bound).
    """
    if not cases:
        raise Hf2qError("no prompts to compare")
    context = max(len(c.ids) + c.max_tokens for c in cases) + 1
    opened: list[Engine] = []
    try:
        for e in engines:
            if isinstance(e, str):
                opened.append(open_engine(e, target, context))
        given = iter(opened)
        ready = [next(given) if isinstance(e, str) else e for e in engines]
        return _run(target, cases, methods, ready, reference_bound, log)
    finally:
        for engine in opened:
            engine.close()


def _run(
    target: Target,
    cases: Sequence[Case],
    methods: Sequence[tuple[str, dict[str, Any]]],
    engines: Sequence[Engine],
    reference_bound: float | None,
    log: Callable[[str], None],
) -> ABReport:
    results: list[ABResult] = []
    traces: list[Trace] = []
    noise: NoiseMeasurement | None = None
    for case in cases:
        ids, n, name = case.ids, case.max_tokens, case.label[:60]
        base = baseline_trace(target, ids, n)
        traces.append(base)
        if noise is None and (methods or engines or case.reference is not None):
            noise = near_tie_bound(target, ids + base.tokens)
            log(
                f"near-tie bound {noise.bound:.3g} (2 x max |batched - single| logit difference "
                f"{noise.max_logit_diff:.3g} over {noise.positions} positions)"
            )
        case_results = []
        for label, opts in methods:
            assert noise is not None
            if label.startswith("mlx-lm-draft"):
                toks = mlx_lm_draft_tokens(target, opts["draft"], ids, n, opts.get("k", 4))
                out, stats = EngineOutput(toks, len(toks) < n), {}
            else:
                r = generate(target, ids, max_tokens=n, **opts)
                out, stats = EngineOutput(r.tokens, r.finish_reason == "stop"), r.stats.to_dict()
            res = compare(target, ids, base, out, noise.bound, label=label, prompt_text=name)
            res.stats = stats
            case_results.append(res)
        for engine in engines:
            assert noise is not None
            out = engine.generate(ids, n)
            diff = engine_difference(target, ids, base, out)
            bound = noise.bound + 2.0 * diff
            res = compare(target, ids, base, out, bound, label=engine.name, prompt_text=name, kind="engine")
            res.logit_diff = diff
            case_results.append(res)
        if case.reference is not None:
            assert noise is not None
            bound = reference_bound if reference_bound is not None else REFERENCE_FACTOR * noise.bound
            case_results.append(_reference_result(target, case, base, bound, name))
        for res in case_results:
            log(f"{name[:40]!r} {res.method}: {res.verdict}")
        results += case_results
    effects = kv_effects(target, cases, traces, log) if target.kv.quantized else []
    return ABReport(results, noise, traces, effects)


def kv_effects(
    target: Target, cases: Sequence[Case], traces: Sequence[Trace], log: Callable[[str], None]
) -> list[KVEffect]:
    """Each case's plain greedy decoding with the Target's quantized KV cache
    (``traces``) against the same decoding at full precision."""
    out = []
    for case, trace in zip(cases, traces):
        full = baseline_trace(target, case.ids, case.max_tokens, kv=FULL_PRECISION)
        i = first_difference(full, trace.tokens, trace.ended)
        out.append(KVEffect(case.label[:60], target.kv.describe(), i, len(trace.tokens), len(full.tokens)))
        log(f"{case.label[:40]!r} {target.kv.describe()} vs full precision: "
            f"{'same answer' if i is None else f'first difference at token {i}'}")  # fmt: skip
    return out


def _reference_result(target: Target, case: Case, base: Trace, bound: float, name: str) -> ABResult:
    ref = case.reference
    assert ref is not None
    tokens, ended = reference_tokens(target, ref)
    label = f"{ref.engine} ({ref.where})"
    if tokens is not None:
        res = compare(
            target, case.ids, base, EngineOutput(tokens, ended), bound, label=label, prompt_text=name
        )
        res.kind = "reference"
        return res
    return compare_text(target, case.ids, base, ref.text or "", ended, bound, label=label, prompt_text=name)


def record_lines(target: Target, cases: Sequence[Case], traces: Sequence[Trace]) -> list[dict[str, Any]]:
    """Plain greedy decoding's outputs of ``cases`` in the reference format."""
    lines = []
    for case, trace in zip(cases, traces):
        text = text_and_ends(target, trace.tokens)[0] if target.tokenizer is not None else None
        lines.append(
            record_line(
                prompt=case.prompt,
                prompt_ids=case.ids,
                chat_template=case.chat_template,
                tokens=trace.tokens,
                text=text,
                max_tokens=case.max_tokens,
                ended=trace.ended,
                model=str(target.source),
            )
        )
    return lines


def table(results: Sequence[ABResult]) -> str:
    rows = [
        "| prompt | compared | verdict | length (base/other) | first diff | logits there (base/other) "
        "| other's rank | margin | bound | batched top-2 | min margin |",
        "|---|---|---|---|---:|---|---:|---:|---:|---|---:|",
    ]
    for r in results:
        d = r.divergence
        first = "-"
        logits = rank = margin = btop = "-"
        if d is not None:
            first = str(d.position) + (f" (byte {d.byte_offset})" if d.byte_offset is not None else "")
            other = f"{d.method_logit:.4g}" if d.method_logit is not None else "?"
            logits = f"{d.baseline_logit:.4g} / {other}"
            rank = str(d.method_rank) if d.method_rank is not None else "?"
            margin = f"{d.margin:.3g}"
            btop = ", ".join(f"{t}:{v:.3f}" for t, v in d.batched_top2)
        prompt = r.prompt.replace("\n", " ").replace("|", "\\|")
        method = r.method.replace("|", "\\|")
        unit = "" if r.unit == "tokens" else f" {r.unit}"
        rows.append(
            f"| {prompt} | {method} | {r.verdict} | {r.baseline_tokens}/{r.method_tokens}{unit} | "
            f"{first} | {logits} | {rank} | {margin} | {r.bound:.3g} | {btop} | {r.min_margin:.3g} |"
        )
    return "\n".join(rows)


def kv_table(effects: Sequence[KVEffect]) -> str:
    """The quantized KV cache's answers against full precision, one row a case."""
    rows = [
        "| prompt | KV cache | against full precision | first difference | length (quantized/full) |",
        "|---|---|---|---:|---|",
    ]
    for e in effects:
        prompt = e.prompt.replace("\n", " ").replace("|", "\\|")
        verdict = "same answer" if e.first_difference is None else "differs"
        first = "-" if e.first_difference is None else str(e.first_difference)
        rows.append(f"| {prompt} | {e.kv} | {verdict} | {first} | {e.quantized_tokens}/{e.full_tokens} |")
    return "\n".join(rows)


def kv_summary(effects: Sequence[KVEffect]) -> str:
    """How often the quantized KV cache changed the answer, in one line."""
    changed = [e.first_difference for e in effects if e.first_difference is not None]
    where = f" (first differences at tokens {', '.join(map(str, changed))})" if changed else ""
    return (
        f"{effects[0].kv} against full precision: {len(changed)} of {len(effects)} answers differ{where}; "
        "every method above is judged against plain decoding with the same KV cache"
    )


def summary(report: ABReport) -> str:
    """The counts, and how each kind of comparison's near-tie bound was made."""
    noise = report.noise
    if noise is None:
        return "nothing compared"
    kinds = {r.kind for r in report.results}
    lines = [
        f"near-tie bound {noise.bound:.3g}: 2 x the largest |batched - single-token| logit difference "
        f"({noise.max_logit_diff:.3g}) measured over {noise.positions} positions"
    ]
    if "engine" in kinds:
        diffs = [r.logit_diff for r in report.results if r.kind == "engine" and r.logit_diff is not None]
        lines.append(
            f"engines: that bound + 2 x the largest logit difference between the engines (over each "
            f"position's {CANDIDATES} leading tokens, after a common shift) measured on each prompt and "
            f"the tokens before the first difference (largest {max(diffs, default=0.0):.3g})"
        )
    if "reference" in kinds:
        bound = next(r.bound for r in report.results if r.kind == "reference")
        lines.append(f"references (no logits): bound {bound:.3g}")
    lines.append(
        f"{report.count('identical')} identical, {report.count('near-tie')} near-tie, "
        f"{report.count('MISMATCH')} MISMATCH"
    )
    return "; ".join(lines)
