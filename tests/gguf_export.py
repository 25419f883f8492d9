"""Tiny random mlx-lm models written to GGUF the way llama.cpp's
convert_hf_to_gguf lays them out, with the ``gguf`` package's GGUFWriter.

What the converter does and the loader must undo: llama-family attn_q/attn_k
rows permuted per head; Gemma norm weights stored as 1 + w; Llama 3 rope
scaling stored as a ``rope_freqs`` tensor; a tied head written as no
``output.weight``; 1-D tensors kept F32.
"""

from __future__ import annotations

import math

import gguf
import kquants
import mlx.core as mx
import numpy as np
from gguf_vocab import spm_metadata, write_vocab
from mlx.utils import tree_flatten
from models import tiny_model

Q = gguf.GGMLQuantizationType
VOCAB = 400  # the trained SentencePiece vocabulary's size
#: llama.cpp's quantizer's type for rows a K-quant block does not divide.
K_FALLBACK = {"Q4_K": Q.Q5_0, "Q5_K": Q.Q5_1, "Q6_K": Q.Q8_0}


def fitting(kind, cols: int):
    """The type llama.cpp's quantizer stores rows of ``cols`` values as: a
    K-quant's fallback where 256 does not divide them, F16 where 32 does not."""
    if kind.name in K_FALLBACK and cols % 256:
        kind = K_FALLBACK[kind.name]
    if kind not in (Q.F32, Q.F16) and cols % 32:
        kind = Q.F16
    return kind


_BASE = dict(
    hidden_size=64,
    num_hidden_layers=4,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=VOCAB,
    rope_theta=10000.0,
    max_position_embeddings=4096,
)
_GEMMA = dict(_BASE, num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6)

