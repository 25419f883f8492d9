"""GGUF architectures mapped onto mlx-lm models: config from metadata, tensor
names, and the layouts llama.cpp's converter changes.

Undone here: llama-family attn_q/attn_k rows permuted per head (interleaved
rotary halves), Gemma norm weights stored as 1 + w, and Llama 3 rope scaling
stored as the ``rope_freqs`` tensor (per-frequency divisors).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..errors import ModelLoadError, UnsupportedModelError
from . import gguf_gemma4
from .gguf_file import GGUFHeader

_COMMON = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PRE_MLP_NORM = {"ffn_norm": "post_attention_layernorm"}
_PHI3 = {  # fused q/k/v rows and fused [gate; up] rows, as in the checkpoint
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    **_PRE_MLP_NORM,
}
_DENSE_MLP = ("ffn_gate", "ffn_up", "ffn_down")


def _experts(prefix: str) -> dict[str, str]:
    """Mixture-of-experts tensors: the router and the experts stacked (E, out, in)."""
    return {
        "ffn_gate_inp": f"{prefix}.gate",
        "ffn_gate_exps": f"{prefix}.switch_mlp.gate_proj",
        "ffn_up_exps": f"{prefix}.switch_mlp.up_proj",
        "ffn_down_exps": f"{prefix}.switch_mlp.down_proj",
    }


_ATTENTION = {k: v for k, v in _COMMON.items() if k not in _DENSE_MLP}
#: Tensors that carry no weights of their own in mlx-lm (handled in the config).
_CONFIG_TENSORS = ("rope_freqs.weight",)


@dataclass(frozen=True)
class ArchSpec:
    """How one GGUF architecture maps onto an mlx-lm model."""

    model_type: str
    layer_names: dict[str, str]
    permuted_qk: bool = False  # llama.cpp interleaved the rotary halves of q/k rows
    norm_plus_one: bool = False  # norm weights are stored as 1 + w
    scaled_query_layers: int | None = None  # block count of the one size scaled by hidden/heads
    experts_key: str | None = None  # mlx-lm's name for the expert count (mixture-of-experts)
    extra: dict[str, Any] = field(default_factory=dict)
    global_names: dict[str, str] = field(default_factory=dict)  # tensors outside the layers
    fused: dict[str, tuple[str, str]] = field(default_factory=dict)  # a layer -> its halves (rows)
    config: Callable[[GGUFHeader], dict[str, Any]] | None = None  # the whole config, if not generic
    unused: Callable[[dict[str, Any], str], bool] | None = None  # carried tensors the model has no use for


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", {**_COMMON, **_PRE_MLP_NORM}, permuted_qk=True),
    "qwen2": ArchSpec("qwen2", {**_COMMON, **_PRE_MLP_NORM}),
    "qwen3": ArchSpec("qwen3", {**_COMMON, **_PRE_MLP_NORM, **_QK_NORM}),
    "qwen3moe": ArchSpec(
        "qwen3_moe",
        {**_ATTENTION, **_PRE_MLP_NORM, **_QK_NORM, **_experts("mlp")},
        experts_key="num_experts",
        extra={"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
    ),
    "phi3": ArchSpec("phi3", _PHI3),
    "gemma2": ArchSpec("gemma2", {**_COMMON, **_GEMMA_NORMS}, norm_plus_one=True, scaled_query_layers=46),
    "gemma3": ArchSpec(
        "gemma3_text",
        {**_COMMON, **_GEMMA_NORMS, **_QK_NORM},
        norm_plus_one=True,
        scaled_query_layers=62,
        extra={"rope_local_base_freq": 10000.0},
    ),
    "gemma4": ArchSpec(
        "gemma4_text",
        gguf_gemma4.LAYER_NAMES,
        global_names=gguf_gemma4.GLOBAL_NAMES,
        fused=gguf_gemma4.FUSED,
        config=gguf_gemma4.gemma4_config,
        unused=gguf_gemma4.unused,
    ),
}
#: Mixtral files are ``llama`` files whose layers hold experts.
MIXTRAL = ArchSpec(
    "mixtral",
    {**_ATTENTION, **_PRE_MLP_NORM, **_experts("block_sparse_moe")},
    permuted_qk=True,
    experts_key="num_local_experts",
)
SUPPORTED = tuple(ARCHS)
REQUIRED_KEYS = ("block_count", "embedding_length", "attention.head_count")
DENSE_KEYS = ("feed_forward_length",)
EXPERT_KEYS = ("expert_count", "expert_used_count")


def arch_spec(header: GGUFHeader) -> ArchSpec:
    arch = header.architecture
    if arch not in ARCHS:
        raise UnsupportedModelError(
            f"{header.path.name}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED)})"
        )
    spec = ARCHS[arch]
    if arch == "llama" and "blk.0.ffn_gate_inp.weight" in header.tensors:
        spec = MIXTRAL
    keys = REQUIRED_KEYS + (EXPERT_KEYS if spec.experts_key else () if spec.config else DENSE_KEYS)
    missing = [k for k in keys if header.arch_key(k) is None]
    if missing:
        raise ModelLoadError(
            f"{header.path.name}: GGUF metadata lacks {', '.join(f'{arch}.{k}' for k in missing)}"
        )
    return spec


def gguf_config(header: GGUFHeader) -> dict[str, Any]:
    """The mlx-lm config dict for this file (from metadata and the tensor directory)."""
    spec = arch_spec(header)
    if spec.config is not None:
        return spec.config(header)
    get = header.arch_key
    name = header.path.name
    hidden, n_layers = get("embedding_length"), get("block_count")
    heads = _per_layer(get("attention.head_count"), "attention.head_count", name)
    head_dim = get("attention.key_length") or hidden // heads
    tokens = header.metadata.get("tokenizer.ggml.tokens") or []
    embed = header.tensors.get("token_embd.weight")
    cfg: dict[str, Any] = {
        "model_type": spec.model_type,
        "num_hidden_layers": n_layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": _per_layer(
            get("attention.head_count_kv", heads), "attention.head_count_kv", name
        ),
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "vocab_size": get("vocab_size") or (embed.shape[0] if embed else len(tokens)),
        "max_position_embeddings": get("context_length", 4096),
        "rope_theta": get("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in header.tensors,
        **spec.extra,
        **_ffn_sizes(header, spec),
    }
    rope_dims = get("rope.dimension_count")
    if rope_dims is not None and rope_dims != head_dim:
        raise UnsupportedModelError(
            f"{name}: partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported"
        )
    if spec.scaled_query_layers is not None:
        big = n_layers == spec.scaled_query_layers  # llama.cpp scales that one size by hidden/heads
        cfg["query_pre_attn_scalar"] = hidden // heads if big else head_dim
    if spec.model_type == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in header.tensors
        cfg["mlp_bias"] = "blk.0.ffn_up.bias" in header.tensors
    if spec.model_type == "gemma2":
        cfg["attn_logit_softcapping"] = get("attn_logit_softcapping", 50.0)
        cfg["final_logit_softcapping"] = get("final_logit_softcapping", 30.0)
    if spec.model_type == "gemma3_text":
        cfg["sliding_window"] = get("attention.sliding_window", 512)
        cfg["sliding_window_pattern"] = _sliding_pattern(
            get("attention.sliding_window_pattern", 6), n_layers, name
        )
    scaling = _rope_scaling(header, spec)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    return cfg


def _ffn_sizes(header: GGUFHeader, spec: ArchSpec) -> dict[str, Any]:
    """MLP width, or the experts' count, top-k and width (llama.cpp's defaults:
    qwen3moe's expert width n_ff / top-k, a llama file's experts n_ff wide)."""
    get, name = header.arch_key, header.path.name
    ff = get("feed_forward_length")
    ff = None if ff is None else _per_layer(ff, "feed_forward_length", name)
    if spec.experts_key is None:
        return {"intermediate_size": ff}
    experts, used = get("expert_count"), get("expert_used_count")
    width = get("expert_feed_forward_length")
    if width is None:
        width = ff if spec.model_type == "mixtral" or ff is None else ff // used
    width = _per_layer(width, "expert_feed_forward_length", name)
    out = {spec.experts_key: experts, "num_experts_per_tok": used, "intermediate_size": ff or width}
    if spec.model_type == "mixtral":
        out["intermediate_size"] = width
    else:
        out["moe_intermediate_size"] = width
    return out


def _per_layer(value: Any, key: str, file: str) -> int:
    """Per-layer lists (as some GGUFs write) must be uniform for mlx-lm's models."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedModelError(
                f"{file}: GGUF {key} varies per layer ({sorted(set(value))}); not supported"
            )
        return value[0]
    return value


