"""The session benchmark's levers, replayed offline: the recorded requests of
``bench_agent_session.py`` (its ``--script`` and ``--streams`` files) replayed
with the suffix proposer as it was and with each lever, in the engine's own
loop on a recorded Target (``hf2q_py.tools.replay``): forwards per
generated token, mean accepted length and the modelled speed-up, free of
timing noise.

Levers: *resume* (``CopyTrack``: after an edit such as a rename, drafts
resume where the copy left off in its source) and the *views now*
(``quoted_views``: a Read result's lines without their numbers, as an edit's
``old_string`` copies them; each text also with only its line breaks
escaped, as small models write code into a call; no system texts) against
the views before (every long text JSON-quoted). The requests replay
in order on one memory, each with the views its conversation gives, as the
server adds them.

    python benchmarks/bench_session_levers.py --script S.json --streams T.json [--results R.json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hf2q_py

import hf2q_py  # noqa: E402, F401  first: OpenBLAS before mlx.core

import claude_session as cs  # noqa: E402
from bench_agent_session import GGUF  # noqa: E402

from hf2q_py.draft_length.adaptive import AdaptiveK  # noqa: E402
from hf2q_py.errors import Hf2qError, run_script  # noqa: E402
from hf2q_py.memory import DraftMemory  # noqa: E402
from hf2q_py.proposers.suffix import SuffixOptions, SuffixProposer  # noqa: E402
from hf2q_py.server.anthropic_protocol import MessagesRequest, conversation  # noqa: E402
from hf2q_py.server.tool_calls import MIN_QUOTED, quoted_views  # noqa: E402
from hf2q_py.target import Kept  # noqa: E402
from hf2q_py.tools import results  # noqa: E402
from hf2q_py.tools.recorded import RecordedTarget  # noqa: E402
from hf2q_py.tools.replay import ReplayRow, Stream, load, replay_stream  # noqa: E402

#: (label, resume after edits, unnumbered views)
CONFIGS = (
    ("before: quoted views, no resume", False, False),
    ("+ resume", True, False),
    ("+ views now", False, True),
    ("+ both", True, True),
)


def quoted_only(messages) -> list[str]:
    """The views as they were before: long texts JSON-quoted, nothing else."""
    out = []
    for m in messages:
        text = m.get("content")
        if isinstance(text, str) and len(text) >= MIN_QUOTED:
            quoted = json.dumps(text, ensure_ascii=False)[1:-1]
            out += [quoted] if quoted != text else []
    return out


def view_texts(script: dict, short: bool) -> list[tuple[list[str], list[str]]]:
    """Per request, (views before, views now) of its conversation."""
    shape = cs.claude_code_shape(short)
    out = []
    for i, r in enumerate(script["requests"]):
        body = cs.request_body(shape, script["messages"][: r["messages"]], i, script["max_tokens"])
        conv = conversation(MessagesRequest.model_validate(body))
        out.append((quoted_only(conv.messages), quoted_views(conv.messages)))
    return out


def replay_config(streams: list[Stream], views, resume: bool, numbered: bool, cost) -> list[ReplayRow]:
    """The session in order on one memory and one Target's timings."""
    memory, kept, rows = DraftMemory(), Kept(), []
    for s, (before, now) in zip(streams, views):
        for tokens in now if numbered else before:
            memory.add(tokens)
        if not s.output:  # an empty answer (the end token at once): nothing to replay
            continue
        target = RecordedTarget(
            s.prompt, s.output, cost, cost.restart, memory, kept, frozenset(s.line_breaks)
        )
        proposer = SuffixProposer(SuffixOptions(resume=resume), memory, frozenset(s.line_breaks))
        stats = replay_stream(s, target, proposer, AdaptiveK(32, SuffixProposer.profile, timings=kept.timings.setdefault("ngram", _timings())))  # fmt: skip
        plain = replay_stream(s, RecordedTarget(s.prompt, s.output, cost, cost.restart), None, None)
        rows.append(ReplayRow(s.name, s.kind, "", len(s.output), stats.rounds, stats.verify_rounds, stats.drafted,
                              stats.accepted, stats.decode_seconds, plain.decode_seconds))  # fmt: skip
    return rows


def gguf_tokenizer(path: Path):
    """The GGUF's tokenizer, as the server tokenizes the views (no weights read)."""
    from hf2q_py.loaders.gguf_file import read_header
    from hf2q_py.loaders.gguf_tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(read_header(path).metadata)


def _timings():
    from hf2q_py.draft_length.costs import Timings

    return Timings()


def tables(rows: dict[str, list[ReplayRow]]) -> list[dict]:
    per, total = [], []
    for label, rs in rows.items():
        for r in rs:
            per.append([r.name, label, str(r.tokens), str(r.rounds), f"{r.rounds / r.tokens:.2f}" if r.tokens else "-",
                        f"{r.mean_accepted_length:.2f}", f"{r.speedup:.2f}x"])  # fmt: skip
        tokens, rounds = sum(r.tokens for r in rs), sum(r.rounds for r in rs)
        plain, ours = sum(r.baseline_seconds for r in rs), sum(r.seconds for r in rs)
        total.append([label, str(tokens), str(rounds), f"{rounds / tokens:.3f}", f"{plain / ours:.2f}x"])
    return [
        results.table(["configuration", "generated", "forwards", "forwards per token", "modelled speed-up"], total,
                      "lrrrr", title="The session's answers, replayed (all requests)"),
        results.table(["request", "configuration", "generated", "forwards", "forwards per token",
                       "mean accepted length", "modelled speed-up"], per, "llrrrrr", title="Per request"),
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--script", required=True, help="bench_agent_session.py's --script file")
    ap.add_argument("--streams", required=True, help="bench_agent_session.py's --streams file")
    ap.add_argument("--gguf", type=Path, default=GGUF, help="the GGUF whose tokenizer made the streams")
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    script = json.loads(Path(args.script).read_text(encoding="utf-8"))
    streams, cost = load(args.streams)
    if len(streams) != len(script["requests"]):
        raise Hf2qError(
            f"{args.streams} holds {len(streams)} streams, {args.script} {len(script['requests'])} requests"
        )
    tok = gguf_tokenizer(args.gguf)
    views = [tuple([list(tok.encode(t, add_special_tokens=False)) for t in texts] for texts in pair)
             for pair in view_texts(script, script["short"])]  # fmt: skip
    rows = {
        label: replay_config(streams, views, resume, numbered, cost) for label, resume, numbered in CONFIGS
    }
    notes = ("Modelled from the streams file's measured forward costs; the requests of one session in order on one "
             "memory, each with the views its conversation gives (adaptive K, the suffix proposer's defaults).")  # fmt: skip
    rec = results.record(shlex.join(["python", *sys.argv]), tables(rows), notes=notes,
                         data={label: [r.__dict__ for r in rs] for label, rs in rows.items()})  # fmt: skip
    results.publish(rec, args.results)


if __name__ == "__main__":
    run_script(main)
