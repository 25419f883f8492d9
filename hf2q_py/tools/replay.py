"""Offline replay: draft proposers judged against recorded greedy streams.

A greedy answer does not depend on how it was drafted, so once the plain
answer to each prompt is recorded, any model-free proposer (and its
draft-length policy) can be run against it without the model. The engine's
own loop runs on a recorded Target (``tools/recorded.py``): every verify
accepts the longest prefix that matches the recorded answer plus one token,
exactly as verification would, and time is modelled from measured forward
costs (seconds of a forward of L tokens; decodes queued back to back
overlap, one that restarts the pipeline costs ``restart`` more), so
settings compare without timing noise:

    python -m hf2q_py.tools.replay --streams streams.json --record      # once, with the model
    python -m hf2q_py.tools.replay --streams streams.json --methods "ngram;ngram:ngram_proposer=lookup,k=16"

Requests of one session (an agent's successive edits) replay in order on
one memory, as on one Target; every other stream starts with an empty one.
What adaptive K learns of forward costs carries from stream to stream, as
on one Target. The model of time leaves out drafting time and other load
on the machine: it ranks proposers and settings; ``hf2q-py bench``
measures speed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence

from ..draft_length import FixedK, Policy
from ..generation import generate_tokens
from ..errors import Hf2qError
from ..memory import DraftMemory
from ..proposers.base import Draft, Proposer
from ..stats import GenerationStats, Round
from ..target import Kept
from .recorded import RecordedTarget

#: Forward widths measured for the cost model: every width a verify of up to
#: 32 drafts feeds (cost need not grow with the width: on a CPU, matrix
#: kernels handle some row counts better than fewer), and 48.
COST_WIDTHS = (*range(1, 34), 48)


@dataclass
class Stream:
    """One request's prompt ids and recorded greedy answer ids."""

    name: str
    kind: str
    prompt: list[int]
    output: list[int]
    session: str | None = None  # streams of one session share a memory, in order
    line_breaks: list[int] = field(default_factory=list)  # its vocabulary's line-break tokens
    drafting: list[list[int]] = field(
        default_factory=list
    )  # more texts to draft from (a server's quoted views)


@dataclass
class CostModel:
    """Seconds of one forward of ``width`` tokens, measured at a context, and
    ``restart``: the extra seconds of the first plain decode after a verify
    round (plain decodes are pipelined, a verify round is not)."""

    seconds: dict[int, float]
    restart: float = 0.0

    def __call__(self, width: int) -> float:
        ws = sorted(self.seconds)
        if width <= ws[0]:
            return self.seconds[ws[0]]
        for a, b in zip(ws, ws[1:]):
            if width <= b:
                f = (width - a) / (b - a)
                return self.seconds[a] * (1 - f) + self.seconds[b] * f
        a, b = ws[-2], ws[-1]  # extrapolate the last slope
        return self.seconds[b] + (self.seconds[b] - self.seconds[a]) / (b - a) * (width - b)

    def with_growth(self, growth: float) -> CostModel:
        """This model with each width's extra cost over one token scaled by
        ``growth``: 0 makes every forward cost a decode, 1 changes nothing
        (a backend whose wider forwards cost less, modelled)."""
        if not growth >= 0:
            raise Hf2qError(f"the cost growth must be >= 0, got {growth}")
        one = self(1)
        return replace(self, seconds={w: one + growth * (s - one) for w, s in self.seconds.items()})


@dataclass
class ReplayRow:
    name: str
    kind: str
    method: str
    tokens: int
    rounds: int
    verify_rounds: int
    drafted: int
    accepted: int
    seconds: float  # modelled
    baseline_seconds: float  # modelled: one single-token forward per token
    per_position: list[int] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted / self.verify_rounds if self.verify_rounds else 1.0

    @property
    def drafted_per_accepted(self) -> float:
        return self.drafted / self.accepted if self.accepted else float("inf") if self.drafted else 0.0

    @property
    def speedup(self) -> float:
        return self.baseline_seconds / self.seconds if self.seconds else 0.0