def _sliding_pattern(value: Any, n_layers: int, file: str) -> int:
    """mlx-lm's period (every n-th layer global) from an int or per-layer flags (true: sliding)."""
    if not isinstance(value, list):
        return int(value)
    period = value.index(False) + 1 if False in value else n_layers + 1
    if value != [(i + 1) % period != 0 for i in range(len(value))]:
        raise UnsupportedModelError(
            f"{file}: GGUF sliding-window layer pattern {value} is not periodic; not supported"
        )
    return period


def _rope_scaling(header: GGUFHeader, spec: ArchSpec) -> dict[str, Any] | None:
    kind = header.arch_key("rope.scaling.type")
    if "rope_freqs.weight" in header.tensors:
        if spec.model_type != "llama":
            raise UnsupportedModelError(
                f"{header.path.name}: rope_freqs in a {spec.model_type} GGUF is not supported"
            )
        # Factors come from the tensor after loading (see apply_rope_freqs).
        return {"rope_type": "llama3", "factor": 1.0}
    if kind in (None, "none"):
        return None
    if kind == "linear" and spec.model_type not in (
        "phi3",
        "mixtral",
        "qwen3_moe",
    ):  # their rope has no scaling
        return {"rope_type": "linear", "factor": float(header.arch_key("rope.scaling.factor", 1.0))}
    raise UnsupportedModelError(
        f"{header.path.name}: GGUF rope scaling {kind!r} is not supported (only linear and llama3)"
    )


