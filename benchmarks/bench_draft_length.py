"""Draft-length policies of the draft method, without timing noise: adaptive
K (from the draft method's profile) against fixed K, with round costs of a
measured pair (a round: the target forward of K + 1 tokens plus one draft
step per draft; in plain decodes). The engine's own loop runs every
generation, on a recorded answer (``hf2q_py.tools.recorded``) with modelled
time. Two sources of acceptance:

Simulated patterns (tokens per second averaged over seeded generations):
each round drafts K tokens and the first rejection falls where a
per-position hazard puts it, P(draft i rejected | drafts before it
accepted): bursty (10%, 10%, then 2%: rejections at the first positions or
none, as on code edits), flat 90% / 70% (every position alike), perfect
(the draft is always right), late (2% for three positions, then 30%), hard
stretch (30% at tokens 8-23 of the answer, 2% elsewhere).

    python benchmarks/bench_draft_length.py [--tokens 64] [--seeds 40] [--draft-cost 0.3]
        [--slope 0.06] [--results PATH]

Recorded streams of a real pair: the target's greedy answers to the bench
workloads and, at every position, the draft model's greedy token and its
probability, read in one teacher-forced forward. A round's drafts are
accepted up to the first position where the draft's token differs from the
answer, and a draft confidence rule (``draft_min_prob``) ends a draft where
the product of those probabilities falls below it. Drafts after a rejected
one are judged with the probabilities of the answer's context (they are
rejected either way; only where a draft ends can differ).

    python benchmarks/bench_draft_length.py --record qwen15.gguf qwen05.gguf --streams S.json
    python benchmarks/bench_draft_length.py --streams S.json --draft-cost 0.27 --slope 0.045
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hf2q_py

from hf2q_py.draft_length import MAX_K, AdaptiveK, FixedK, validate_k  # noqa: E402
from hf2q_py.errors import Hf2qError  # noqa: E402
from hf2q_py.proposers.draft_model import DraftModelProposer  # noqa: E402
from hf2q_py.proposers.base import Draft, Proposer  # noqa: E402
from hf2q_py.tools.recorded import RecordedTarget  # noqa: E402
from hf2q_py.tools.replay import Stream, replay_stream  # noqa: E402
from hf2q_py.tools import results  # noqa: E402
from hf2q_py.tools.files import check_writable  # noqa: E402
from hf2q_py.methods import DEFAULT_DRAFT_MIN_PROB, method_named  # noqa: E402
from hf2q_py.errors import run_script  # noqa: E402

PATTERNS = {
    "bursty": [0.1, 0.1, 0.02],
    "flat 90%": [0.1],
    "flat 70%": [0.3],
    "perfect": [0.0],
    "late": [0.02, 0.02, 0.02, 0.3],
    "hard stretch": {"hard": (8, 24), "inside": [0.3], "outside": [0.02]},
}
DECODE_S = 0.65  # a target decode of the 1.5B target on this CPU; only ratios matter


def verify_seconds(slope: float):
    """A target forward of ``width`` tokens: ``1 + slope (width - 1)`` decodes."""
    return lambda width: DECODE_S * (1 + slope * (width - 1))


class _Drafts(Proposer):
    """Drafts decided per answer position by ``wrong(position, i)`` (draft i of
    a round, standing at ``position`` of the answer, is wrong), each draft
    step costing ``draft_cost`` decodes of modelled time, with the draft
    method's profile; ``stop(position, n)``: end the draft after n tokens."""

    def __init__(self, prompt_len: int, answer: list[int], draft_cost: float, wrong, stop=None):
        self.prompt_len, self.answer, self.draft_cost = prompt_len, answer, draft_cost
        self.wrong, self.stop = wrong, stop or (lambda position, n: False)
        self.profile = DraftModelProposer(None, cost=draft_cost).profile

    def start(self, runtime, prompt, hidden, decider) -> None:
        self.rt = runtime

    def propose(self, tokens, k: int) -> Draft:
        position = len(tokens) - self.prompt_len
        drafts, right = [], True
        while len(drafts) < k and position + len(drafts) < len(self.answer):
            i = len(drafts)
            right = right and not self.wrong(position + i, i)
            drafts.append(self.answer[position + i] + (0 if right else 1))
            if self.stop(position, len(drafts)):
                break
        self.rt.spend(DECODE_S * self.draft_cost * len(drafts))
        return Draft(drafts)


def run(policy, proposer: _Drafts, prompt: list[int], answer: list[int], slope: float) -> float:
    """Tokens per second of the engine's loop on a recorded answer."""
    target = RecordedTarget(prompt, answer, verify_seconds(slope))
    stats = replay_stream(Stream("s", "", prompt, answer), target, proposer, policy)
    return len(answer) / stats.decode_seconds


