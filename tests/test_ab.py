"""A/B checks: differences are explained (near-tie) or flagged (MISMATCH)."""

import json
import subprocess
import sys
from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers import UNGATED
from models import ARCHS, random_prompt, tiny_target

import hf2q_py
import mlx.core as mx

from hf2q_py.tools.ab import Trace, baseline_trace, compare, near_tie_bound, prompt_cases, run_ab
from hf2q_py.tools.engines import EngineOutput


def test_baseline_trace_is_the_baseline():
    target = tiny_target("llama", scale=2.0)
    prompt = random_prompt(10)
    trace = baseline_trace(target, prompt, 30)
    assert trace.tokens == hf2q_py.generate(target, prompt, max_tokens=30, method="baseline").tokens
    assert all(t[0][1] >= t[1][1] for t in trace.tops)
    assert len(trace.rows) == 30 and not trace.ended
    assert [int(mx.argmax(r).item()) for r in trace.rows] == trace.tokens


def test_baseline_trace_keeps_the_step_that_chose_the_end():
    target = tiny_target("llama", scale=2.0)
    prompt = random_prompt(10)
    free = baseline_trace(target, prompt, 30).tokens
    target.eos_token_ids = {free[4]}
    trace = baseline_trace(target, prompt, 30)
    assert trace.ended and trace.tokens == free[: free.index(free[4])]
    assert len(trace.rows) == len(trace.tokens) + 1


def test_the_near_tie_bound_is_measured_and_small():
    target = tiny_target("gemma4_text")
    noise = near_tie_bound(target, random_prompt(40))
    assert 0.0 <= noise.max_logit_diff < 1e-3
    assert noise.positions == 40


def batched_offset(target, delta):
    """Make ``target``'s multi-token forwards return logits ``delta`` higher
    than its single-token ones: a known batched-vs-single difference."""
    base = type(target.model)

    def call(self, x, *args, **kwargs):
        out = base.__call__(self, x, *args, **kwargs)
        return out + delta if x.shape[1] > 1 else out

    target.model.__class__ = type("Offset" + base.__name__, (base,), {"__call__": call})
    return target


def test_the_near_tie_bound_is_twice_a_known_difference():
    target = batched_offset(tiny_target("llama"), 0.25)
    noise = near_tie_bound(target, random_prompt(20))
    assert noise.max_logit_diff == pytest.approx(0.25, abs=1e-4)
    assert noise.bound == pytest.approx(0.5, abs=2e-4)


def test_compare_classifies_by_the_logit_gap_at_the_first_difference():
    target = tiny_target("llama", scale=2.0)
    prompt = random_prompt(8)
    base = baseline_trace(target, prompt, 12)
    same = compare(target, prompt, base, EngineOutput(list(base.tokens), False), 1e-4, label="x")
    assert same.verdict == "identical" and same.divergence is None
    wrong = list(base.tokens)
    wrong[5] = base.tops[5][1][0]  # plain decoding's runner-up
    margin = base.tops[5][0][1] - base.tops[5][1][1]
    fault = compare(target, prompt, base, EngineOutput(wrong, False), bound=margin / 2, label="x")
    assert fault.verdict == "MISMATCH" and fault.divergence.position == 5
    assert fault.divergence.margin == pytest.approx(margin)
    assert fault.divergence.gap == pytest.approx(margin) and fault.divergence.method_rank == 2
    tie = compare(target, prompt, base, EngineOutput(wrong, False), bound=margin * 2, label="x")
    assert tie.verdict == "near-tie"


def hand_made_trace(tops: list[list[tuple[int, float]]], vocab: int = 128) -> Trace:
    """A trace whose logits are -10 except the top two written by hand."""
    rows = []
    for top in tops:
        row = [-10.0] * vocab
        for t, v in top:
            row[t] = v
        rows.append(mx.array(row))
    return Trace([t[0][0] for t in tops], tops, rows, False)


def test_compare_on_a_hand_made_trace():
    """Margins written by hand: 3.0, 0.5, 2.0 at positions 0, 1, 2."""
    target = tiny_target("llama")
    base = hand_made_trace([[(10, 5.0), (7, 2.0)], [(11, 1.5), (8, 1.0)], [(12, 4.0), (9, 2.0)]])
    r = compare(target, [1, 2, 3], base, EngineOutput([10, 8, 12], False), bound=0.6, label="m")
    assert (r.verdict, r.divergence.position, r.divergence.margin, r.min_margin) == ("near-tie", 1, 0.5, 0.5)
    assert (r.divergence.baseline_token, r.divergence.method_token) == (11, 8)
    assert (r.divergence.baseline_logit, r.divergence.method_logit, r.divergence.method_rank) == (1.5, 1.0, 2)
    r = compare(target, [1, 2, 3], base, EngineOutput([10, 11, 9], False), bound=0.6, label="m")
    assert (r.verdict, r.divergence.position, r.divergence.margin, r.divergence.gap) == (
        "MISMATCH",
        2,
        2.0,
        2.0,
    )
    # a token outside plain decoding's top two: the gap to it counts, not the top-2 margin
    r = compare(target, [1, 2, 3], base, EngineOutput([10, 11, 13], False), bound=2.5, label="m")
    assert (r.verdict, r.divergence.gap, r.divergence.method_rank) == ("MISMATCH", 14.0, 3)
    r = compare(target, [1, 2, 3], base, EngineOutput([10, 11], True), bound=0.6, label="m")  # ended early
    assert (r.verdict, r.divergence.position, r.divergence.method_token) == ("MISMATCH", 2, -1)
    same = compare(target, [1, 2, 3], base, EngineOutput([10, 11], None), bound=0.6, label="m")
    assert same.verdict == "identical"  # a shorter output not known to have ended: compared as far as it goes
    assert (
        compare(target, [1, 2, 3], base, EngineOutput([10, 11, 12], False), 0.0, label="m").verdict
        == "identical"
    )


