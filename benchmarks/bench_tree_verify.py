"""Multi-candidate (tree) verification on this machine: what a tree of T
draft nodes costs to verify in one forward against a chain of T tokens, and
what a second branch would add to the suffix proposer's accepted tokens.

    python benchmarks/bench_tree_verify.py [--repeats 7] [--out benchmarks/results/tree_verify_smollm2.json]

1. Cost (built-in model, float32, after a ~300-token prompt): a script-level
   forward over the model's own layers with an explicit additive mask and
   per-node RoPE positions verifies a tree (every node attends to the context
   and to its ancestors). Checked first against the model: a chain through it
   gives the model's logits, and every tree node gives the logits of its
   root path run as a chain. Then times, per T: the model's own chain verify
   (what the engine runs), the script's chain, and the script's tree of two
   branches from the root (T/2 nodes each), each with the cache trimmed back.
2. Gain (offline replay of the recorded greedy streams, no model): the suffix
   proposer's drafts as the engine sizes them (adaptive K), plus a second
   branch of up to B tokens at the draft's first uncertain position (the
   second most frequent continuation there, continued greedily). A round
   accepts along whichever branch matches longer. Modelled time: the streams'
   measured forward costs (and pipeline restart, as the replay tool models
   it), times the measured tree/chain cost ratio for the extra nodes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from collections.abc import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hf2q_py

import hf2q_py  # noqa: E402  (first: OpenBLAS before mlx.core)

import mlx.core as mx  # noqa: E402

from hf2q_py.config import SpecConfig  # noqa: E402
from hf2q_py.memory import DraftMemory  # noqa: E402
from hf2q_py.methods import build_proposer  # noqa: E402
from hf2q_py.stats import Round  # noqa: E402
from hf2q_py.tools.recorded import RecordedTarget  # noqa: E402
from hf2q_py.tools.replay import CostModel, Stream, load  # noqa: E402
from hf2q_py.errors import run_script  # noqa: E402

WIDTHS = (2, 4, 8, 12, 16, 24, 32)


# -- 1. a forward over the model's layers with an explicit mask and positions ----------------
def rope(x: mx.array, positions: mx.array, dims: int, base: float, traditional: bool) -> mx.array:
    """RoPE at arbitrary per-token positions; x is (B, heads, T, head_dim)."""
    half = dims // 2
    freqs = base ** (-mx.arange(0, half, dtype=mx.float32) / half)
    angles = positions.astype(mx.float32)[:, None] * freqs[None]  # (T, half)
    cos, sin = mx.cos(angles), mx.sin(angles)
    if traditional:
        x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
        out = mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(*x.shape[:-1], dims)
    else:
        x1, x2 = x[..., :half], x[..., half:dims]
        out = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return mx.concatenate([out, x[..., dims:]], axis=-1) if dims < x.shape[-1] else out


def tree_forward(target, cache, tokens: list[int], parents: list[int]) -> mx.array:
    """Logits of every node of a draft tree appended to ``cache``: node i's
    parent is ``parents[i]`` (-1: the context's end), its position the
    context length plus its depth; it attends to the context and its
    ancestors (itself included)."""
    offset = cache[0].offset
    n = len(tokens)
    depth, anc = [], []
    for i, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
        anc.append({i} | (anc[p] if p >= 0 else set()))
    allowed = [[j in anc[i] for j in range(n)] for i in range(n)]
    tree_mask = mx.where(mx.array(allowed), 0.0, float("-inf")).astype(mx.float32)
    mask = mx.concatenate([mx.zeros((n, offset), dtype=mx.float32), tree_mask], axis=1)
    positions = mx.array([offset + d for d in depth])
    model = target.model
    h = target.embed_tokens(mx.array([tokens], dtype=mx.uint32))
    for layer, c in zip(target.layers, cache):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        B, L, _ = x.shape
        q = a.q_proj(x).reshape(B, L, a.n_heads, -1).transpose(0, 2, 1, 3)
        k = a.k_proj(x).reshape(B, L, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = a.v_proj(x).reshape(B, L, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        r = a.rope
        q = rope(q, positions, r.dims, r.base, r.traditional)
        k = rope(k, positions, r.dims, r.base, r.traditional)
        keys, values = c.update_and_fetch(k, v)
        o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=a.scale, mask=mask)
        h = h + a.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = model.model.norm(h)
    return target.lm_head(h)[0]


def trim(cache, n: int) -> None:
    for c in cache:
        c.trim(n)


def check_tree_forward(target, rt, context: list[int]) -> float:
    """Largest logit difference: script chain vs the model, and each tree
    node vs its root path run through the model."""
    chain = context[-6:]
    ref = rt.verify(chain).logits
    mx.eval(ref)
    rt.trim(len(chain))
    out = tree_forward(target, rt.cache, chain, list(range(-1, len(chain) - 1)))
    mx.eval(out)
    trim(rt.cache, len(chain))
    worst = mx.max(mx.abs(out - ref)).item()
    tokens, parents = context[-4:] + context[-9:-6], [-1, 0, 1, 2, 0, 4, 5]
    out = tree_forward(target, rt.cache, tokens, parents)
    mx.eval(out)
    trim(rt.cache, len(tokens))
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        ref = rt.verify(path[::-1]).logits
        mx.eval(ref)
        rt.trim(len(path))
        worst = max(worst, mx.max(mx.abs(out[i] - ref[-1])).item())
    return worst


def measure_costs(target, context: list[int], repeats: int) -> dict:
    """Seconds per forward kind and width, and their ratios to one decode.
    The machine is shared, so every repeat times each kind back to back and
    the ratios are medians of these paired ratios."""
    rt = target.runtime(slack=max(WIDTHS) + 2)
    rt.prefill(context, logits="none")
    mx.eval(rt.state())
    diff = check_tree_forward(target, rt, context)
    feed = (context * 2)[-max(WIDTHS) :]

    def model_chain(t):
        fwd = rt.verify(feed[:t])
        mx.eval(fwd.logits)
        rt.trim(t)

    def script(t, parents):
        mx.eval(tree_forward(target, rt.cache, feed[:t], parents))
        trim(rt.cache, t)

    def pipelined_decodes(n=8):
        y = mx.array(feed[0])
        for _ in range(n):
            nxt = mx.argmax(rt.decode(y).logits[-1])
            mx.async_eval(nxt)
            y = nxt
        mx.eval(y)
        rt.trim(n)

    def seconds(fn, *a) -> float:
        t0 = time.perf_counter()
        fn(*a)
        return time.perf_counter() - t0

    def trees(t):
        half = t // 2
        return [-1] + list(range(half - 1)) + [-1] + [half + i for i in range(t - half - 1)]

    kinds = ("model_chain", "script_chain", "script_tree")
    ratios: dict = {t: {k: [] for k in kinds} for t in WIDTHS}
    pipe, dec = [], []
    for rep in range(repeats + 1):
        d1 = seconds(model_chain, 1)
        p1 = seconds(pipelined_decodes) / 8
        for t in WIDTHS:
            row = {
                "model_chain": seconds(model_chain, t),
                "script_chain": seconds(script, t, list(range(-1, t - 1))),
                "script_tree": seconds(script, t, trees(t)),
            }
            d2 = seconds(model_chain, 1)
            if rep:
                for k in kinds:
                    ratios[t][k].append(row[k] / ((d1 + d2) / 2))
            d1 = d2
        if rep:
            pipe.append(p1)
            dec.append(d1)
    med = statistics.median
    return {
        "decode": med(dec),
        "decode_pipelined": med(pipe),
        "max_logit_diff": diff,
        "widths": {
            t: {k: med(v) for k, v in ratios[t].items()}
            | {
                "tree_over_chain": med(
                    [a / b for a, b in zip(ratios[t]["script_tree"], ratios[t]["script_chain"])]
                )
            }
            for t in WIDTHS
        },
    }


# -- 2. what a second branch adds, by replay --------------------------------------------------
#: What a verify round accepts and costs, given (drafts, their accepted prefix
#: length, the position in the answer): (tokens accepted, modelled seconds).
Judge = Callable[[list[int], int, int], tuple[int, float]]


def judged_rounds(
    stream: Stream, proposer, policy, cost: CostModel, judge: Judge | None = None
) -> tuple[int, int, int, int, float]:
    """Rounds of drafts verified as a tree verify would (a verify the engine
    does not run, so this models its rounds alone: the replay tool runs the
    engine itself): ``judge`` replaces what a verify round accepts and costs;
    the policy still learns the drafts' own outcome and cost. Returns
    (rounds, verify rounds, drafted, accepted, modelled seconds)."""
    tokens = list(stream.prompt)
    out = stream.output
    proposer.start(None, tokens, {}, None)
    i = rounds = verify_rounds = drafted = accepted = 0
    seconds = 0.0
    verified = True  # the round before was a verify (or none): the next plain decode restarts the pipeline
    while i < len(out):
        rounds += 1
        active = proposer.active
        key = proposer.draft_key(tokens) if active else None
        k = min(policy.next_k(key), len(out) - i - 1) if active else 0
        drafts = proposer.propose(tokens, k).ids()[:k] if k > 0 else []
        if not drafts:
            t = cost(1) + (cost.restart if verified else 0.0)
            policy.update(Round(cost_seconds=t, restarted=verified))
            verified = False
            tokens.append(out[i])
            i += 1
            proposer.update(tokens, 0, 0, {})
        else:
            n = 0
            while n < len(drafts) and drafts[n] == out[i + n]:
                n += 1
            t = cost(len(drafts) + 1)
            policy.update(Round(drafted=len(drafts), accepted=n, key=key, cost_seconds=t))
            if judge is not None:
                n, t = judge(drafts, n, i)
                n = min(n, len(out) - i - 1)
            verified = True
            tokens.extend(out[i : i + n + 1])
            i += n + 1
            verify_rounds += 1
            drafted += len(drafts)
            accepted += n
            proposer.update(tokens, len(drafts), n, {})
        seconds += t
    proposer.finish(tokens)
    return rounds, verify_rounds, drafted, accepted, seconds


def second_branch(sam, state: int, main: list[int], budget: int) -> tuple[int, list[int]]:
    """(fork position, branch tokens): the second most frequent continuation
    at the first position of ``main`` where the automaton had a choice,
    continued greedily for up to ``budget`` tokens; (-1, []) if none."""
    if budget < 1:
        return -1, []
    for j, tok in enumerate(main):
        children = sam.nxt[state]
        if len(children) > 1:
            ranked = sorted(
                ((sam.count[c], sam.end[c], t, c) for t, c in children.items() if t != tok and t >= 0),
                reverse=True,
            )
            if not ranked:
                return -1, []
            _, _, alt, child = ranked[0]
            rest, _, _ = sam.draft(child, budget - 1, 0.0)
            return j, [alt, *rest]
        state = children[tok]
    return -1, []


def replay_tree(stream: Stream, memory: DraftMemory, cost: CostModel, branch: int, tree_ratio) -> dict:
    """Rounds as the replay tool modelled them before it ran the engine, each verify widened by a second branch of up
    to ``branch`` tokens (none: the chain alone)."""
    holder = RecordedTarget(stream.prompt, stream.output, cost, cost.restart, memory)
    proposer, policy = build_proposer(holder, SpecConfig(method="ngram"))
    out = stream.output
    gained = 0

    def judge(drafts: list[int], n: int, i: int) -> tuple[int, float]:
        nonlocal gained
        if not branch:
            return n, cost(len(drafts) + 1)
        source, state, _ = proposer._best
        sam = proposer.sam if source == 0 else memory.sam
        fork, alt = second_branch(sam, state, drafts, min(branch, len(out) - i - 1))
        if not alt:
            return n, cost(len(drafts) + 1)
        width = len(drafts) + 1 + len(alt)
        m = 0
        if fork == n:  # the main branch failed exactly where the second one starts
            while m < len(alt) and i + n + m < len(out) and alt[m] == out[i + n + m]:
                m += 1
            gained += m
        return n + m, cost(width) * tree_ratio(width)

    *_, seconds = judged_rounds(stream, proposer, policy, cost, judge)
    return {
        "seconds": seconds,
        "baseline": cost(1) * len(out) + cost.restart,
        "gained": gained,
        "tokens": len(out),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="benchmarks/results/replay_streams_smollm2.json")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None, help="write the measurements as JSON here")
    ap.add_argument("--replay-only", action="store_true", help="skip the timing; tree cost = chain cost")
    args = ap.parse_args()
    streams, cost = load(args.streams)
    result: dict = {}
    if args.replay_only:
        ratio = {}
    else:
        target = hf2q_py.load(dtype="float32")
        context = streams[0].prompt + streams[0].output[:64]
        costs = measure_costs(target, context, args.repeats)
        result["costs"] = costs
        d1 = costs["decode"]
        print(f"max logit difference, script forward vs model: {costs['max_logit_diff']:.2e}")
        print(f"decode: {d1 * 1e3:.1f} ms unpipelined, {costs['decode_pipelined'] * 1e3:.1f} ms pipelined\n")
        print("Forward cost relative to one (unpipelined) decode, medians of paired ratios:\n")
        print("| nodes T | model chain | script chain | script tree (2 branches) | tree / script chain |")
        print("|---:|---:|---:|---:|---:|")
        for t, row in costs["widths"].items():
            print(
                f"| {t} | {row['model_chain']:.2f} | {row['script_chain']:.2f} | "
                f"{row['script_tree']:.2f} | {row['tree_over_chain']:.3f} |"
            )
        ratio = {t: row["tree_over_chain"] for t, row in costs["widths"].items()}

    def tree_ratio(width: int) -> float:
        if not ratio:
            return 1.0
        return ratio[min(ratio, key=lambda t: abs(t - width))]

    print(
        "\n| kind | chain (modelled) | tree, branch <= 2 | tree, branch <= 4 | tree, branch <= 8 | tokens gained (B 4) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    replay_rows = {}
    for kind in dict.fromkeys(s.kind for s in streams):
        cells, gained, total = [], 0, 0
        for branch in (0, 2, 4, 8):
            memories: dict[str, DraftMemory] = {}
            xs = []
            for s in streams:
                if s.kind != kind:
                    continue
                mem = memories.setdefault(s.session, DraftMemory()) if s.session else DraftMemory()
                r = replay_tree(s, mem, cost, branch, tree_ratio)
                xs.append(r["baseline"] / r["seconds"])
                if branch == 4:
                    gained += r["gained"]
                    total += r["tokens"]
            cells.append(sum(xs) / len(xs))
        replay_rows[kind] = {
            "chain": cells[0],
            "tree_b2": cells[1],
            "tree_b4": cells[2],
            "tree_b8": cells[3],
            "gained_b4": gained,
            "tokens": total,
        }
        print(
            f"| {kind} | {cells[0]:.2f}x | {cells[1]:.2f}x | {cells[2]:.2f}x | {cells[3]:.2f}x | "
            f"{gained} of {total} |"
        )
    result["replay"] = replay_rows
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    run_script(main)
