"""Gemma 4 GGUF files (``gemma4``) as mlx-lm's ``gemma4_text`` model.

llama.cpp's converter writes norms as they are (no 1 + w), the sliding and
full layers' head sizes as ``key_length_swa`` / ``key_length``, KV heads and
MLP widths per layer where they vary, layer types as per-layer flags (true:
sliding), the full layers' partial rope as a ``rope_freqs`` tensor, expert
gate and up fused (``ffn_gate_up_exps``, gate first) and the router's input
and output scales as ``.scale`` tensors. K = V on full layers is a file whose
full layers have no ``attn_v``; a double-wide MLP is a width array doubled on
the KV-shared layers. Every field of mlx-lm's config is set here: its defaults
describe one particular model.

KV sharing: llama.cpp gives a shared sliding layer the KV of layer M - 2 and
a shared full layer that of M - 1 (M: the first shared layer); mlx-lm gives
each the last earlier layer of its type. They agree exactly when layer M - 1
is full and M - 2 sliding (Gemma 4 E2B and E4B); any other layout is refused
(llama.cpp itself refuses most of them).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..errors import ModelLoadError, UnsupportedModelError
from .gguf_file import GGUFHeader

LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "router.proj",
    "ffn_gate_up_exps": "experts.switch_glu.gate_up_proj",
    "ffn_gate_exps": "experts.switch_glu.gate_proj",
    "ffn_up_exps": "experts.switch_glu.up_proj",
    "ffn_down_exps": "experts.switch_glu.down_proj",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    # whole names (no .weight): scales the graph multiplies by
    "layer_output_scale.weight": "layer_scalar",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
}
GLOBAL_NAMES = {
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}
#: A fused layer's mlx-lm name -> its halves along the rows (gate first).
FUSED = {"experts.switch_glu.gate_up_proj": ("experts.switch_glu.gate_proj", "experts.switch_glu.up_proj")}
#: Tensors a KV-shared layer may carry that llama.cpp loads and never uses.
_SHARED_UNUSED = ("attn_k", "attn_v", "attn_k_norm")


def first_shared(header: GGUFHeader) -> int:
    return header.arch_key("block_count") - (header.arch_key("attention.shared_kv_layers") or 0)


def unused(cfg: dict[str, Any], name: str) -> bool:
    """Whether a tensor is one of a KV-shared layer's unused K/V projections."""
    parts = name.split(".")
    first = cfg["num_hidden_layers"] - cfg.get("num_kv_shared_layers", 0)
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in _SHARED_UNUSED and int(parts[1]) >= first


def gemma4_config(header: GGUFHeader) -> dict[str, Any]:
    """The mlx-lm ``gemma4_text`` config of a ``gemma4`` file (header only)."""
    get, name = header.arch_key, header.path.name
    n = get("block_count")
    sliding = _required(header, "attention.sliding_window_pattern")
    if not isinstance(sliding, list) or len(sliding) != n:
        raise ModelLoadError(f"{name}: gemma4.attention.sliding_window_pattern must be {n} per-layer flags")
    m = first_shared(header)
    types = ["sliding_attention" if s else "full_attention" for s in sliding]
    _check_kv_sharing(types, m, name)
    hd_full = get("attention.key_length") or get("embedding_length") // _uniform(
        header, "attention.head_count"
    )
    hd_swa = _required(header, "attention.key_length_swa")
    for key, want in (("rope.dimension_count", hd_full), ("rope.dimension_count_swa", hd_swa)):
        if get(key, want) != want:
            raise UnsupportedModelError(f"{name}: gemma4.{key} {get(key)} differs from the head size {want}")
    ff_full, double_wide = _mlp_width(header, m)
    cfg: dict[str, Any] = {
        "model_type": "gemma4_text",
        "num_hidden_layers": n,
        "hidden_size": get("embedding_length"),
        "intermediate_size": ff_full,
        "use_double_wide_mlp": double_wide,
        "num_attention_heads": _uniform(header, "attention.head_count"),
        "head_dim": hd_swa,
        "global_head_dim": hd_full,
        "layer_types": types,
        "sliding_window": _required(header, "attention.sliding_window"),
        "num_kv_shared_layers": n - m,
        "rms_norm_eps": _required(header, "attention.layer_norm_rms_epsilon"),
        "hidden_size_per_layer_input": _required(header, "embedding_length_per_layer_input"),
        "final_logit_softcapping": get("final_logit_softcapping", 30.0),  # llama.cpp's default
        "max_position_embeddings": get("context_length", 131072),
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "rope_traditional": False,
        "rope_parameters": _rope(header),
        **_kv_heads(header, types, m),
        **_experts(header, n),
    }
    embed = header.tensors.get("token_embd.weight")
    cfg["vocab_size"] = embed.shape[0] if embed else len(header.metadata.get("tokenizer.ggml.tokens", []))
    per_layer = header.tensors.get("per_layer_token_embd.weight")
    cfg["vocab_size_per_layer_input"] = per_layer.shape[0] if per_layer else cfg["vocab_size"]
    if get("attention.causal", True) is False:
        raise UnsupportedModelError(f"{name}: a non-causal gemma4 file is not supported")
    return cfg


def _required(header: GGUFHeader, key: str) -> Any:
    value = header.arch_key(key)
    if value is None:
        raise ModelLoadError(f"{header.path.name}: GGUF metadata lacks gemma4.{key}")
    return value


def _uniform(header: GGUFHeader, key: str) -> int:
    value = _required(header, key)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedModelError(f"{header.path.name}: gemma4.{key} varies per layer; not supported")
        return value[0]
    return value


