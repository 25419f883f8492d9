"""The tree-verify benchmark's model of rounds (benchmarks/bench_tree_verify.py):
a verify the engine does not run, judged on a recorded stream."""

import importlib.util
from pathlib import Path

import pytest

from hf2q_py.tools.replay import CostModel, Stream

COST = CostModel({1: 0.1, 2: 0.11, 9: 0.18, 33: 0.3})


def tree_bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_tree_verify.py"
    spec = importlib.util.spec_from_file_location("bench_tree_verify", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_judge_replaces_what_a_verify_accepts_and_costs_but_not_what_the_policy_learns():
    """As a wider (tree) verify would: here each verify accepts one token more
    than the drafts' prefix and costs a fixed 0.5 s."""
    from hf2q_py.config import SpecConfig
    from hf2q_py.draft_length import FixedK
    from hf2q_py.methods import build_proposer
    from hf2q_py.tools.recorded import RecordedTarget

    judged_rounds = tree_bench().judged_rounds

    out = [5, 6, 7, 8, 9] * 4 + list(range(100, 120))
    stream = Stream("copy then fresh", "code", [1, 2, 5, 6, 7, 8, 9, 3], out)
    seen = []

    def judge(drafts, n, i):
        seen.append((len(drafts), n, i))
        return n + 1, 0.5

    proposer, _ = build_proposer(RecordedTarget(stream.prompt, out, COST), SpecConfig(method="ngram"))
    policy = FixedK(8)
    rounds, verifies, drafted, accepted, seconds = judged_rounds(stream, proposer, policy, COST, judge)
    assert verifies == len(seen) > 0
    assert accepted == sum(min(n + 1, len(out) - i - 1) for _, n, i in seen)
    assert seconds == pytest.approx(0.5 * verifies + 0.1 * (rounds - verifies))
    assert accepted + rounds == len(out)
