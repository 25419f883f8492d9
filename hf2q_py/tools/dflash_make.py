"""Making a DFlash drafter to train: a fresh one shaped after a target
(optionally warm-started from the target's last layers), a frequency-ranked
draft vocabulary, and the published-format folder a checkpoint is written to
(``load_drafter`` in ``proposers/dflash_drafter.py`` reads it back).

Used by ``train-dflash`` (``dflash_train.py``); the model itself, and what
inference needs, live in ``proposers/dflash_drafter.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from ..proposers.dflash_drafter import (
    VOCAB_FILE,
    Drafter,
    DrafterConfig,
    DraftVocab,
    check_against_target,
)
from ..taps import final_norm_name
from ..validate import check_int


def default_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """``n`` target layers spread from the second to the third-to-last, as the
    DFlash reference picks them."""
    if n == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (n - 1)) for i in range(n)]


def drafter_for(
    target: Any,
    *,
    layers: int = 1,
    target_layer_ids: Sequence[int] | None = None,
    block_size: int = 16,
    mask_token_id: int | None = None,
    seed: int = 0,
    layer_types: Sequence[str] | None = None,
    sliding_window: int | None = None,
    warm_start: bool = False,
) -> Drafter:
    """A freshly initialised drafter shaped after ``target`` (Qwen3-style
    layers with the target's width and head layout). ``warm_start``: each
    drafter layer starts as a copy of one of the target's last layers (see
    ``warm_start_from``)."""
    cfg_of = target.config
    heads = cfg_of("num_attention_heads")
    ids = list(target_layer_ids) if target_layer_ids is not None else default_layer_ids(target.num_layers, 3)
    cfg = DrafterConfig(
        hidden_size=target.hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=cfg_of("num_key_value_heads") or heads,
        head_dim=cfg_of("head_dim") or target.hidden_size // heads,
        intermediate_size=cfg_of("intermediate_size") or cfg_of("block_ff_dim") or 4 * target.hidden_size,
        vocab_size=target.vocab_size,
        target_layer_ids=tuple(ids),
        mask_token_id=mask_token_id if mask_token_id is not None else target.vocab_size - 1,
        block_size=block_size,
        num_target_layers=target.num_layers,
        rms_norm_eps=cfg_of("rms_norm_eps") or 1e-6,
        rope_theta=float(cfg_of("rope_theta") or 10000.0),
        layer_types=tuple(layer_types or ()),
        sliding_window=sliding_window,
    )
    mx.random.seed(seed)
    drafter = Drafter(cfg)
    check_against_target(cfg, target)
    norm = getattr(target._decoder, final_norm_name(target._decoder) or "norm", None)
    if type(norm) is nn.RMSNorm and norm.weight.shape == drafter.norm.weight.shape:
        # start in the target's final-state space, so the borrowed head sees familiar scales
        drafter.norm.weight = mx.array(norm.weight).astype(drafter.norm.weight.dtype)
    if warm_start:
        warm_start_from(drafter, target)
    return drafter


#: (drafter name, target name) of the tensors a warm start copies in each layer
WARM_TENSORS = (
    ("self_attn.q_proj", "self_attn.q_proj"),
    ("self_attn.k_proj", "self_attn.k_proj"),
    ("self_attn.v_proj", "self_attn.v_proj"),
    ("self_attn.o_proj", "self_attn.o_proj"),
    ("mlp.gate_proj", "mlp.gate_proj"),
    ("mlp.up_proj", "mlp.up_proj"),
    ("mlp.down_proj", "mlp.down_proj"),
    ("input_layernorm", "input_layernorm"),
    ("post_attention_layernorm", "post_attention_layernorm"),
)


def warm_start_from(drafter: Drafter, target: Any) -> list[str]:
    """Copy the target's last ``n`` layers into the drafter's ``n`` layers, in
    order (drafter layer i <- target layer L - n + i), tensor by tensor where
    the names and shapes agree (quantized tensors dequantized); the drafter's
    q/k norms, ``fc`` and norms keep their initialisation. Returns the
    drafter parameter names copied."""
    from mlx.utils import tree_flatten

    n, L = len(drafter.layers), target.num_layers
    copied = []
    for i, layer in enumerate(drafter.layers):
        source = target.layers[max(0, L - n + i)]
        source = getattr(source, "layer", source)  # a capture tap wraps the layer
        for mine, theirs in WARM_TENSORS:
            dst, src = _submodule(layer, mine), _submodule(source, theirs)
            if (
                dst is None
                or src is None
                or not isinstance(
                    src, type(dst) if type(dst) is nn.RMSNorm else (nn.Linear, nn.QuantizedLinear)
                )
            ):
                continue  # e.g. Gemma's RMSNorm stores 1 + w: a different parametrisation
            w = _dense_weight(src)
            if w is None or w.shape != dst.weight.shape or "bias" in dst or "bias" in src:
                continue
            dst.weight = w.astype(dst.weight.dtype)
            copied.append(f"layers.{i}.{mine}.weight")
    mx.eval(dict(tree_flatten(drafter.parameters())))
    return copied


def _submodule(module: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _dense_weight(module: Any) -> mx.array | None:
    w = getattr(module, "weight", None)
    if w is None:
        return None
    if "scales" in module:
        return mx.dequantize(
            w,
            module.scales,
            module.get("biases"),
            group_size=module.group_size,
            bits=module.bits,
            mode=getattr(module, "mode", "affine"),
        )
    return mx.array(w)


def frequency_vocab(sequences: Sequence[Sequence[int]], size: int, vocab_size: int) -> DraftVocab:
    """The ``size`` most frequent tokens of ``sequences`` (ties: lower id
    first), topped up with unseen ids in order when the text has fewer."""
    check_int("draft vocabulary size", size, 1, vocab_size)
    counts = mx.zeros((vocab_size,), dtype=mx.int32)
    for seq in sequences:
        if len(seq):
            counts = counts.at[mx.array(list(seq), dtype=mx.int32)].add(1)
    counts_list = counts.tolist()
    seen = sorted((i for i in range(vocab_size) if counts_list[i]), key=lambda i: (-counts_list[i], i))
    ranked = seen[:size]
    if len(ranked) < size:
        chosen = set(ranked)
        ranked += [i for i in range(vocab_size) if i not in chosen][: size - len(ranked)]
    return DraftVocab(ranked, vocab_size)


def save_drafter(drafter: Drafter, path: str | Path, extra: dict[str, Any] | None = None) -> None:
    """Write ``drafter`` as a published-format folder."""
    from mlx.utils import tree_flatten

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = drafter.config.to_dict()
    if extra:
        cfg.update(extra)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(drafter.parameters())))
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if drafter.vocab is not None:
        (path / VOCAB_FILE).write_text(json.dumps({"token_ids": drafter.vocab.token_ids}) + "\n")
    elif (path / VOCAB_FILE).exists():
        (path / VOCAB_FILE).unlink()