def simulate(policy, hazards: list[float], tokens: int, seed: int, draft_cost: float, slope: float) -> float:
    """Tokens per second of one generation of ``tokens`` under ``policy``: the
    first rejection of each round's drafts falls where ``hazards`` put it."""
    rng = random.Random(seed)
    answer = list(range(2, 2 + tokens))
    proposer = _Drafts(
        1, answer, draft_cost, lambda position, i: rng.random() < _hazard(hazards, position, i)
    )
    return run(policy, proposer, [1], answer, slope)


def _hazard(pattern, position: int, i: int) -> float:
    """P(draft ``i`` of a round rejected | the drafts before it accepted), the draft
    standing at ``position`` of the answer."""
    if isinstance(pattern, dict):
        lo, hi = pattern["hard"]
        pattern = pattern["inside"] if lo <= position < hi else pattern["outside"]
    return pattern[min(i, len(pattern) - 1)]


def record(target_src: str, draft_src: str, path: str, max_tokens: int, only: str) -> None:
    """Record the target's greedy answers to the workloads whose names contain
    one of the comma-separated ``only`` and the draft model's greedy token and probability at each position."""
    import mlx.core as mx

    import hf2q_py
    from hf2q_py.tools.workloads import default_workloads

    def load(src):
        return hf2q_py.load(dtype="float32") if src == "builtin" else hf2q_py.load(src, dtype="float32")

    target = load(target_src)
    draft = target if draft_src == target_src else load(draft_src)
    streams = []
    for w in default_workloads():
        if not any(part in w.name for part in only.split(",")) or w.then:
            continue
        ids = hf2q_py.encode_prompt(target, w.prompt)
        answer = hf2q_py.generate(target, ids, max_tokens=max_tokens, method="baseline").tokens
        logits = draft.model(mx.array(ids + answer[:-1])[None])[0, len(ids) - 1 :].astype(mx.float32)
        probs = mx.softmax(logits, axis=-1)
        streams.append(
            {
                "name": w.name,
                "prompt_tokens": len(ids),
                "output": answer,
                "draft_argmax": mx.argmax(probs, axis=-1).tolist(),
                "draft_top": probs.max(axis=-1).tolist(),
            }
        )
        print(f"recorded {w.name}: {len(ids)} + {len(answer)} tokens", flush=True)
    data = {"target": Path(target_src).name, "draft": Path(draft_src).name, "streams": streams}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


def replay(policy, stream: dict, min_prob: float, draft_cost: float, slope: float) -> float:
    """Tokens per second of ``policy`` on a recorded stream (see the module docstring)."""
    out, top = stream["output"], stream["draft_top"]
    wrong = {i for i, (d, t) in enumerate(zip(stream["draft_argmax"], out)) if d != t}

    def stop(position: int, n: int) -> bool:  # the confidence rule: the drafts' product of probabilities
        return math.prod(top[position : position + n]) < min_prob

    prompt = [1] * stream["prompt_tokens"]
    proposer = _Drafts(len(prompt), out, draft_cost, lambda position, i: position in wrong, stop)
    return run(policy, proposer, prompt, out, slope)