def replay_stream(
    stream: Stream, target: RecordedTarget, proposer: Proposer | None, policy: Policy | None
) -> GenerationStats:
    """Run the engine's loop on ``stream`` (``target`` answers from it) with
    ``proposer`` and ``policy``; the statistics' ``decode_seconds`` is
    modelled time. Every committed token equals the recorded answer's."""
    stats = GenerationStats()
    out: list[int] = []
    for new in generate_tokens(
        target, stream.prompt, max_tokens=len(stream.output), proposer=proposer, policy=policy, stats=stats
    ):
        out += new
    if out != stream.output:  # the recorded runtime only ever points at the answer
        raise Hf2qError(f"replay of {stream.name!r} left its recorded answer")
    return stats


class _Replayer:
    """Recorded targets for a list of streams: streams of one session share a
    memory, in order; every other stream starts with an empty one. All
    share what adaptive K learns of forward costs, as on one Target; with
    ``cold``, each session (and each other stream) starts on a freshly
    loaded Target instead, nothing measured yet."""

    def __init__(self, cost: CostModel, cold: bool = False):
        self.cost, self.cold, self.kept = cost, cold, Kept()
        self.memories: dict[str, DraftMemory] = {}

    def target(self, s: Stream) -> RecordedTarget:
        first = s.session is None or s.session not in self.memories
        if self.cold and first:
            self.kept = Kept()
        memory = self.memories.setdefault(s.session, DraftMemory()) if s.session else DraftMemory()
        for tokens in s.drafting:  # as the scheduler adds a request's drafting sources
            memory.add(tokens)
        return RecordedTarget(
            s.prompt, s.output, self.cost, self.cost.restart, memory, self.kept, frozenset(s.line_breaks)
        )

    def row(self, s: Stream, label: str, stats: GenerationStats) -> ReplayRow:
        plain = replay_stream(s, RecordedTarget(s.prompt, s.output, self.cost, self.cost.restart), None, None)
        return ReplayRow(
            s.name, s.kind, label, len(s.output), stats.rounds, stats.verify_rounds, stats.drafted,
            stats.accepted, stats.decode_seconds, plain.decode_seconds,
        )  # fmt: skip


def replay(
    streams: Sequence[Stream], label: str, options: dict[str, Any], cost: CostModel, cold: bool = False
) -> list[ReplayRow]:
    """Replay every stream with the method ``options`` (SpecConfig fields);
    ``cold``: each session on a freshly loaded Target (see ``_Replayer``)."""
    from ..methods import SpecConfig, build_proposer

    rows = []
    replayer = _Replayer(cost, cold)
    for s in streams:
        spec = SpecConfig(**options)
        if spec.method != "ngram":
            raise Hf2qError(f"replay runs model-free methods only (ngram), not {spec.method!r}")
        target = replayer.target(s)
        proposer, policy = build_proposer(target, spec)
        rows.append(replayer.row(s, label, replay_stream(s, target, proposer, policy)))
    return rows


#: The label of the bound's rows.
BOUND_LABEL = "bound: suffix drafts, accepted length known"


class _AcceptedPrefix(Proposer):
    """The suffix proposer's uncut drafts, cut to the prefix the recorded
    answer accepts: what a perfect draft-length policy over them would draft."""

    def __init__(self, stream: Stream, memory: DraftMemory, k_max: int):
        self.inner = _uncut(memory, stream.line_breaks, k_max)
        self.prompt_len, self.answer = len(stream.prompt), stream.output

    def start(self, *args) -> None:
        self.inner.start(*args)

    def propose(self, tokens: Sequence[int], k: int) -> Draft:
        drafts, truth = self.inner.propose(tokens, k).tokens, self.answer[len(tokens) - self.prompt_len :]
        n = 0
        while n < len(drafts) and n < len(truth) and drafts[n] == truth[n]:
            n += 1
        return Draft(drafts[:n])

    def update(self, *args) -> None:
        self.inner.update(*args)

    def finish(self, tokens: Sequence[int]) -> None:
        self.inner.finish(tokens)


