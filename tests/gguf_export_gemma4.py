"""Tiny random Gemma 4 text models written to GGUF as llama.cpp's converter
(``conversion/gemma.py``, ``Gemma4Model``) writes them, in its three layouts.

What that converter does: norms stored as they are (no 1 + w); the sliding
and full layers' head sizes as ``key_length_swa`` and ``key_length``; KV heads
and MLP widths per layer where they vary (``head_count_kv``,
``feed_forward_length`` arrays); the full layers' partial rope as one
``rope_freqs`` tensor (1 for rotated pairs, 1e30 for the rest); layer types as
a per-layer flag array (true: sliding); expert gate and up fused
(``ffn_gate_up_exps``, gate first); the router's input scale and the experts'
output scales as ``.scale`` tensors; a ``gemma4`` vocabulary with BPE merges.
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
from gguf_export import Q, VOCAB, _stored, fitting
from gguf_vocab import gemma4_metadata, write_vocab
from mlx.utils import tree_flatten
from models import tiny_model

_ROPE = {
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
_BASE = dict(
    model_type="gemma4_text",
    hidden_size=64,
    intermediate_size=64,
    num_attention_heads=2,
    head_dim=16,
    global_head_dim=32,
    vocab_size=VOCAB,
    vocab_size_per_layer_input=VOCAB,
    sliding_window=8,
    rms_norm_eps=1e-6,
    final_logit_softcapping=30.0,
    rope_parameters=_ROPE,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
_SWA3 = ["sliding_attention", "sliding_attention", "full_attention"] * 2
_SWA4 = ["sliding_attention"] * 3 + ["full_attention"]
#: The three layouts: 31B-like (K = V on full layers, their own KV head count),
#: E2B/E4B-like (per-layer inputs, the last layers sharing KV, double-wide MLP
#: there) and 26B-A4B-like (experts beside the dense MLP, K = V).
GEMMA4_EXPORTS = {
    "gemma4-dense": dict(
        _BASE,
        num_hidden_layers=6,
        layer_types=_SWA3,
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        use_double_wide_mlp=False,
    ),
    "gemma4-small": dict(
        _BASE,
        num_hidden_layers=8,
        layer_types=_SWA4 * 2,
        num_key_value_heads=1,
        attention_k_eq_v=False,
        num_kv_shared_layers=4,
        hidden_size_per_layer_input=8,
        use_double_wide_mlp=True,
    ),
    "gemma4-moe": dict(
        _BASE,
        num_hidden_layers=6,
        layer_types=_SWA3,
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        use_double_wide_mlp=False,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
}

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "layer_scalar": "layer_output_scale.weight",
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.switch_glu.down_proj.weight": "ffn_down_exps.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
}
_GATE, _UP = "experts.switch_glu.gate_proj.weight", "experts.switch_glu.up_proj.weight"


def gguf_name(pname: str) -> str:
    if pname in _GLOBAL:
        return _GLOBAL[pname]
    _, _, i, rest = pname.split(".", 3)
    return f"blk.{i}.{_LAYER[rest]}"


def export_gemma4(path, name: str, qtype=Q.F32, seed: int = 0, as_floats: bool = False, **overrides):
    """Write GEMMA4_EXPORTS[name] (see ``gguf_export.export``); returns the
    source model holding exactly the file's values."""
    cfg = dict(GEMMA4_EXPORTS[name], **overrides)
    model = tiny_model(cfg, seed)
    params = dict(tree_flatten(model.parameters()))
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "gemma4")
    _write_config(w, cfg)
    write_vocab(w, gemma4_metadata())
    held = []

    def put(gname: str, a: np.ndarray) -> np.ndarray:
        kind = fitting(qtype(gname) if callable(qtype) else qtype, a.shape[-1])
        floats, data, raw = _stored(a, kind)
        w.add_tensor(gname, floats if as_floats else data, raw_dtype=None if as_floats else raw)
        return floats

    for pname, value in params.items():
        a = np.array(value, dtype=np.float32)
        if a.ndim == 1:  # norms and scales: random too, so their layouts matter
            a = a + rng.normal(0, 0.2, a.shape).astype(np.float32)
        if pname.endswith(_UP):
            continue  # written with the gate
        if pname.endswith(_GATE):
            up = np.array(params[pname.replace(_GATE, _UP)], dtype=np.float32)
            layer = pname.split(".")[2]
            fused = put(f"blk.{layer}.ffn_gate_up_exps.weight", np.concatenate([a, up], axis=-2))
            gate, upf = np.split(fused, 2, axis=-2)
            held += [(pname, mx.array(gate)), (pname.replace(_GATE, _UP), mx.array(upf))]
            continue
        held.append((pname, mx.array(put(gguf_name(pname), a))))
    w.add_tensor("rope_freqs.weight", rope_freqs(cfg))
    model.load_weights(held)
    mx.eval(model.parameters())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def rope_freqs(cfg: dict) -> np.ndarray:
    """The converter's partial rope of full layers: 1 for rotated pairs, 1e30 for the rest."""
    half = cfg["global_head_dim"] // 2
    rotated = int(
        cfg["global_head_dim"] * cfg["rope_parameters"]["full_attention"]["partial_rotary_factor"] / 2
    )
    return np.array([1.0] * rotated + [1e30] * (half - rotated), np.float32)


def _write_config(w, cfg: dict) -> None:
    n, types = cfg["num_hidden_layers"], cfg["layer_types"]
    sliding = [t == "sliding_attention" for t in types]
    shared = cfg["num_kv_shared_layers"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n)
    ff = cfg["intermediate_size"]
    if cfg["use_double_wide_mlp"] and shared:
        w.add_feed_forward_length([ff] * (n - shared) + [2 * ff] * shared)
    else:
        w.add_feed_forward_length(ff)
    w.add_head_count(cfg["num_attention_heads"])
    kv, kv_full = cfg["num_key_value_heads"], cfg.get("num_global_key_value_heads")
    w.add_head_count_kv([kv if s else kv_full for s in sliding] if kv_full else kv)
    w.add_key_length(cfg["global_head_dim"])
    w.add_value_length(cfg["global_head_dim"])
    w.add_key_length_swa(cfg["head_dim"])
    w.add_value_length_swa(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["global_head_dim"])
    w.add_rope_dimension_count_swa(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(cfg["rope_parameters"]["sliding_attention"]["rope_theta"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_sliding_window_pattern(sliding)
    w.add_shared_kv_layers(shared)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_embedding_length_per_layer_input(cfg["hidden_size_per_layer_input"])
    w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if cfg.get("enable_moe_block"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["top_k_experts"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