def test_an_early_end_is_scored_by_the_end_of_sequence_logit():
    target = tiny_target("llama")
    target.eos_token_ids = {7}
    base = hand_made_trace([[(10, 5.0), (7, 4.9)], [(11, 1.5), (8, 1.0)]])
    r = compare(target, [1, 2, 3], base, EngineOutput([], True), bound=0.2, label="m")
    assert (r.verdict, r.divergence.method_token, r.divergence.method_logit) == (
        "near-tie",
        -1,
        pytest.approx(4.9),
    )


def test_run_ab_reports_a_real_difference_where_it_is():
    """A "method" that decodes by another rule (a repetition penalty) differs
    from plain greedy decoding at a position known from the two outputs."""
    target = tiny_target("llama", scale=2.0)
    prompt = random_prompt(8)
    plain = hf2q_py.generate(target, prompt, max_tokens=30, method="baseline").tokens
    other = hf2q_py.generate(target, prompt, max_tokens=30, repetition_penalty=3.0, method="baseline").tokens
    first = next(i for i, (a, b) in enumerate(zip(plain, other)) if a != b)
    report = run_ab(
        target,
        prompt_cases([("p", prompt)], 30),
        [("penalty", dict(repetition_penalty=3.0)), ("ngram", dict(method="ngram", k=4))],
    )
    penalty, ngram = report.results
    assert penalty.verdict == "MISMATCH"
    assert (
        penalty.divergence.position,
        penalty.divergence.baseline_token,
        penalty.divergence.method_token,
    ) == (first, plain[first], other[first])
    assert ngram.verdict == "identical" and ngram.baseline_tokens == len(plain)


def test_mlx_lm_speculation_past_the_window_is_a_mismatch_and_ours_is_not():
    """mlx-lm's RotatingKVCache trim corrupts sliding layers once they wrap."""
    target = tiny_target("gemma4_text", seed=0, scale=1.0)
    draft = tiny_target("gemma4_text", seed=1, scale=1.0)
    prompt = random_prompt(10)
    report = run_ab(
        target,
        prompt_cases([("p", prompt)], 60),
        [
            (
                "draft",
                dict(method="draft", draft=draft, k=4, adaptive=False, **UNGATED),
            ),
            ("ngram", dict(method="ngram", k=4)),
            ("mlx-lm-draft", dict(draft=draft, k=4)),
        ],
    )
    results = report.results
    verdict = {r.method: r.verdict for r in results}
    assert verdict["draft"] in ("identical", "near-tie")
    assert verdict["ngram"] in ("identical", "near-tie")
    assert verdict["mlx-lm-draft"] == "MISMATCH"
    bad = next(r for r in results if r.method == "mlx-lm-draft")
    # only once a verify block of k + 1 = 5 tokens reaches past the window of 16
    assert bad.divergence.position + len(prompt) + 5 > 16


@cache
def cached_target(arch, scale):
    return tiny_target(arch, scale=scale)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arch=st.sampled_from([a for a in ARCHS if a != "gemma4_text_moe"]),
    scale=st.sampled_from([1.0, 2.0]),
    prompt_len=st.integers(1, 40),
    max_tokens=st.integers(1, 40),
    k=st.integers(1, 8),
    method=st.sampled_from(["ngram", "draft", "layerskip"]),
    adaptive=st.booleans(),
    eos_at=st.one_of(st.none(), st.integers(0, 39)),
    seed=st.integers(0, 1000),
)
def test_fuzz_every_method_equals_the_baseline(
    arch, scale, prompt_len, max_tokens, k, method, adaptive, eos_at, seed
):
    target = cached_target(arch, scale)
    prompt = random_prompt(prompt_len, seed)
    free = hf2q_py.generate(target, prompt, max_tokens=max_tokens, method="baseline").tokens
    eos = {free[eos_at]} if eos_at is not None and eos_at < len(free) else set()
    target.eos_token_ids = eos
    try:
        want = baseline_trace(target, prompt, max_tokens)
        opts = dict(method=method, k=k, adaptive=adaptive)
        if method == "draft":
            opts.update(draft=cached_target(arch, 2.0 if scale == 1.0 else 1.0), **UNGATED)
        if method == "layerskip":
            if arch in ("gemma4_text", "nemotron_h"):
                # gemma4_text: layer 1's KV is shared; nemotron_h: caches are not one per layer
                opts = dict(method="ngram", k=k, adaptive=adaptive)
            else:
                opts["skip_layers"] = [1]
        got = hf2q_py.generate(target, prompt, max_tokens=max_tokens, **opts)
        res = compare(
            target, prompt, want, EngineOutput(got.tokens, got.finish_reason == "stop"), 2e-3, label=method
        )
        assert res.verdict != "MISMATCH", res
    finally:
        target.eos_token_ids = set()


@pytest.mark.slow
def test_cli_ab_on_the_builtin_model(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Repeat after me: one two three, one two three."}) + "\n")
    md = tmp_path / "ab.md"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf2q_py",
            "ab",
            "--methods",
            "ngram,layerskip",
            "--prompts",
            str(prompts),
            "--max-tokens",
            "24",
            "--skip-layers",
            "middle:6",
            "--markdown",
            str(md),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {r["verdict"] for r in out["results"]} <= {"identical", "near-tie"}
    assert out["noise"]["bound"] > 0
    assert "near-tie bound" in md.read_text()
