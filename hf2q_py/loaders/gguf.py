"""GGUF files (llama.cpp) as mlx-lm models: llama-family, qwen2 and gemma3.

Q4_0/Q4_1/Q8_0 tensors come from ``mx.load`` as MLX affine 4/8-bit triples
(group 32); files with other types (K-quants, Q5_0, ...) are read with the
``gguf`` package and dequantized in numpy. Two llama.cpp conventions are
undone: llama-family attn_q/attn_k rows are permuted per head (interleaved
rotary halves), and Gemma norm weights are stored as 1 + w.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import ModelLoadError, UnsupportedModelError, one_line
from ..target import Target
from .convert import to_dtype

SUPPORTED = ("llama", "qwen2", "gemma3")
GROUP = 32

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_NORM_NAMES = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "qwen2": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}


# ---------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    if isinstance(value, np.ndarray):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


#: Tensor types that ``mx.load`` reads correctly. It also *accepts* some
#: K-quant files but returns wrong values for them, so the types are checked
#: first and anything else goes through the gguf package's dequantizer.
MX_LOAD_TYPES = {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Tensors (quantized ones as weight/scales/biases) and plain metadata."""
    try:
        from gguf import GGUFReader

        types = {t.tensor_type.name for t in GGUFReader(str(path)).tensors}
    except Exception as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e
    if types <= MX_LOAD_TYPES:
        try:
            tensors, meta = mx.load(str(path), return_metadata=True)
            return tensors, {k: _plain(v) for k, v in meta.items()}
        except Exception as e:
            raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e
    try:
        return _read_with_gguf_package(path)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot dequantize its tensors ({e})") from e


def _read_with_gguf_package(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    meta = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        meta[name] = _plain(field.contents())
    tensors = {}
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = mx.array(data.reshape(shape))
    return tensors, meta


# ---------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------
def gguf_config(meta: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED)})"
        )

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    n_layers = get("block_count")
    hidden = get("embedding_length")
    heads = get("attention.head_count")
    if None in (n_layers, hidden, heads):
        raise ModelLoadError("GGUF metadata lacks block_count/embedding_length/head_count")
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", [])) or _rows(tensors, "token_embd")
    head_dim = get("attention.key_length") or hidden // heads
    cfg: dict[str, Any] = {
        "num_hidden_layers": n_layers,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "vocab_size": vocab,
        "max_position_embeddings": get("context_length", 4096),
        "rope_theta": get("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if arch == "llama":
        cfg["model_type"] = "llama"
    elif arch == "qwen2":
        cfg["model_type"] = "qwen2"
    elif arch == "gemma3":
        cfg.update(
            model_type="gemma3_text",
            sliding_window=get("attention.sliding_window", 512),
            sliding_window_pattern=get("attention.sliding_window_pattern", 6),
            query_pre_attn_scalar=head_dim,
            rope_local_base_freq=10000.0,
            rope_global_base_freq=cfg["rope_theta"],
        )
    return cfg


def _rows(tensors: dict[str, mx.array], name: str) -> int:
    return tensors[f"{name}.weight"].shape[0]


# ---------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------
def _mlx_name(gguf_name: str, arch: str) -> str | None:
    base, _, kind = gguf_name.rpartition(".")
    if base == "token_embd":
        return f"model.embed_tokens.{kind}"
    if base == "output_norm":
        return f"model.norm.{kind}"
    if base == "output":
        return f"lm_head.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk":
        name = _LAYER_NAMES.get(parts[2]) or _NORM_NAMES[arch].get(parts[2])
        if name:
            return f"model.layers.{parts[1]}.{name}.{kind}"
    return None


def _unpermute(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's per-head interleaving of the rotary halves (rows)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def convert_weights(
    tensors: dict[str, mx.array], cfg: dict[str, Any], arch: str, unpermute: bool = True
) -> tuple[dict[str, mx.array], dict[str, int]]:
    """mlx-lm weight names and layouts; also the bits of each quantized layer.
    ``unpermute=False`` keeps llama.cpp's q/k row order (for checking it)."""
    out: dict[str, mx.array] = {}
    bits: dict[str, int] = {}
    for name, value in tensors.items():
        mname = _mlx_name(name, arch)
        if mname is None:
            continue  # e.g. rope_freqs: recomputed by the model
        layer = mname.rsplit(".", 1)[0]
        if unpermute and arch == "llama" and (".q_proj." in mname or ".k_proj." in mname):
            heads = cfg["num_attention_heads"] if ".q_proj." in mname else cfg["num_key_value_heads"]
            value = _unpermute(value, heads)
        if arch == "gemma3" and "norm" in layer.rsplit(".", 1)[-1] and mname.endswith(".weight"):
            value = value.astype(mx.float32) - 1.0
        if mname.endswith(".scales"):
            bits[layer] = tensors[name.replace(".scales", ".weight")].shape[1] // value.shape[1]
        out[mname] = value
    return out, bits


def _build(cfg: dict[str, Any], weights: dict[str, mx.array], bits: dict[str, int]):
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    if bits:
        nn.quantize(
            model,
            class_predicate=lambda p, m: {"group_size": GROUP, "bits": bits[p]} if p in bits else False,
        )
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"GGUF tensors do not fit the {cfg['model_type']} model: {one_line(e)}") from e
    return model


def _dequantize_all(
    weights: dict[str, mx.array], bits: dict[str, int], dtype: mx.Dtype
) -> dict[str, mx.array]:
    out = {}
    for name, value in weights.items():
        layer, _, kind = name.rpartition(".")
        if layer in bits and kind in ("scales", "biases"):
            continue
        if layer in bits and kind == "weight":
            value = mx.dequantize(
                value,
                weights[f"{layer}.scales"].astype(mx.float32),
                weights[f"{layer}.biases"].astype(mx.float32),
                group_size=GROUP,
                bits=bits[layer],
            )
        out[name] = value.astype(dtype)
    return out


def load_gguf(path: Path, dtype: mx.Dtype | None) -> Target:
    """Load a GGUF file; ``dtype`` None keeps 4/8-bit weights quantized."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file")
    tensors, meta = read_gguf(path)
    arch = meta.get("general.architecture")
    cfg = gguf_config(meta, tensors)
    weights, bits = convert_weights(tensors, cfg, arch)
    if dtype is not None or not bits:
        weights = _dequantize_all(weights, bits, dtype or mx.float16)
        bits = {}
    elif mx.default_device() == mx.cpu:
        # MLX's CPU quantized matmul is ~30x slower with float16 scales.
        weights = {n: v.astype(mx.float32) if v.dtype == mx.float16 else v for n, v in weights.items()}
    model = _build(cfg, weights, bits)
    mx.eval(model.parameters())
    from .gguf_tokenizer import tokenizer_from_gguf

    tokenizer = tokenizer_from_gguf(meta)
    return Target(to_dtype(model, dtype), tokenizer, source=str(path))
