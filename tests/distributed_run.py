"""Run under ``mlx.launch`` (or alone, for the one-rank reference) by
test_distributed.py: tiny models sharded over the launched group, every
method, and three generations batched; one JSON line per rank with the
tokens each generation gave (and the batch sizes the rounds had)."""

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
from hf2q_py.prompt_cache import PromptCache  # noqa: E402
from hf2q_py.request import GenerationChunk, make_config  # noqa: E402
from hf2q_py.scheduler import Scheduler, SchedulerConfig, Sink  # noqa: E402
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
    out[f"{arch}/{mode}/batched"], sizes = batched(target, prompt)
    out[f"{arch}/{mode}/batched/sizes"] = sizes  # compared between ranks only
    if arch == "llama":
        out[f"{arch}/{mode}/prompt_cache"], out[f"{arch}/{mode}/prompt_cache/cached"] = cache_reuse(
            target, prompt
        )
    return out


def cache_reuse(target: Target, prompt: list[int]) -> tuple[list[list[int]], list[int]]:
    """Three turns of a conversation on a prompt cache, which rank 1 empties
    after the first: the turns' tokens, and the prompt tokens each reused."""
    target.prompt_cache = PromptCache()
    turns, cached = [], []
    for extra in ([], [5, 6, 7], [8, 9]):
        prompt = prompt + (turns[-1] if turns else []) + extra
        result = hf2q_py.generate(target, prompt, max_tokens=8, method="ngram")
        turns.append(result.tokens)
        cached.append(result.stats.cached_tokens)
        if len(turns) == 1 and target.sharding is not None and target.sharding.rank == 1:
            target.prompt_cache.clear()  # rank 0 alone holds the state the next prompt extends
    target.prompt_cache = None
    return turns, cached


class Tokens(Sink):
    def __init__(self):
        self.tokens: list[int] = []

    def chunk(self, chunk: GenerationChunk) -> None:
        self.tokens.extend(chunk.tokens)


def batched(target: Target, prompt: list[int]) -> tuple[list[list[int]], dict[int, int]]:
    """Three n-gram generations (one of them sampled) run by one scheduler:
    their tokens, and its rounds by batch size."""
    scheduler = Scheduler(target, SchedulerConfig(max_batch=4))
    configs = [make_config(max_tokens=40), make_config(max_tokens=32, **SAMPLED), make_config(max_tokens=24)]
    sinks = [Tokens() for _ in configs]
    for i, (config, sink) in enumerate(zip(configs, sinks)):
        scheduler.submit(prompt[i * 5 :], config, sink)
    scheduler.run()
    return [s.tokens for s in sinks], scheduler.rounds_by_size


def main() -> None:
    drafter = sys.argv[1]
    group = launched_group()
    out = {"rank": group.rank() if group is not None else 0, "ranks": group.size() if group else 1}
    for arch, mode, methods in CASES:
        out.update(run(arch, mode, methods, drafter, group))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