def bound(streams: Sequence[Stream], cost: CostModel, k_max: int = 32) -> list[ReplayRow]:
    """Every stream replayed with the suffix proposer's drafts cut to what the
    target accepts (at most ``k_max``; rounds where it accepts none decode
    plainly): an upper bound for draft-length policies over those drafts.
    Sessions share a memory, in order."""
    rows = []
    replayer = _Replayer(cost)
    for s in streams:
        target = replayer.target(s)
        stats = replay_stream(s, target, _AcceptedPrefix(s, target.memory, k_max), FixedK(k_max))
        rows.append(replayer.row(s, BOUND_LABEL, stats))
    return rows


#: The label of the key oracle's rows.
KEY_ORACLE_LABEL = "key oracle: best K per draft key, its acceptance known"


def _uncut(memory: DraftMemory, line_breaks: Sequence[int], k_max: int) -> Proposer:
    from ..proposers.suffix import SuffixOptions, SuffixProposer

    options = SuffixOptions(min_prob=0.0, factor=float(k_max), offset=k_max)
    return SuffixProposer(options, memory, frozenset(line_breaks))


def key_survival(streams: Sequence[Stream], k_max: int = 32) -> dict[Hashable, list[float]]:
    """Per suffix draft key, the fraction of its uncut drafts the answers
    accept to each depth 1..``k_max``, over every answer position where the
    proposer matches (sessions share a memory, in order)."""
    tried: dict[Hashable, list[int]] = defaultdict(lambda: [0] * k_max)
    hits: dict[Hashable, list[int]] = defaultdict(lambda: [0] * k_max)
    memories: dict[str, DraftMemory] = {}
    for s in streams:
        memory = memories.setdefault(s.session, DraftMemory()) if s.session else DraftMemory()
        for extra in s.drafting:
            memory.add(extra)
        proposer = _uncut(memory, s.line_breaks, k_max)
        tokens = list(s.prompt)
        proposer.start(None, tokens, {}, None)
        for j, token in enumerate(s.output):
            key = proposer.draft_key(tokens)
            drafts = proposer.propose(tokens, k_max).tokens if key != 0 else []
            accepted = next((i for i, (d, t) in enumerate(zip(drafts, s.output[j:])) if d != t), None)
            accepted = min(len(drafts), len(s.output) - j) if accepted is None else accepted
            for i in range(min(accepted + 1, len(drafts))):
                tried[key][i] += 1
                hits[key][i] += i < accepted
            tokens.append(token)
        proposer.finish(tokens)
    survival = {}
    for key, n in tried.items():
        p, survival[key] = 1.0, []
        for t, h in zip(n, hits[key]):
            p *= h / t if t else 0.0
            survival[key].append(p)
    return survival


class _KeyTable:
    """A draft-length policy that knows each key's acceptance (``key_survival``)
    and the true forward costs: K maximises expected tokens per modelled second."""

    def __init__(self, survival: dict[Hashable, list[float]], cost: CostModel, k_max: int):
        self.k_max, self.survival, self.cost = k_max, survival, cost

    def next_k(self, key: Hashable = None) -> int:
        best, best_rate, total = 0, 1.0 / self.cost(1), 1.0
        for k, p in enumerate(self.survival.get(key, ()), start=1):
            total += p
            if total / self.cost(k + 1) > best_rate:
                best, best_rate = k, total / self.cost(k + 1)
        return best

    def update(self, r: Round) -> None:
        pass

    def prefilled(self, tokens: int, seconds: float) -> None:
        pass


def key_oracle(streams: Sequence[Stream], cost: CostModel, k_max: int = 32) -> list[ReplayRow]:
    """Every stream replayed with the suffix proposer's uncut drafts and the
    best fixed K per draft key, each key's acceptance measured on these same
    streams (``key_survival``): a draft-length policy that sees only the
    draft key, told in advance how far each key's drafts run here. Each
    round maximises its own expected tokens per second, so this is a
    reference, not a bound: finer keys can model less."""
    survival = key_survival(streams, k_max)
    replayer = _Replayer(cost)
    rows = []
    for s in streams:
        target = replayer.target(s)
        proposer = _uncut(target.memory, s.line_breaks, k_max)
        stats = replay_stream(s, target, proposer, _KeyTable(survival, cost, k_max))
        rows.append(replayer.row(s, KEY_ORACLE_LABEL, stats))
    return rows


#: The label of the reference rule's rows.
REFERENCE_LABEL = "reference: mlx-dspark lookup rule"