def stream_tables(path: str, ks: list[int], k_max: int, draft_cost: float, slope: float) -> tuple[list, dict]:
    """Per recorded stream: fixed K, adaptive K without and with the confidence rule."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        streams = data["streams"]
    except (OSError, ValueError, KeyError) as e:
        raise Hf2qError(f"cannot read recorded streams {path}: {e}") from None
    rule = DEFAULT_DRAFT_MIN_PROB
    variants = {f"fixed K={k}": (lambda k=k: FixedK(k), 0.0) for k in ks}
    variants[f"adaptive K<={k_max}, no rule"] = (lambda: adaptive(k_max, draft_cost), 0.0)
    variants[f"adaptive K<={k_max}, min_prob {rule}"] = (lambda: adaptive(k_max, draft_cost), rule)
    rows, ratios, data_out = [], {v: [] for v in variants if v.startswith("adaptive")}, {}
    for st in streams:
        speed = {v: replay(make(), st, mp, draft_cost, slope) for v, (make, mp) in variants.items()}
        best = max((speed[v], v) for v in speed if v.startswith("fixed"))
        for v in ratios:
            ratios[v].append(speed[v] / best[0])
        wrong = sum(d != t for d, t in zip(st["draft_argmax"], st["output"]))
        rows.append(
            [st["name"], f"{wrong}/{len(st['output'])}", *(f"{x:.2f}" for x in speed.values()), best[1]]
            + [f"{speed[v] / best[0]:.2f}x" for v in ratios]
        )
        data_out[st["name"]] = speed
    rows.append(
        ["mean", "", *([""] * len(variants)), ""] + [f"{statistics.mean(r):.3f}x" for r in ratios.values()]
    )
    columns = ["stream", "draft wrong", *variants, "best fixed", *(f"{v} / best fixed" for v in ratios)]
    title = (
        f"tokens per second of replayed decoding (a plain decode: {1 / DECODE_S:.2f} tok/s), "
        f"{data.get('target')} with draft {data.get('draft')}"
    )
    align = "ll" + "r" * len(variants) + "l" + "r" * len(ratios)
    return [results.table(columns, rows, align, title=title)], data_out


def adaptive(k_max: int, draft_cost: float) -> AdaptiveK:
    """Adaptive K as the draft method makes it, for a draft step of ``draft_cost`` decodes."""
    return AdaptiveK(k_max, DraftModelProposer(None, cost=draft_cost).profile)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="tokens per generation (patterns, recording)")
    ap.add_argument("--seeds", type=int, default=40, help="generations per cell (patterns)")
    ap.add_argument("--draft-cost", type=float, default=0.3, help="a draft step relative to a target decode")
    ap.add_argument("--slope", type=float, default=0.06, help="extra cost of each verified token (decodes)")
    ap.add_argument("--fixed-ks", default="2,4,8")
    ap.add_argument(
        "--k", type=int, default=None, help="adaptive: most drafts per round (default: the method's)"
    )
    ap.add_argument("--streams", default=None, help="replay the recorded streams in this file (JSON)")
    ap.add_argument(
        "--record", nargs=2, metavar=("TARGET", "DRAFT"), help="record --streams with this pair first"
    )
    ap.add_argument(
        "--workloads",
        default="code:,fresh:,prose:",
        help="recording: comma-separated substrings of workload names",
    )
    ap.add_argument("--results", default=None, help="also write a results file (JSON) here")
    a = ap.parse_args()
    if a.tokens < 1 or a.seeds < 1:
        ap.error("--tokens and --seeds must be at least 1")
    if a.draft_cost < 0 or a.slope < 0:
        ap.error("--draft-cost and --slope must be at least 0")
    if a.record and not a.streams:
        ap.error("--record needs --streams (the file to write)")
    try:
        ks = [int(k) for k in a.fixed_ks.split(",")]
        for k in ks:
            validate_k(k)
        k_max = a.k if a.k is not None else method_named("draft").k_for(None)
        validate_k(k_max)
    except (ValueError, Hf2qError) as e:
        ap.error(f"--fixed-ks and --k must be draft lengths in [1, {MAX_K}] ({e})")
    if a.results:
        check_writable(a.results, "--results file")
    if a.record:
        check_writable(a.streams, "--streams file")
        record(*a.record, a.streams, a.tokens, a.workloads)
    costs = f"draft step {a.draft_cost} decodes, verify of K + 1 tokens 1 + {a.slope} K decodes"
    if a.streams:
        tables, data = stream_tables(a.streams, ks, k_max, a.draft_cost, a.slope)
        notes = f"{costs}; streams {a.streams}"
    else:
        tables, data = pattern_tables(ks, k_max, a)
        notes = costs
    rec = results.record(
        "python benchmarks/bench_draft_length.py " + shlex.join(sys.argv[1:]), tables, notes=notes, data=data
    )
    results.publish(rec, a.results)


def pattern_tables(ks: list[int], k_max: int, a) -> tuple[list, dict]:
    """Per simulated pattern: fixed K and adaptive K, means over seeded generations."""
    policies = {f"fixed K={k}": (lambda k=k: FixedK(k)) for k in ks}
    policies[f"adaptive K<={k_max}"] = lambda: adaptive(k_max, a.draft_cost)
    rows, data = [], {}
    for name, hazards in PATTERNS.items():
        speed = {}
        for label, make in policies.items():
            runs = [simulate(make(), hazards, a.tokens, s, a.draft_cost, a.slope) for s in range(a.seeds)]
            speed[label] = sum(runs) / len(runs)
        best = max((v, k) for k, v in speed.items() if k.startswith("fixed"))
        ada = speed[f"adaptive K<={k_max}"]
        rows.append([name, *(f"{speed[k]:.2f}" for k in policies), best[1], f"{ada / best[0]:.2f}x"])
        data[name] = speed
    title = (
        f"tokens per second of simulated decoding (a plain decode: {1 / DECODE_S:.2f} tok/s), "
        f"means over {a.seeds} generations of {a.tokens} tokens"
    )
    columns = ["pattern", *policies, "best fixed", "adaptive / best fixed"]
    return [results.table(columns, rows, "l" + "r" * len(policies) + "lr", title=title)], data


if __name__ == "__main__":
    run_script(main)