def _check_kv_sharing(types: list[str], m: int, file: str) -> None:
    if m == len(types):
        return
    if m < 2 or types[m - 1] != "full_attention" or types[m - 2] != "sliding_attention":
        raise UnsupportedModelError(
            f"{file}: KV-shared layers from {m} need layer {m - 1} full and {m - 2} sliding "
            "(where llama.cpp's and mlx-lm's choice of the shared KV agree)"
        )


def _mlp_width(header: GGUFHeader, m: int) -> tuple[int, bool]:
    """The MLP width and whether KV-shared layers' MLPs are twice as wide."""
    ff = _required(header, "feed_forward_length")
    if not isinstance(ff, list) or len(set(ff)) == 1:
        return (ff[0] if isinstance(ff, list) else ff), False
    base = ff[0]
    if m < len(ff) and ff == [base] * m + [2 * base] * (len(ff) - m):
        return base, True
    raise UnsupportedModelError(
        f"{header.path.name}: gemma4.feed_forward_length {sorted(set(ff))} per layer is neither uniform "
        "nor doubled on the KV-shared layers; not supported"
    )


def _kv_heads(header: GGUFHeader, types: list[str], m: int) -> dict[str, Any]:
    """KV heads of sliding and full layers; K = V where full layers lack attn_v."""
    name = header.path.name
    kv = header.arch_key("attention.head_count_kv", _uniform(header, "attention.head_count"))
    kv = kv if isinstance(kv, list) else [kv] * len(types)
    by_type = {t: {k for k, tt in zip(kv, types) if tt == t} for t in set(types)}
    if any(len(v) != 1 for v in by_type.values()):
        raise UnsupportedModelError(f"{name}: gemma4 KV heads vary among layers of one type; not supported")
    has_v = {types[i]: f"blk.{i}.attn_v.weight" in header.tensors for i in range(m)}
    for i in range(m):
        if (f"blk.{i}.attn_v.weight" in header.tensors) != has_v[types[i]]:
            raise UnsupportedModelError(f"{name}: only some {types[i]} layers have attn_v; not supported")
    k_eq_v = has_v.get("full_attention", True) is False
    if has_v.get("sliding_attention", True) is False:
        raise UnsupportedModelError(f"{name}: sliding layers without attn_v are not supported")
    swa = next(iter(by_type.get("sliding_attention", by_type.get("full_attention"))))
    full = next(iter(by_type.get("full_attention", {swa})))
    if full != swa and not k_eq_v:
        raise UnsupportedModelError(
            f"{name}: full layers with their own KV head count ({full}) and an attn_v are not supported"
        )
    return {"num_key_value_heads": swa, "num_global_key_value_heads": full, "attention_k_eq_v": k_eq_v}


def _experts(header: GGUFHeader, n: int) -> dict[str, Any]:
    get, name = header.arch_key, header.path.name
    count = get("expert_count") or 0
    routed = [f"blk.{i}.ffn_gate_inp.weight" in header.tensors for i in range(n)]
    if not count and not any(routed):
        return {"enable_moe_block": False}
    if not count or not all(routed):
        raise UnsupportedModelError(
            f"{name}: experts on only some layers (or no expert_count); not supported"
        )
    return {
        "enable_moe_block": True,
        "num_experts": count,
        "top_k_experts": _uniform(header, "expert_used_count"),
        "moe_intermediate_size": _uniform(header, "expert_feed_forward_length"),
    }


def _rope(header: GGUFHeader) -> dict[str, Any]:
    """Sliding layers rotate every pair (base ``freq_base_swa``); full layers'
    rotated pairs come from ``rope_freqs`` after loading (``apply_rope_freqs``)."""
    get = header.arch_key
    full: dict[str, Any] = {"rope_type": "proportional", "rope_theta": get("rope.freq_base", 10000.0)}
    kind = get("rope.scaling.type")
    if kind == "linear":
        full["factor"] = float(get("rope.scaling.factor", 1.0))  # full layers only, as in llama.cpp
    elif kind not in (None, "none"):
        raise UnsupportedModelError(
            f"{header.path.name}: GGUF rope scaling {kind!r} is not supported for gemma4"
        )
    if "rope_freqs.weight" not in header.tensors and "full_attention" in _types(header):
        raise ModelLoadError(f"{header.path.name}: a gemma4 file with full layers needs rope_freqs.weight")
    return {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default", "rope_theta": get("rope.freq_base_swa", 10000.0)},
    }


def _types(header: GGUFHeader) -> set[str]:
    flags = header.arch_key("attention.sliding_window_pattern") or []
    return {"sliding_attention" if s else "full_attention" for s in flags}


def rotated_fraction(factors: mx.array, head_dim: int) -> float:
    """mlx-lm's ``partial_rotary_factor`` when ``rope_freqs`` is ones then huge values, else 1."""
    ones = int((factors == 1.0).sum().item())
    plain = (
        ones > 0 and bool(mx.all(factors[:ones] == 1.0).item()) and bool(mx.all(factors[ones:] > 1e6).item())
    )
    return 2 * ones / head_dim if plain else 1.0


def set_full_rope(model: Any, factors: mx.array, cfg: dict[str, Any]) -> None:
    """Full layers' rope as llama.cpp computes it: each pair's frequency divided
    by its ``rope_freqs`` factor (and a linear scaling factor)."""
    hd = cfg["global_head_dim"]
    full = cfg["rope_parameters"]["full_attention"]
    freqs = full["rope_theta"] ** (mx.arange(0, hd, 2, dtype=mx.float32) / hd)
    freqs = freqs * factors.astype(mx.float32) * full.get("factor", 1.0)
    for layer in model.layers:
        if layer.self_attn.layer_type == "full_attention":
            layer.self_attn.rope._freqs = freqs