def reference(streams: Sequence[Stream], cost: CostModel) -> list[ReplayRow]:
    """Every stream replayed with mlx-dspark's lookup rule (``lookup_reference.py``)
    in the same loop: a peer's proposal rule on the same recorded answers."""
    from .lookup_reference import LONG, LookupReference

    replayer = _Replayer(cost)
    rows = []
    for s in streams:
        stats = replay_stream(s, replayer.target(s), LookupReference(), FixedK(LONG))
        rows.append(replayer.row(s, REFERENCE_LABEL, stats))
    return rows


def record_streams(target, workloads, max_tokens: int, log: Callable[[str], None] = print) -> list[Stream]:
    """Plain greedy answers to every request of ``workloads`` (sessions in order)."""
    from ..generation import encode_prompt, generate

    streams = []
    for w in workloads:
        answers: list[str] = []
        requests = w.requests(answers)
        j = 0
        while j < len(requests):
            name, prompt = requests[j]
            ids = encode_prompt(target, prompt)
            res = generate(target, ids, max_tokens=max_tokens, method="baseline")
            session = w.name if w.then else None
            streams.append(Stream(name, w.kind, ids, res.tokens, session, sorted(target.line_breaks)))
            log(f"recorded {name}: {len(ids)} + {len(res.tokens)} tokens")
            answers.append(res.text)
            requests = w.requests(answers)
            j += 1
    return streams


