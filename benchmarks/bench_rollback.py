"""Cost of exact recurrent-state rollback: a verify of K+1 tokens on a hybrid
model (Qwen3-Next layout: gated-delta layers, 3 of every 4) against the same
verify on an attention-only model of the same width, depth, heads and MLP
(Qwen3), and the rollback to n accepted drafts against a
full re-run of the accepted tokens. Random float32 weights, after a prompt.

    python benchmarks/bench_rollback.py [--hidden 512] [--layers 8] [--k 8] [--repeats 20] [--results PATH]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import hf2q_py  # noqa: F401  (first: OpenBLAS before mlx.core)

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.utils import _get_classes

from hf2q_py.target import Target
from hf2q_py.tools import results
from hf2q_py.tools.files import check_writable
from hf2q_py.errors import run_script  # noqa: E402


def build(hidden: int, layers: int, hybrid: bool, vocab: int = 32000) -> Target:
    heads = hidden // 64
    cfg = dict(
        model_type="qwen3_next",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=3 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=64,
        linear_num_value_heads=heads,
        linear_num_key_heads=max(1, heads // 2),
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=0,
        num_experts_per_tok=0,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=0,
        mlp_only_layers=[],
        moe_intermediate_size=0,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=8192,
        full_attention_interval=4,
    )
    if not hybrid:
        cfg = {
            k: v
            for k, v in cfg.items()
            if not k.startswith(
                (
                    "linear_",
                    "num_experts",
                    "decoder_sparse",
                    "shared_expert",
                    "mlp_only",
                    "moe_",
                    "partial_rotary",
                    "full_attention",
                )
            )
        }
        cfg.update(model_type="qwen3", tie_word_embeddings=False)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(cfg))
    model.update(tree_map(lambda x: x * 0.02 if x.ndim >= 2 else x, model.parameters()))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return Target.from_mlx_lm(model)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(target: Target, prompt: list[int], block: list[int], repeats: int) -> dict[str, float]:
    k = len(block) - 1
    rt = target.runtime(rollback=k + 2)
    rt.prefill(prompt, logits="none")
    mx.eval(rt.state())
    verify, rollback, rerun = [], [], []
    for r in range(repeats + 2):
        v = timed(lambda: mx.eval(rt.verify(block).logits, rt.state()))
        n = r % k  # accepted drafts: every rejection depth in turn
        t = timed(lambda: (rt.trim(k - n), mx.eval(rt.state())))
        rt.trim(n + 1)  # back to the prompt
        # the fallback: the state before the verify, then the accepted tokens again
        f = timed(lambda: mx.eval(rt.forward(block[: n + 1], logits="none").hidden, rt.state()))
        rt.trim(n + 1)
        if r >= 2:  # warm-up
            verify.append(v)
            rollback.append(t)
            rerun.append(f)
    unrecorded = []  # the same verify with recording off (it then cannot be rolled back)
    for r in range(repeats + 2):
        plain = target.runtime(rollback=1)
        plain.prefill(prompt, logits="none")
        mx.eval(plain.state())
        unrecorded.append(timed(lambda: mx.eval(plain.verify(block).logits, plain.state())))
    return {
        "verify": statistics.median(verify),
        "rollback": statistics.mean(rollback),
        "rerun": statistics.mean(rerun),
        "unrecorded": statistics.median(unrecorded[2:]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--results", default=None, help="also write a results file (JSON) here")
    a = ap.parse_args()
    if a.results:
        check_writable(a.results, "--results file")
    prompt = [(7 * i) % 1000 + 3 for i in range(a.prompt)]
    block = [(11 * i) % 1000 + 5 for i in range(a.k + 1)]
    hybrid = build(a.hidden, a.layers, hybrid=True)
    attention = build(a.hidden, a.layers, hybrid=False)
    h = measure(hybrid, prompt, block, a.repeats)
    t = measure(attention, prompt, block, a.repeats)
    share = lambda x: f"{x * 1e3:.1f} ({100 * x / h['verify']:.1f}% of the recorded verify)"  # noqa: E731
    rows = [
        ["attention-only verify", f"{t['verify'] * 1e3:.1f}"],
        ["hybrid verify, not recorded", f"{h['unrecorded'] * 1e3:.1f}"],
        ["hybrid verify, recorded", f"{h['verify'] * 1e3:.1f}"],
        ["hybrid rollback, mean over n < K", share(h["rollback"])],
        ["full re-run of the accepted tokens", share(h["rerun"])],
    ]
    rec = results.record(
        shlex.join(["python", *sys.argv]),
        [results.table(["", "ms"], rows, "lr")],
        notes=f"Hidden {a.hidden}, {a.layers} layers, a verify of K + 1 = {a.k + 1} tokens "
        f"after a {a.prompt}-token prompt, {a.repeats} repeats.",
        data={"hybrid": h, "attention": t},
    )
    results.publish(rec, a.results)


if __name__ == "__main__":
    run_script(main)
