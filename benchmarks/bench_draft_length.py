"""Draft-length policies of the draft method, simulated: adaptive K (as the
draft method tunes it) against fixed K on acceptance patterns of a draft
model, with round costs of a measured pair, no timing noise. Each round
drafts K tokens and the first rejection falls where a per-position hazard
puts it; the cost of a round is the target forward of K + 1 tokens plus K
draft steps. Tokens per second are averaged over seeded generations.

    python benchmarks/bench_draft_length.py [--tokens 64] [--seeds 40] [--draft-cost 0.3]
        [--slope 0.06] [--results PATH]

Patterns (hazard = P(draft i rejected | drafts before it accepted)):
bursty (10%, 10%, then 2%: rejections at the first positions or none, as
on code edits), flat 90% / 70% (every position alike), perfect (the draft
is always right), late (2% for three positions, then 30%), hard stretch (30% at
tokens 8-23 of the answer, 2% elsewhere: rejections clustered early in the answer, as traced
on a type-hints edit).
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hf2q_py

from hf2q_py.draft_length import MAX_K, AdaptiveK, FixedK, validate_k  # noqa: E402
from hf2q_py.errors import Hf2qError  # noqa: E402
from hf2q_py.proposers.draft_model import DraftModelProposer  # noqa: E402
from hf2q_py.stats import Round  # noqa: E402
from hf2q_py.tools import results  # noqa: E402
from hf2q_py.tools.files import check_writable  # noqa: E402
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


def simulate(policy, hazards: list[float], tokens: int, seed: int, draft_cost: float, slope: float) -> float:
    """Tokens per second of one generation of ``tokens`` under ``policy``."""
    rng = random.Random(seed)
    done, seconds = 0, 0.0
    while done < tokens:
        k = policy.next_k()
        if k == 0:
            r = Round(cost_seconds=DECODE_S)
            done += 1
        else:
            accepted = 0
            while accepted < k and rng.random() >= _hazard(hazards, done + accepted, accepted):
                accepted += 1
            verify = DECODE_S * (1 + slope * k)
            draft = DECODE_S * draft_cost * k
            r = Round(k=k, drafted=k, accepted=accepted, cost_seconds=verify + draft,
                      propose_seconds=draft, verify_seconds=verify)  # fmt: skip
            done += accepted + 1
        seconds += r.cost_seconds
        policy.update(r)
    return done / seconds


def _hazard(pattern, position: int, i: int) -> float:
    """P(draft ``i`` of a round rejected | the drafts before it accepted), the draft
    standing at ``position`` of the answer."""
    if isinstance(pattern, dict):
        lo, hi = pattern["hard"]
        pattern = pattern["inside"] if lo <= position < hi else pattern["outside"]
    return pattern[min(i, len(pattern) - 1)]


def adaptive(k_max: int, draft_cost: float) -> AdaptiveK:
    policy = AdaptiveK(k_max)
    DraftModelProposer(None, cost=draft_cost).tune(policy)
    return policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="tokens per generation")
    ap.add_argument("--seeds", type=int, default=40, help="generations per cell")
    ap.add_argument("--draft-cost", type=float, default=0.3, help="a draft step relative to a target decode")
    ap.add_argument("--slope", type=float, default=0.06, help="extra cost of each verified token (decodes)")
    ap.add_argument("--fixed-ks", default="2,4,8")
    ap.add_argument("--results", default=None, help="also write a results file (JSON) here")
    a = ap.parse_args()
    if a.tokens < 1 or a.seeds < 1:
        ap.error("--tokens and --seeds must be at least 1")
    if a.draft_cost < 0 or a.slope < 0:
        ap.error("--draft-cost and --slope must be at least 0")
    try:
        ks = [int(k) for k in a.fixed_ks.split(",")]
        for k in ks:
            validate_k(k)
    except (ValueError, Hf2qError) as e:
        ap.error(f"--fixed-ks must be comma-separated draft lengths in [1, {MAX_K}] ({e})")
    if a.results:
        check_writable(a.results, "--results file")
    k_max = max(ks)
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
    rec = results.record(
        "python benchmarks/bench_draft_length.py " + shlex.join(sys.argv[1:]),
        [
            results.table(
                ["pattern", *policies, "best fixed", "adaptive / best fixed"],
                rows,
                "l" + "r" * len(policies) + "lr",
                title="tokens per second of simulated decoding (a plain decode: "
                f"{1 / DECODE_S:.2f} tok/s), means over {a.seeds} generations of {a.tokens} tokens",
            )
        ],
        notes=f"draft step {a.draft_cost} decodes, verify of K + 1 tokens 1 + {a.slope} K decodes",
        data=data,
    )
    results.publish(rec, a.results)


if __name__ == "__main__":
    run_script(main)
