"""The DFlash block drafter: a few Qwen3-style layers that draft a whole block
of tokens in one forward, conditioned on hidden states captured from the
target.

- Context: the target's outputs at ``target_layer_ids`` for the committed
  tokens, concatenated and fused by ``fc`` (n_layers*H -> H) and an RMSNorm.
  Each layer projects them with its own k/v projections (k-norm, RoPE at the
  context positions) into the drafter's KV cache.
- Block: ``[last_token] + [mask_token] * (block_size - 1)``, embedded with the
  target's embedding, at the positions that follow the context. Its queries
  attend to the cached context and to the block: the whole block in
  ``full_attention`` layers; in ``sliding_attention`` layers causally and
  within ``sliding_window`` positions (context included), as in the published
  reference. A config's ``is_causal`` overrides the causality of every layer
  (non-causal sliding layers see the window on both sides). The drafts come
  from the last ``block_size - 1`` positions through the target's own LM head.

The drafter has no embedding or head of its own; ``TargetHead`` lends them.
Weight names and config.json follow the published (z-lab) format.

A reduced draft vocabulary (``DraftVocab``, the idea of FR-Spec and EAGLE-3's
draft-to-target map; ``draft_vocab.json`` in the folder) makes the drafter
score only a frequency-ranked subset of the target's tokens: its head reads
those rows of the target's head. Drafts then come from the subset alone
(under sampling, q is zero outside it); verification still runs the target's
full head, so the output is unchanged.

This module is the model and what inference needs (config, layers, cache,
loading a folder). Making a drafter to train (shaped after a target, warm
start, a frequency-ranked vocabulary, writing a folder) is in
``tools/dflash_make.py``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from ..errors import Hf2qError, ModelLoadError, one_line
from ..validate import check_float, check_int

ARCHITECTURE = "DFlashDraftModel"


@dataclass
class DrafterConfig:
    """Shape and wiring of a drafter (config.json, published format)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    layer_types: tuple[str, ...] = field(default_factory=tuple)
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: sliding layers causal, full layers bidirectional
    input_embedding_scale: float | None = None  # None: the target's own embedding scale

    def __post_init__(self):
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        if not self.layer_types:
            self.layer_types = ("full_attention",) * self.num_hidden_layers
        self.layer_types = tuple(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise Hf2qError(
                f"drafter config: layer_types has {len(self.layer_types)} entries "
                f"for {self.num_hidden_layers} layers"
            )
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise Hf2qError(f"drafter config: unsupported layer_types {sorted(unknown)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise Hf2qError("drafter config: sliding_attention layers need sliding_window")
        if self.block_size < 2:
            raise Hf2qError(f"drafter config: block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise Hf2qError("drafter config: dflash_config.target_layer_ids is empty")

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DrafterConfig:
        """Parse a published config.json (``block_size`` at the top level or in
        ``dflash_config``; ``mask_token_id`` and ``target_layer_ids`` in it)."""
        if not isinstance(cfg, dict):
            raise Hf2qError(f"drafter config.json must hold an object, got {type(cfg).__name__}")
        dflash = cfg.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise Hf2qError("drafter config.json: dflash_config must be an object")
        missing = [
            k
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "intermediate_size",
                "vocab_size",
            )
            if k not in cfg
        ]
        missing += [f"dflash_config.{k}" for k in ("mask_token_id", "target_layer_ids") if k not in dflash]
        if missing:
            raise Hf2qError(f"drafter config.json lacks {', '.join(missing)}")
        _check_types(cfg, dflash)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
        theta = cfg.get("rope_theta", (rope or {}).get("rope_theta", 1_000_000.0))
        if rope is not None and rope.get("rope_type", rope.get("type")) in (None, "default"):
            rope = None
        heads = cfg["num_attention_heads"]
        return cls(
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            target_layer_ids=tuple(dflash["target_layer_ids"]),
            mask_token_id=int(dflash["mask_token_id"]),
            block_size=int(cfg.get("block_size", dflash.get("block_size", 16))),
            num_target_layers=cfg.get("num_target_layers"),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            layer_types=tuple(cfg.get("layer_types") or ()),
            sliding_window=cfg.get("sliding_window"),
            is_causal=cfg.get("is_causal"),
            input_embedding_scale=dflash.get("input_embedding_scale", cfg.get("input_embedding_scale")),
        )

    def to_dict(self) -> dict[str, Any]:
        """The published config.json layout."""
        d = asdict(self)
        dflash = {
            "mask_token_id": d.pop("mask_token_id"),
            "target_layer_ids": list(d.pop("target_layer_ids")),
        }
        d["layer_types"] = list(d["layer_types"])
        for optional in ("rope_scaling", "is_causal", "input_embedding_scale"):
            if d[optional] is None:
                d.pop(optional)
        if "input_embedding_scale" in d:
            dflash["input_embedding_scale"] = d.pop("input_embedding_scale")
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            **d,
            "dflash_config": dflash,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
        }


def _check_types(cfg: dict[str, Any], dflash: dict[str, Any]) -> None:
    """Types and ranges of the config.json fields ``from_dict`` reads."""

    def field_int(name: str, value: Any, lo: int) -> None:
        check_int(f"drafter config.json: {name}", value, lo)

    for name in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "vocab_size",
    ):
        field_int(name, cfg[name], 1)
    for name in (
        "num_key_value_heads",
        "head_dim",
        "num_target_layers",
        "max_position_embeddings",
        "sliding_window",
    ):
        if cfg.get(name) is not None:
            field_int(name, cfg[name], 1)
    kv = cfg.get("num_key_value_heads")
    if kv is not None and cfg["num_attention_heads"] % kv:
        raise Hf2qError("drafter config.json: num_attention_heads must be a multiple of num_key_value_heads")
    block = cfg.get("block_size", dflash.get("block_size", 16))
    field_int("block_size", block, 2)
    field_int("dflash_config.mask_token_id", dflash["mask_token_id"], 0)
    ids = dflash["target_layer_ids"]
    if not isinstance(ids, list) or not ids:
        raise Hf2qError("drafter config.json: dflash_config.target_layer_ids must be a non-empty list")
    for i in ids:
        field_int("dflash_config.target_layer_ids entry", i, 0)
    for name in ("rms_norm_eps", "rope_theta"):
        if cfg.get(name) is not None:
            check_float(f"drafter config.json: {name}", cfg[name], 0.0, lo_open=True)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if rope is not None and not isinstance(rope, dict):
        raise Hf2qError("drafter config.json: rope_scaling must be an object")
    types = cfg.get("layer_types") or []
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise Hf2qError("drafter config.json: layer_types must be a list of strings")


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer: int):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.scale = d**-0.5
        sliding = cfg.layer_types[layer] == "sliding_attention"
        self.window = cfg.sliding_window if sliding else None
        self.causal = sliding if cfg.is_causal is None else bool(cfg.is_causal)
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)

    def _heads(self, x: mx.array, n: int, norm: nn.Module | None) -> mx.array:
        B, L, _ = x.shape
        x = x.reshape(B, L, n, self.head_dim)
        return (norm(x) if norm is not None else x).transpose(0, 2, 1, 3)

    def context_kv(self, ctx: mx.array, rope: nn.Module, offset: int) -> tuple[mx.array, mx.array]:
        """Keys and values of fused context features at positions offset, offset+1, ..."""
        k = rope(self._heads(self.k_proj(ctx), self.n_kv_heads, self.k_norm), offset=offset)
        return k, self._heads(self.v_proj(ctx), self.n_kv_heads, None)

    def __call__(
        self,
        x: mx.array,
        ctx_k: mx.array,
        ctx_v: mx.array,
        rope: nn.Module,
        block_pos: int | mx.array,
        ctx_visible: mx.array | None,
        ctx_pos: mx.array | None = None,
    ) -> mx.array:
        """``x``: (N, L, H) blocks starting at ``block_pos`` (an int, or (N,)
        positions); ``ctx_k/v``: (1 or N, kv_heads, S, d); ``ctx_visible``:
        None (all context visible) or a bool mask (N, 1, L or 1, S);
        ``ctx_pos``: the context keys' positions (N, S), None when they are
        the S positions right before each block."""
        N, L, _ = x.shape
        q = rope(self._heads(self.q_proj(x), self.n_heads, self.q_norm), offset=block_pos)
        k = rope(self._heads(self.k_proj(x), self.n_kv_heads, self.k_norm), offset=block_pos)
        v = self._heads(self.v_proj(x), self.n_kv_heads, None)
        S = ctx_k.shape[2]
        if ctx_k.shape[0] != N:
            ctx_k, ctx_v = (
                mx.broadcast_to(ctx_k, (N, *ctx_k.shape[1:])),
                mx.broadcast_to(ctx_v, (N, *ctx_v.shape[1:])),
            )
        keys, values = mx.concatenate([ctx_k, k], axis=2), mx.concatenate([ctx_v, v], axis=2)
        mask = None
        if self.window is not None and S:
            # a query at block position i sees context key j when (pos_i - pos_j) < window
            start = block_pos if isinstance(block_pos, mx.array) else mx.array([block_pos])
            q_pos = start.reshape(-1, 1, 1, 1) + mx.arange(L).reshape(1, 1, L, 1)
            if ctx_pos is None:
                k_pos = (start.reshape(-1, 1, 1, 1) - S) + mx.arange(S).reshape(1, 1, 1, S)
            else:
                k_pos = ctx_pos[:, None, None, :]
            in_window = (q_pos - k_pos) < self.window
            ctx_visible = in_window if ctx_visible is None else ctx_visible & in_window
        block = self._block_mask(L)
        if ctx_visible is not None or block is not None:
            n = ctx_visible.shape[0] if ctx_visible is not None else 1
            ctx = (
                mx.ones((n, 1, L, S), dtype=mx.bool_)
                if ctx_visible is None
                else mx.broadcast_to(ctx_visible, (n, 1, L, S))
            )
            blk = (
                mx.ones((n, 1, L, L), dtype=mx.bool_)
                if block is None
                else mx.broadcast_to(block, (n, 1, L, L))
            )
            mask = mx.concatenate([ctx, blk], axis=-1)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(N, L, -1))

    def _block_mask(self, L: int) -> mx.array | None:
        """Which block keys each block query sees: None for all of them."""
        if not self.causal and self.window is None:
            return None
        i, j = mx.arange(L).reshape(L, 1), mx.arange(L).reshape(1, L)
        visible = j <= i if self.causal else mx.ones((L, L), dtype=mx.bool_)
        if self.window is not None:
            visible = visible & ((i - j) < self.window)
            if not self.causal:
                visible = visible & ((j - i) < self.window)
        return visible


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer: int):
        super().__init__()
        self.self_attn = DrafterAttention(cfg, layer)
        self.mlp = DrafterMLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class DrafterCache:
    """The fused context's keys and values per layer; only committed
    positions ever enter it, so it never needs trimming."""

    def __init__(self, n_layers: int):
        self.keys: list[mx.array | None] = [None] * n_layers
        self.values: list[mx.array | None] = [None] * n_layers
        self.offset = 0

    def append(self, layer: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys[layer] is not None:
            k = mx.concatenate([self.keys[layer], k], axis=2)
            v = mx.concatenate([self.values[layer], v], axis=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def state(self) -> list[mx.array]:
        return [a for a in self.keys + self.values if a is not None]


class Drafter(nn.Module):
    """The block drafter (see module docstring)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        from mlx_lm.models.rope_utils import initialize_rope

        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [DrafterLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self._rope = initialize_rope(
            cfg.head_dim, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings
        )
        #: the reduced draft vocabulary, or None for the target's whole vocabulary
        self.vocab: DraftVocab | None = None

    def fuse(self, features: mx.array) -> mx.array:
        """(N, S, n_layers*H) concatenated target states -> (N, S, H) context."""
        return self.hidden_norm(self.fc(features))

    def context(self, features: mx.array, offset: int | mx.array) -> list[tuple[mx.array, mx.array]]:
        """Each layer's keys and values (N, kv_heads, S, d) of the context
        ``features`` (N, S, ...) at positions ``offset`` (an int, or (N,)) on."""
        ctx = self.fuse(features)
        return [layer.self_attn.context_kv(ctx, self._rope, offset) for layer in self.layers]

    def extend(self, features: mx.array, cache: DrafterCache) -> None:
        """Add the context ``features`` (1, S, ...) to ``cache``, with no block."""
        if features.shape[1]:
            for i, (k, v) in enumerate(self.context(features, cache.offset)):
                cache.append(i, k, v)
            cache.offset += features.shape[1]

    def draft_rows(self, x: mx.array, rows: Any) -> mx.array:
        """Final-norm hidden states (R, L, H) of embedded blocks ``x``, row b's
        block right after row b's context in ``rows`` (a ``DrafterRows``:
        slots, their positions and each row's length)."""
        visible, positions = rows.visible()
        block_pos = rows.lengths()
        h = x
        for i, layer in enumerate(self.layers):
            k, v = rows.context(i)
            h = h + layer.self_attn(layer.input_layernorm(h), k, v, self._rope, block_pos, visible, positions)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def __call__(
        self,
        x: mx.array,
        features: mx.array | None,
        *,
        cache: DrafterCache | None = None,
        block_pos: int | mx.array | None = None,
        ctx_visible: mx.array | None = None,
    ) -> mx.array:
        """Final-norm hidden states (N, L, H) of embedded blocks ``x``.

        Inference: ``features`` are the context positions new since the last
        call; they join ``cache`` and the block sits right after them.
        Training (no cache): ``features`` (1, S, ...) cover positions 0..S-1,
        ``block_pos`` gives each block's start and ``ctx_visible`` (N, 1, L, S)
        which context positions each block may see.
        """
        S = features.shape[1] if features is not None else 0
        if cache is not None:
            if S:
                self.extend(features, cache)
            kv = [(cache.keys[i], cache.values[i]) for i in range(len(self.layers))]
            block_pos = cache.offset
        else:
            kv = self.context(features, 0) if S else [(None, None)] * len(self.layers)
        h = x
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            k, v = kv[i]
            if k is None:
                k = v = mx.zeros((1, attn.n_kv_heads, 0, attn.head_dim), dtype=h.dtype)
            h = h + attn(layer.input_layernorm(h), k, v, self._rope, block_pos, ctx_visible)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def make_cache(self) -> DrafterCache:
        return DrafterCache(len(self.layers))


VOCAB_FILE = "draft_vocab.json"


class DraftVocab:
    """The target token ids a drafter's head scores, most frequent first."""

    def __init__(self, token_ids: Sequence[int], vocab_size: int):
        ids = [int(i) for i in token_ids]
        if not ids:
            raise Hf2qError("a draft vocabulary needs at least one token")
        if len(set(ids)) != len(ids):
            raise Hf2qError("a draft vocabulary lists a token twice")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise Hf2qError(
                f"draft vocabulary token {bad[0]} is outside the target's vocabulary ({vocab_size})"
            )
        self.token_ids, self.vocab_size = ids, vocab_size
        self.ids = mx.array(ids, dtype=mx.int32)
        #: subset position of every target token, -1 outside the subset
        index = mx.full((vocab_size,), -1, dtype=mx.int32)
        index[self.ids] = mx.arange(len(ids), dtype=mx.int32)
        self.index = index

    def __len__(self) -> int:
        return len(self.token_ids)

    def to_full(self, logits: mx.array) -> mx.array:
        """(..., len) subset logits -> (..., vocab_size) logits, -inf outside the subset."""
        full = mx.full((*logits.shape[:-1], self.vocab_size), -mx.inf, dtype=logits.dtype)
        full[..., self.ids] = logits
        return full


def _subset_rows(target: Any, ids: mx.array):
    """A function h -> logits over the rows ``ids`` of the target's LM head
    (a copy of those rows: dense, or quantized with their scales)."""
    head = getattr(target.lm, "lm_head", None)
    module = head if head is not None else target.embed_tokens
    weight = getattr(module, "weight", None)
    if weight is None or not isinstance(
        module, (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)
    ):
        raise Hf2qError(f"a draft vocabulary needs a linear LM head; {type(module).__name__} is not one")
    w = weight[ids]
    bias = module["bias"][ids] if "bias" in module else None
    if "scales" in module:
        scales = module.scales[ids]
        biases = module["biases"][ids] if module.get("biases") is not None else None
        mode = getattr(module, "mode", "affine")

        def logits(h: mx.array) -> mx.array:
            out = mx.quantized_matmul(
                h,
                w,
                scales,
                biases,
                transpose=True,
                group_size=module.group_size,
                bits=module.bits,
                mode=mode,
            )
            return out + bias if bias is not None else out
    else:

        def logits(h: mx.array) -> mx.array:
            out = h @ w.T
            return out + bias if bias is not None else out

    mx.eval(w)
    return logits


class TargetHead:
    """The target's embedding (with its scale, or the drafter config's
    ``input_embedding_scale``) and LM head (with its softcap), lent to the
    drafter; with a ``vocab``, ``draft_logits`` scores only its tokens."""

    def __init__(
        self, target: Any, input_embedding_scale: float | None = None, vocab: DraftVocab | None = None
    ):
        if target._decoder is None or target.embed_tokens is None:
            raise Hf2qError(
                f"cannot find the embedding of {type(target.model).__name__} to lend to the drafter"
            )
        self.embed_tokens = target.embed_tokens
        self.scale = target.embed_scale
        if input_embedding_scale is not None:  # the drafter's config overrides it
            self.scale = float(input_embedding_scale)
        self.head = target.lm_head
        self.softcap = target.softcap
        self.vocab = vocab
        self._draft_head = self.head
        if vocab is not None:  # the rows are copied once per target and vocabulary
            heads = target.kept.draft_heads
            kept = heads.get(id(vocab))
            if kept is None or kept[0] is not vocab:  # (holding the vocabulary keeps its id unique)
                kept = heads[id(vocab)] = (vocab, _subset_rows(target, vocab.ids))
            self._draft_head = kept[1]

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.embed_tokens(tokens)
        return h * self.scale if self.scale != 1.0 else h

    def logits(self, hidden: mx.array) -> mx.array:
        """Logits over the target's whole vocabulary."""
        return self._cap(self.head(hidden))

    def draft_logits(self, hidden: mx.array) -> mx.array:
        """Logits over the draft vocabulary (in its order), or the whole one."""
        return self._cap(self._draft_head(hidden))

    def _cap(self, out: mx.array) -> mx.array:
        if self.softcap:
            out = mx.tanh(out / self.softcap) * self.softcap
        return out


# -- folders in the published format ---------------------------------------------


def check_against_target(cfg: DrafterConfig, target: Any) -> None:
    """Refuse a drafter that was not made for ``target``."""
    if cfg.hidden_size != target.hidden_size:
        raise Hf2qError(
            f"the drafter's hidden size ({cfg.hidden_size}) differs from the target's ({target.hidden_size})"
        )
    if target.vocab_size is not None and cfg.vocab_size != target.vocab_size:
        raise Hf2qError(
            f"the drafter's vocabulary ({cfg.vocab_size}) differs from the target's ({target.vocab_size})"
        )
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise Hf2qError(
            f"drafter target_layer_ids {bad} are out of range for a target with {target.num_layers} layers"
        )
    if cfg.num_target_layers is not None and cfg.num_target_layers != target.num_layers:
        raise Hf2qError(
            f"the drafter was made for a {cfg.num_target_layers}-layer target; this one has {target.num_layers}"
        )
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise Hf2qError(f"drafter mask_token_id {cfg.mask_token_id} is outside the vocabulary")


BORROWED = ("embed_tokens.", "lm_head.", "model.embed_tokens.")


#: A drafter folder's files (what a hub repo's drafter downloads).
DRAFTER_FILES = ["config.json", "*.safetensors", VOCAB_FILE]


def load_drafter(
    path: str | Path, dtype: Any = None, *, offline: bool = False, progress: bool | None = None
) -> Drafter:
    """Read a drafter folder (config.json + *.safetensors): a local folder,
    or a hub repo (``owner/name``) downloaded into the Hugging Face cache
    unless already there (``offline``: never; ``progress``: bars on stderr,
    None: when stderr is a terminal)."""
    path = drafter_folder(path, offline=offline, progress=progress)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"drafter folder {path} has no config.json")
    try:
        raw = json.loads((path / "config.json").read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise ModelLoadError(
            f"drafter config {path / 'config.json'} is not valid JSON: {one_line(e)}"
        ) from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"drafter config {path / 'config.json'} must hold an object")
    arch = raw.get("architectures") or [ARCHITECTURE]
    arch = arch[0] if isinstance(arch, list) else arch
    if arch != ARCHITECTURE:
        raise ModelLoadError(f"unsupported drafter architecture {arch!r} (expected {ARCHITECTURE})")
    drafter = Drafter(DrafterConfig.from_dict(raw))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"drafter folder {path} has no .safetensors weights")
    try:
        weights = {k: v for f in files for k, v in mx.load(str(f)).items() if not k.startswith(BORROWED)}
    except Exception as e:  # mlx raises several types for unreadable files
        raise ModelLoadError(f"drafter weights in {path} cannot be read: {one_line(e)}") from None
    try:
        drafter.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"drafter weights in {path} do not match its config: {one_line(e)}") from None
    if (path / VOCAB_FILE).is_file():
        drafter.vocab = _read_vocab(path / VOCAB_FILE, drafter.config.vocab_size)
    if dtype is not None:
        drafter.set_dtype(dtype)
    mx.eval(drafter.parameters())
    drafter.eval()
    return drafter


def drafter_folder(source: str | Path, *, offline: bool = False, progress: bool | None = None) -> Path:
    """The local folder of a drafter: ``source`` itself when it exists, else
    the hub repo it names, with its drafter files downloaded."""
    path = Path(source).expanduser()
    if path.exists():
        return path
    from ..loaders.folder import resolve_folder
    from ..loaders.progress import shown

    return resolve_folder(str(source), offline=offline, progress=shown(progress), patterns=DRAFTER_FILES)


def _read_vocab(path: Path, vocab_size: int) -> DraftVocab:
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ModelLoadError(f"draft vocabulary {path} is not valid JSON: {one_line(e)}") from None
    ids = raw.get("token_ids") if isinstance(raw, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelLoadError(f'draft vocabulary {path} must hold {{"token_ids": [integers]}}')
    try:
        return DraftVocab(ids, vocab_size)
    except Hf2qError as e:
        raise ModelLoadError(f"{path}: {e}") from None