def measure_costs(
    target, context: Sequence[int], widths: Sequence[int] = COST_WIDTHS, repeats: int = 7
) -> CostModel:
    """Seconds of a forward of each width (all logits) after ``context``: the
    median of ``repeats``, widths interleaved so that load on the machine
    touches them alike."""
    import mlx.core as mx

    rt = target.runtime(slack=max(widths) + 2)
    rt.prefill(list(context), logits="none")
    mx.eval(rt.state())
    feed = list(context)[-max(widths) :] * (1 + max(widths) // max(1, len(context)))
    times: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(repeats + 1):  # the first pass warms up
        for w in widths:
            t = time.perf_counter()
            fwd = rt.verify(feed[:w])
            mx.eval(fwd.logits)
            times[w].append(time.perf_counter() - t)
            rt.trim(w)
    return CostModel({w: statistics.median(times[w][1:]) for w in sorted(times)})


def save(path: str, streams: Sequence[Stream], cost: CostModel, source: str) -> None:
    data = {
        "model": source,
        "cost_seconds": {str(k): v for k, v in cost.seconds.items()},
        "restart_seconds": cost.restart,
        "streams": [s.__dict__ for s in streams],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


def load(path: str) -> tuple[list[Stream], CostModel]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise Hf2qError(f"cannot read replay streams {path}: {e}") from None
    cost = CostModel(
        {int(k): float(v) for k, v in data["cost_seconds"].items()}, float(data.get("restart_seconds", 0.0))
    )
    return [Stream(**s) for s in data["streams"]], cost


def replay_tables(rows: Sequence[ReplayRow]) -> list[dict]:
    """The per-stream table and the per-kind summary (results-file tables)."""
    from .results import speedup_summary, table

    cells = [
        [
            r.name,
            r.method,
            r.tokens,
            f"{r.mean_accepted_length:.2f}",
            f"{r.drafted_per_accepted:.2f}",
            f"{r.speedup:.2f}x",
        ]
        for r in rows
    ]
    return [
        table(
            [
                "stream",
                "method",
                "tokens",
                "mean accepted length",
                "drafted per accepted",
                "modelled speed-up",
            ],
            cells,
            "llrrrr",
        ),
        speedup_summary(rows),
    ]


def markdown(rows: Sequence[ReplayRow]) -> str:
    from .results import render_tables

    return render_tables(replay_tables(rows))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m hf2q_py.tools.replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", required=True, help="JSON file of recorded streams and forward costs")
    ap.add_argument("--record", action="store_true", help="record the streams with the model (greedy) first")
    ap.add_argument(
        "--measure-costs", action="store_true", help="measure the forward costs again (keep the streams)"
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="answer length to record (default 256); when replaying, cut answers to this many tokens",
    )
    ap.add_argument("--only", default=None, help="replay only streams whose name contains this text")
    ap.add_argument(
        "--restart-cost",
        type=float,
        default=None,
        help="extra cost of a plain decode that restarts the pipeline (after a verify round), in "
        "decodes (default: the streams file's, else 0)",
    )
    ap.add_argument(
        "--cost-growth",
        type=float,
        default=None,
        help="scale each width's extra cost over a decode by this factor (0: every forward costs a "
        "decode; models a backend whose wider forwards cost less)",
    )
    ap.add_argument(
        "--methods",
        default="ngram;ngram:ngram_proposer=lookup,k=16",
        help="';'-separated methods with options, as for hf2q-py bench",
    )
    ap.add_argument(
        "--bound",
        action="store_true",
        help="also replay the suffix proposer's drafts with the best K per draft key, each key's "
        "acceptance on these streams known (a reference), and cut to what the target accepts (an "
        "upper bound)",
    )
    ap.add_argument(
        "--cold",
        action="store_true",
        help="each session (or lone request) on a freshly loaded Target: forward costs not yet "
        "measured, as for a first request or a CLI call",
    )
    ap.add_argument(
        "--reference",
        action="store_true",
        help="also replay mlx-dspark's lookup rule (a peer's proposer, re-stated) in the same loop",
    )
    ap.add_argument("--results", default=None, help="also write a results file (JSON) here")
    return ap


def streams_and_costs(args: argparse.Namespace) -> tuple[list[Stream], CostModel]:
    """The streams and forward costs to replay: recorded or re-measured with
    the built-in model first if asked, then adjusted and cut as asked."""
    if args.record or args.measure_costs:
        import hf2q_py

        target = hf2q_py.load(dtype="float32")
        if args.record:
            from .workloads import default_workloads

            streams = record_streams(target, default_workloads(), args.max_tokens or 256)
        else:
            streams, _ = load(args.streams)
        save(
            args.streams, streams, measure_costs(target, streams[0].prompt + streams[0].output), target.source
        )
    streams, cost = load(args.streams)
    if args.restart_cost is not None:
        if args.restart_cost < 0:
            raise Hf2qError(f"--restart-cost must be >= 0, got {args.restart_cost}")
        cost.restart = args.restart_cost * cost(1)
    if args.cost_growth is not None:
        cost = cost.with_growth(args.cost_growth)
    streams = [s for s in streams if args.only is None or args.only in s.name]
    if args.max_tokens is not None:  # a greedy answer's first N tokens are the answer to max_tokens=N
        if args.max_tokens < 1:
            raise Hf2qError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        streams = [replace(s, output=s.output[: args.max_tokens]) for s in streams]
    return streams, cost


def relative_costs(cost: CostModel) -> str:
    return ", ".join(f"{w}: {cost(w) / cost(1):.2f}" for w in sorted(cost.seconds))


def write_results(path: str, argv: Sequence[str] | None, rows: list[ReplayRow], cost: CostModel) -> None:
    from . import results

    command = "python -m hf2q_py.tools.replay " + shlex.join(list(sys.argv[1:] if argv is None else argv))
    notes = f"Modelled speed-ups: {relative_costs(cost)} (forward cost relative to one token)."
    results.write(
        path, results.record(command, replay_tables(rows), notes=notes, data=[asdict(r) for r in rows])
    )


def main(argv: Sequence[str] | None = None) -> int:
    from ..method_spec import parse_methods

    args = parser().parse_args(argv)
    try:
        streams, cost = streams_and_costs(args)
        print(
            f"modelled forward cost relative to one token: {relative_costs(cost)}; "
            f"pipeline restart: {cost.restart / cost(1):.2f}\n"
        )
        rows = []
        for m in parse_methods(args.methods):
            rows += replay(streams, m.label, m.options, cost, cold=args.cold)
        if args.bound:
            rows += key_oracle(streams, cost) + bound(streams, cost)
        if args.reference:
            rows += reference(streams, cost)
        print(markdown(rows))
        if args.results:
            write_results(args.results, argv, rows, cost)
    except Hf2qError as e:
        print(f"hf2q-py replay: error: {e}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
