"""Shared assertions for tests."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import generate_step

import hf2q_py
from hf2q_py.tools.cli import main

NEAR_TIE = 1e-3  # batched vs single-token logits differ by ~1e-5 with OpenBLAS

#: Draft-method options with both confidence rules off: a draft is exactly K tokens.
UNGATED = {"draft_p_min": 0.0, "draft_min_prob": 0.0}


def reference_greedy(model, prompt: list[int], n: int, eos: set[int] = frozenset()) -> list[int]:
    """mlx-lm's own greedy decoding: the ground truth."""
    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        tok = int(tok)
        if tok in eos:
            break
        out.append(tok)
    return out


def top2_margin(model, tokens: list[int]) -> float:
    """Top-1 minus top-2 logit of the next token after ``tokens`` (full forward)."""
    logits = model(mx.array([tokens]))[0, -1]
    top = mx.sort(logits)[-2:].tolist()
    return top[1] - top[0]


def assert_same_greedy(model, prompt: list[int], got: list[int], want: list[int]) -> None:
    """Equal token for token, or the first difference is a numerical near-tie."""
    if got == want:
        return
    n = min(len(got), len(want))
    i = next((j for j in range(n) if got[j] != want[j]), n)
    assert i < n, f"lengths differ with equal prefix: {len(got)} vs {len(want)}"
    margin = top2_margin(model, prompt + want[:i])
    assert margin < NEAR_TIE, (
        f"speculative output diverged at token {i} where the target's top-2 margin is "
        f"{margin:.4g} (not a near-tie): got {got[i]}, want {want[i]}"
    )


def baseline(target, prompt, n):
    """Plain greedy decoding with hf2q-py: what every method must equal."""
    return hf2q_py.generate(target, prompt, max_tokens=n, method="baseline").tokens


def cli(capsys, *argv):
    """Run the CLI in-process: (exit code, stdout, stderr lines)."""
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse errors
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err.strip().splitlines()


def assert_one_line_error(result, *words):
    """``cli``'s result is status 2 with one line on stderr holding every word."""
    rc, _, err = result
    assert rc == 2, err
    assert len(err) == 1, err
    for w in words:
        assert w in err[0], err[0]
