"""Run under ``mlx.launch`` (or alone, for the one-rank reference) by
test_distributed.py: tiny models sharded over the launched group, every
method, one JSON line per rank with the tokens each generation gave."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import hf2q_py  # noqa: E402
import mlx.core as mx  # noqa: E402
from models import random_prompt, tiny_model  # noqa: E402

from hf2q_py.distributed import launched_group, shard_model  # noqa: E402
from hf2q_py.errors import Hf2qError  # noqa: E402
from hf2q_py.target import Target  # noqa: E402

#: (architecture, shard mode, methods): tensor-parallel llama under every
#: method; gpt-oss (tensor; sliding window 8, experts) and qwen3-next
#: (pipeline; recurrent layers) roll back past what a window or a state holds.
CASES = [
    ("llama", "tensor", ("baseline", "ngram", "draft", "layerskip", "layerskip-auto", "dflash")),
    ("gpt_oss", "tensor", ("baseline", "ngram", "draft")),
    ("qwen2", "pipeline", ("baseline", "ngram", "draft", "layerskip", "dflash")),
    ("qwen3_next", "pipeline", ("baseline", "ngram")),
]
SAMPLED = dict(temperature=0.8, seed=11)


def target_for(arch: str, mode: str, group) -> Target:
    model = tiny_model(arch, seed=1, scale=2.0)
    sharding = shard_model(model, group, mode) if group is not None else None
    mx.eval(model.parameters())
    return Target(model, None, sharding=sharding)


def options(method: str, arch: str, drafter: str) -> dict:
    if method == "draft":
        return dict(method="draft", draft=Target(tiny_model(arch, seed=2, scale=2.0)), k=6)
    if method == "layerskip":
        return dict(method="layerskip", skip_layers=[1, 2], k=4)
    if method == "layerskip-auto":
        return dict(method="layerskip")
    if method == "dflash":
        return dict(method="dflash", drafter=drafter)
    return dict(method=method)


def run(arch: str, mode: str, methods, drafter: str, group) -> dict:
    target = target_for(arch, mode, group)
    prompt = random_prompt(24, seed=3) * 3  # repeats for the n-gram method to copy
    out = {}
    for method in methods:
        name = f"{arch}/{mode}/{method}"
        try:
            opts = options(method, arch, drafter)
            out[name] = hf2q_py.generate(target, prompt, max_tokens=48, **opts).tokens
            if method in ("baseline", "ngram", "draft"):
                sampled = hf2q_py.generate(target, prompt, max_tokens=32, **opts, **SAMPLED)
                out[name + "/sampled"] = sampled.tokens
        except Hf2qError as e:
            out[name] = f"error: {e}"
    unseeded = hf2q_py.generate(target, prompt, max_tokens=24, method="ngram", temperature=1.0)
    out[f"{arch}/{mode}/unseeded"] = unseeded.tokens  # compared between ranks only
    return out


def main() -> None:
    drafter = sys.argv[1]
    group = launched_group()
    out = {"rank": group.rank() if group is not None else 0, "ranks": group.size() if group else 1}
    for arch, mode, methods in CASES:
        out.update(run(arch, mode, methods, drafter, group))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