#: name -> (GGUF architecture, mlx-lm config)
EXPORTS = {
    "llama": ("llama", dict(_BASE, model_type="llama", tie_word_embeddings=True)),
    "llama3-rope": (
        "llama",
        dict(
            _BASE,
            model_type="llama",
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    # Mistral checkpoints convert to the llama architecture; head_dim set apart from hidden/heads.
    "mistral": ("llama", dict(_BASE, model_type="llama", head_dim=32, tie_word_embeddings=False)),
    # rows of 256 and 512 values: wide enough for K-quant blocks
    "llama-wide": (
        "llama",
        dict(
            _BASE,
            model_type="llama",
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            tie_word_embeddings=False,
        ),
    ),  # fmt: skip
    "qwen2": ("qwen2", dict(_BASE, model_type="qwen2", tie_word_embeddings=False)),
    "qwen3": ("qwen3", dict(_BASE, model_type="qwen3", head_dim=16, tie_word_embeddings=True)),
    "phi3": ("phi3", dict(_BASE, model_type="phi3", tie_word_embeddings=False)),
    # mixture-of-experts: 4 experts, 2 a token (Qwen3-30B-A3B's and Mixtral's layouts)
    "qwen3moe": (
        "qwen3moe",
        dict(
            _BASE,
            model_type="qwen3_moe",
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3moe-wide": (  # rows of 256 values: wide enough for K-quant blocks
        "qwen3moe",
        dict(
            _BASE,
            model_type="qwen3_moe",
            hidden_size=256,
            num_hidden_layers=2,
            head_dim=64,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=256,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
    "mixtral": (
        "llama",
        dict(
            _BASE,
            model_type="mixtral",
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
    ),
    "gemma2": (
        "gemma2",
        dict(
            _GEMMA,
            model_type="gemma2",
            query_pre_attn_scalar=32,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
    ),
    "gemma3": (
        "gemma3",
        dict(
            _GEMMA,
            model_type="gemma3_text",
            num_hidden_layers=6,
            sliding_window=8,
            sliding_window_pattern=6,
            query_pre_attn_scalar=32,
            rope_local_base_freq=10000.0,
            rope_theta=1000000.0,
        ),
    ),
    "gemma3-linear-rope": (
        "gemma3",
        dict(
            _GEMMA,
            model_type="gemma3_text",
            num_hidden_layers=6,
            sliding_window=8,
            sliding_window_pattern=3,
            query_pre_attn_scalar=32,
            rope_local_base_freq=10000.0,
            rope_theta=1000000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        ),
    ),
}

_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
    "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "block_sparse_moe.switch_mlp.gate_proj": "ffn_gate_exps",
    "block_sparse_moe.switch_mlp.up_proj": "ffn_up_exps",
    "block_sparse_moe.switch_mlp.down_proj": "ffn_down_exps",
}
_LLAMA_NORMS = {"post_attention_layernorm": "ffn_norm"}
_GEMMA_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_tensor_name(name: str, arch: str) -> str:
    if name.startswith("model.embed_tokens."):
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = name.split(".", 3)
    layer, kind = rest.rsplit(".", 1)
    table = {**_LAYER, **(_GEMMA_NORMS if arch.startswith("gemma") else _LLAMA_NORMS)}
    return f"blk.{i}.{table[layer]}.{kind}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: interleave each head's rotary halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg: dict) -> np.ndarray:
    """The converter's rope_freqs for llama3 scaling: one divisor per rotary frequency."""
    s = cfg["rope_scaling"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * cfg["rope_theta"] ** (i / dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, np.float32)


def _stored(a: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray, object]:
    """(what the file holds as floats, the data to write, its raw type or None)."""
    if a.ndim < 2 or qtype == Q.F32:
        return a, a, None
    if qtype == Q.F16:
        h = a.astype(np.float16)
        return h.astype(np.float32), h, None
    if qtype.name in kquants.ENCODERS:
        q = kquants.quantize(a, qtype.name)
    else:
        q = gguf.quants.quantize(a, qtype)
    return gguf.quants.dequantize(q, qtype), q, qtype


def export(
    path,
    name: str,
    qtype=Q.F32,
    seed: int = 0,
    tied: bool | None = None,
    vocab: dict | None = None,
    as_floats: bool = False,
    split_tensors: int = 0,
    **overrides,
):
    """Write EXPORTS[name] to ``path`` (``vocab``: tokenizer metadata, by
    default a trained SentencePiece one; ``overrides``: config fields);
    returns the source model with its weights set to exactly what the file
    holds (quantization round trip). ``qtype``: one type for every matrix, or
    a function of the mlx-lm name, stored as llama.cpp's quantizer would
    (``fitting``).
    ``as_floats``: write, as F32, the values ``qtype`` would hold.
    ``split_tensors``: write a split GGUF of at most this many tensors per
    part (``path``'s stem + ``-0000i-of-0000n.gguf``, as llama.cpp's
    gguf-split names them). Gemma 4
    layouts (``gemma4-*``) are written by ``gguf_export_gemma4``."""
    if name.startswith("gemma4"):
        from gguf_export_gemma4 import export_gemma4

        return export_gemma4(path, name, qtype, seed=seed, as_floats=as_floats, **overrides)
    arch, cfg = EXPORTS[name]
    cfg = dict(cfg, **overrides)
    if tied is not None:
        cfg["tie_word_embeddings"] = tied
    model = tiny_model(cfg, seed)
    if arch == "gemma3" and cfg.get("tie_word_embeddings", True):
        model.sanitize({})  # gemma3_text: no lm_head.weight means a tied head
    params = dict(tree_flatten(model.parameters()))
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_tensors)
    _write_config(w, arch, cfg)
    write_vocab(w, vocab or spm_metadata(space_prefix=not arch.startswith("gemma")))
    held = []
    for pname, value in params.items():
        a = np.array(value, dtype=np.float32)
        if a.ndim == 1:  # norms and biases: random too, so their layouts matter
            a = a + rng.normal(0, 0.2, a.shape).astype(np.float32)
        kind = fitting(qtype(pname) if callable(qtype) else qtype, a.shape[-1])
        floats, data, raw = _stored(a, kind)
        if as_floats:
            data, raw = floats, None
        held.append((pname, mx.array(floats)))
        leaf = pname.rsplit(".", 2)[-2]
        if arch == "llama" and leaf in ("q_proj", "k_proj"):
            heads = cfg["num_attention_heads"] if leaf == "q_proj" else cfg["num_key_value_heads"]
            permuted, data, raw = _stored(permute(a, heads), kind)  # quantization is row-wise
            if as_floats:
                data, raw = permuted, None
        if arch.startswith("gemma") and leaf.endswith("norm"):
            data = data + np.float32(1.0)
        w.add_tensor(gguf_tensor_name(pname, arch), data, raw_dtype=raw)
    if "rope_scaling" in cfg and cfg["rope_scaling"]["rope_type"] == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    model.load_weights(held)
    mx.eval(model.parameters())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def _write_config(w, arch: str, cfg: dict) -> None:
    heads = cfg["num_attention_heads"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if "head_dim" in cfg:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    scaling = cfg.get("rope_scaling")
    if scaling and scaling["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
        pattern = cfg["sliding_window_pattern"]
        if pattern != 6:  # llama.cpp assumes 6; others are written per layer (true: sliding)
            w.add_sliding_window_pattern([(i + 1) % pattern != 0 for i in range(cfg["num_hidden_layers"])])