def mlx_name(gguf_name: str, spec: ArchSpec) -> str | None:
    """The mlx-lm parameter name of a GGUF tensor (``.scales``/``.biases`` kept)."""
    base, _, kind = gguf_name.rpartition(".")
    if base == "token_embd":
        return f"model.embed_tokens.{kind}"
    if base == "output_norm":
        return f"model.norm.{kind}"
    if base == "output":
        return f"lm_head.{kind}"
    if base in spec.global_names:
        return f"{spec.global_names[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and f"{parts[2]}.{kind}" in spec.layer_names:
        return f"model.layers.{parts[1]}.{spec.layer_names[f'{parts[2]}.{kind}']}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in spec.layer_names:
        return f"model.layers.{parts[1]}.{spec.layer_names[parts[2]]}.{kind}"
    return None


def used(name: str, cfg: dict[str, Any], spec: ArchSpec) -> bool:
    """Whether a tensor holds weights the model uses (not rope_freqs, not a carried unused one)."""
    return name not in _CONFIG_TENSORS and not (spec.unused and spec.unused(cfg, name))


def check_tensor_names(header: GGUFHeader, spec: ArchSpec, cfg: dict[str, Any]) -> None:
    """Every tensor must have a place in the model (before any is read)."""
    for name in header.tensors:
        if used(name, cfg, spec) and mlx_name(name, spec) is None:
            raise UnsupportedModelError(
                f"{header.path.name}: tensor {name!r} has no place in mlx-lm's {spec.model_type} model "
                "(multimodal GGUFs and layouts other than the mapped ones are not supported)"
            )


def unpermute(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's per-head interleaving of the rotary halves (rows)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_weights(
    tensors: dict[str, mx.array], cfg: dict[str, Any], spec: ArchSpec
) -> tuple[dict[str, mx.array], dict[str, int]]:
    """mlx-lm weight names and layouts; also the bits of each quantized layer."""
    out: dict[str, mx.array] = {}
    bits: dict[str, int] = {}
    for name, value in tensors.items():
        mname = mlx_name(name, spec)
        if mname is None or not used(name, cfg, spec):
            continue  # rope_freqs: applied by apply_rope_freqs
        layer, _, kind = mname.rpartition(".")
        leaf = layer.rsplit(".", 1)[-1]
        if spec.permuted_qk and leaf in ("q_proj", "k_proj"):
            heads = cfg["num_attention_heads"] if leaf == "q_proj" else cfg["num_key_value_heads"]
            value = unpermute(value, heads)
        if spec.norm_plus_one and leaf.endswith("norm") and kind == "weight":
            value = value.astype(mx.float32) - 1.0
        if kind == "scales":
            bits[layer] = tensors[name.replace(".scales", ".weight")].shape[-1] // value.shape[-1]
        out[mname] = value
    return _split_fused(out, bits, spec)


def _split_fused(
    weights: dict[str, mx.array], bits: dict[str, int], spec: ArchSpec
) -> tuple[dict[str, mx.array], dict[str, int]]:
    """Fused layers (e.g. experts' gate and up) as their two halves along the rows."""
    for name in [n for n in weights if any(f".{f}." in n for f in spec.fused)]:
        layer, _, kind = name.rpartition(".")
        prefix, fused = next((layer[: -len(f)], f) for f in spec.fused if layer.endswith(f))
        value = weights.pop(name)
        for half, part in zip(spec.fused[fused], mx.split(value, 2, axis=-2)):
            weights[f"{prefix}{half}.{kind}"] = mx.contiguous(part)
            if layer in bits:
                bits[f"{prefix}{half}"] = bits[layer]
    for layer in [n for n in bits if any(n.endswith(f) for f in spec.fused)]:
        del bits[layer]
    return weights, bits


def rope_config(cfg: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, Any]:
    """The config with what ``rope_freqs`` says about rotated dimensions (Gemma 4)."""
    factors = tensors.get("rope_freqs.weight")
    if cfg["model_type"] != "gemma4_text" or factors is None:
        return cfg
    full = dict(cfg["rope_parameters"]["full_attention"])
    full["partial_rotary_factor"] = gguf_gemma4.rotated_fraction(factors, cfg["global_head_dim"])
    return {**cfg, "rope_parameters": {**cfg["rope_parameters"], "full_attention": full}}


def apply_rope_freqs(model: Any, tensors: dict[str, mx.array], cfg: dict[str, Any]) -> None:
    """Llama 3 rope scaling from the file's ``rope_freqs`` (llama.cpp divides
    each rotary frequency by its factor; mlx-lm's ``_freqs`` are inverse
    frequencies, so they are multiplied)."""
    factors = tensors.get("rope_freqs.weight")
    if factors is None:
        return
    if cfg["model_type"] == "gemma4_text":
        gguf_gemma4.set_full_rope(model, factors, cfg)
        return
    dims = cfg["head_dim"]
    freqs = cfg["rope_theta"] ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims) * factors.astype(mx.float32)
    for layer in model.model.layers:
        layer.self_attn.rope._freqs = freqs
