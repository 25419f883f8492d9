"""A model sharded over an MLX distributed group, with its ranks kept in step.

Under ``mlx.launch`` every rank runs the same program: it loads the target,
shards it (mlx-lm's ``shard`` for tensor parallelism, ``pipeline`` for
pipeline parallelism) and runs the same speculative loop. The forwards keep
the ranks' logits identical (their collectives sum or gather the same
values), so drafts from tokens agree by construction; what could still
differ is time. Each round (a generation's alone, or a batch's for all its
rows) the loop calls :func:`agree`: one small ``all_sum`` gives every
rank rank 0's timings (so draft lengths and batch widths are chosen from
the same numbers) and compares every rank's committed tokens (so a
divergence is an error, not a hang or a silent difference).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

import mlx.core as mx

from .errors import Hf2qError, UnsupportedModelError

#: ``--shard`` choices: the model's own mode (tensor where it has one), one
#: mode, or none (every rank runs the whole model on its own).
SHARD_MODES = ("auto", "tensor", "pipeline", "none")
#: Config fields a tensor-parallel split divides by the number of ranks.
SPLIT_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
_CHECK_MODULO = 1 << 23  # float32 holds integers below 2**24 exactly
_FAILED = -1.0  # a rank's check when its side of the round failed


class RanksDiverged(Hf2qError):
    """The ranks of a sharded generation went apart: they committed
    different tokens, or a round failed on one of them. Not the request's
    fault."""


@dataclass(frozen=True)
class Sharding:
    """How a Target is split: the group and the mode ("tensor" or "pipeline")."""

    group: Any
    mode: str

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()


def launched_group() -> Any | None:
    """The group ``mlx.launch`` started this process in, or None when it runs alone."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def is_follower() -> bool:
    """Whether this process is a rank other than 0 of a launched group (it prints nothing)."""
    group = launched_group()
    return group is not None and group.rank() != 0


def check_mode(mode: str) -> str:
    if mode not in SHARD_MODES:
        raise Hf2qError(f"unknown shard mode {mode!r}: use {', '.join(SHARD_MODES)}")
    return mode


def plan(cfg: dict[str, Any], mode: str, size: int) -> str:
    """The mode ("tensor" or "pipeline") a model of config ``cfg`` shards
    over ``size`` ranks with; refuses, naming the architecture and the
    reason, before any weight is read."""
    check_mode(mode)
    arch = str(cfg.get("model_type", "this model"))
    tensor, pipeline = _abilities(cfg)
    if mode == "auto":
        if tensor and not _split_problem(cfg, size):
            return "tensor"
        if pipeline and int(cfg.get("num_hidden_layers") or 0) >= size:
            return "pipeline"
        why = _split_problem(cfg, size) if tensor else "mlx-lm has no tensor or pipeline split for it"
        raise UnsupportedModelError(f"{arch} cannot be sharded over {size} ranks: {why}")
    if mode == "tensor":
        if not tensor:
            raise UnsupportedModelError(
                f"{arch} has no tensor-parallel split in mlx-lm (try --shard pipeline)"
            )
        problem = _split_problem(cfg, size)
        if problem:
            raise UnsupportedModelError(f"{arch} cannot be split by tensor over {size} ranks: {problem}")
    if mode == "pipeline":
        if not pipeline:
            raise UnsupportedModelError(f"{arch} has no pipeline split in mlx-lm (try --shard tensor)")
        layers = int(cfg.get("num_hidden_layers") or 0)
        if layers < size:
            raise UnsupportedModelError(f"{arch} has {layers} layers, fewer than the {size} ranks")
    return mode


def _abilities(cfg: dict[str, Any]) -> tuple[bool, bool]:
    """Whether mlx-lm's class for ``cfg`` has a tensor and a pipeline split."""
    from mlx_lm.models.pipeline import PipelineMixin
    from mlx_lm.utils import _get_classes

    try:
        model_cls, _ = _get_classes(cfg)
    except ValueError as e:
        raise UnsupportedModelError(str(e)) from e
    module = sys.modules[model_cls.__module__]
    pipeline = any(
        isinstance(v, type) and issubclass(v, PipelineMixin) and v is not PipelineMixin
        for v in vars(module).values()
    )
    return hasattr(model_cls, "shard"), pipeline


def _split_problem(cfg: dict[str, Any], size: int) -> str | None:
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    for name in SPLIT_FIELDS:
        value = cfg.get(name, text.get(name))
        if isinstance(value, int) and value % size:
            return f"its {value} {name.replace('num_', '').replace('_', ' ')} do not divide by {size}"
    return None


def shard_model(model: Any, group: Any, mode: str) -> Sharding:
    """Split ``model`` (its weights not yet evaluated, ideally) over ``group``."""
    if mode == "tensor":
        model.shard(group)
    elif mode == "pipeline":
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "pipeline"):
            raise UnsupportedModelError(f"{type(model).__module__}: no pipeline split")
        inner.pipeline(group)
    else:
        raise ValueError(f"not a shard mode: {mode!r}")
    return Sharding(group, mode)


def barrier(group: Any) -> None:
    """Wait until every rank of ``group`` gets here."""
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


def agree(
    sharding: Sharding, values: Sequence[float], check: int = 0, *, failed: bool = False
) -> list[float]:
    """Rank 0's ``values`` on every rank, in one collective; raises
    :class:`RanksDiverged` on every rank when ``check`` (say, a hash of the
    tokens just committed) differs between ranks, or when a rank says its
    side of the work ``failed`` (the others then fail alike, none waits)."""
    n, rank = len(values), sharding.rank
    vector = [float(v) if rank == 0 else 0.0 for v in values] + [0.0] * sharding.size
    vector[n + rank] = _FAILED if failed else float(check % _CHECK_MODULO)
    out = mx.distributed.all_sum(mx.array(vector, dtype=mx.float32), group=sharding.group, stream=mx.cpu)
    out = out.tolist()
    checks = out[n:]
    if _FAILED in checks:
        raise RanksDiverged(f"this round failed on rank {checks.index(_FAILED)} of the sharded model")
    if any(c != checks[0] for c in checks):
        raise RanksDiverged(
            "the ranks of this sharded generation committed different tokens "
            f"(checks {[int(c) for c in checks]}); their weights or kernels differ"
        )
    return out[:n]


def gathered(sharding: Sharding, value: int) -> list[int]:
    """Every rank's ``value`` (a 32-bit integer), in rank order, on every rank."""
    vector = [0] * sharding.size
    vector[sharding.rank] = int(value)
    out = mx.distributed.all_sum(mx.array(vector, dtype=mx.int32), group=sharding.group, stream=mx.cpu)
    return out.tolist()


def agree_seed(sharding: Sharding, seed: int) -> int:
    """Rank 0's 62-bit ``seed`` on every rank (two exact halves of 31 bits)."""
    hi, lo = (seed >> 31) & 0x7FFFFFFF, seed & 0x7FFFFFFF
    words = [hi, lo] if sharding.rank == 0 else [0, 0]
    out = mx.distributed.all_sum(mx.array(words, dtype=mx.int32), group=sharding.group, stream=mx.cpu)
    hi, lo = out.tolist()
    return (hi << 31) | lo


def token_check(tokens: Sequence[int]) -> int:
    """A small hash of ``tokens`` for :func:`agree`."""
    h = len(tokens)
    for t in tokens:
        h = (h * 1_000_003 + int(t)) % _CHECK_MODULO
    return h
