"""Tiny random-weight models of mlx-lm's own architectures, for tests."""

from __future__ import annotations

import hf2q_py  # noqa: F401
import mlx.core as mx
from mlx.utils import tree_map

from hf2q_py.target import Target

VOCAB = 128

#: The shape most tiny models share: 4 layers of width 64, 4 heads over 2 KV heads.
_SMALL = dict(
    hidden_size=64,
    num_hidden_layers=4,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
)
#: Gemma 4's text model: 6 layers, sliding window 16 on two of every three.
_GEMMA4 = dict(
    model_type="gemma4_text",
    hidden_size=64,
    num_hidden_layers=6,
    intermediate_size=128,
    num_attention_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_key_value_heads=1,
    vocab_size=VOCAB,
    vocab_size_per_layer_input=VOCAB,
    sliding_window=16,
    sliding_window_pattern=3,
    rms_norm_eps=1e-6,
    final_logit_softcapping=30.0,
)
#: Gated-delta (linear attention) layers between full attention every second layer.
_GATED_DELTA = dict(
    head_dim=16,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    full_attention_interval=2,
)

CONFIGS = {
    "llama": dict(
        _SMALL, model_type="llama", rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True
    ),
    "qwen2": dict(
        _SMALL,
        model_type="qwen2",
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=6,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        sliding_window=16,
        sliding_window_pattern=3,
        query_pre_attn_scalar=32,
        rope_local_base_freq=10000.0,
        rope_global_base_freq=1000000.0,
    ),
    "gemma4_text": dict(_GEMMA4, num_kv_shared_layers=2, hidden_size_per_layer_input=8),
    "gemma4_text_moe": dict(
        _GEMMA4,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
    # hybrids: recurrent layers (gated delta, short conv, Mamba-2) between attention layers
    "qwen3_next": dict(
        _SMALL,
        **_GATED_DELTA,
        model_type="qwen3_next",
        num_experts=0,
        num_experts_per_tok=0,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=0,
        mlp_only_layers=[],
        moe_intermediate_size=0,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        max_position_embeddings=4096,
    ),
    "qwen3_5": dict(  # the multimodal wrapper, as Qwen3.5 checkpoints load
        model_type="qwen3_5",
        text_config=dict(
            _SMALL,
            **_GATED_DELTA,
            model_type="qwen3_5_text",
            tie_word_embeddings=False,
            rope_parameters=dict(
                type="default", mrope_section=[2, 1, 1], rope_theta=10000, partial_rotary_factor=0.5
            ),
        ),
    ),
    "lfm2": dict(
        model_type="lfm2",
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=64,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        block_ff_dim=128,
        full_attn_idxs=[1, 3],
    ),
    "nemotron_h": dict(  # Mamba-2 layers ("M"), attention ("*"), MLP ("-")
        model_type="nemotron_h",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=4096,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=False,
        mamba_num_heads=4,
        mamba_head_dim=16,
        mamba_proj_bias=False,
        ssm_state_size=16,
        conv_kernel=4,
        n_groups=1,
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
        hybrid_override_pattern=["M", "*", "M", "-"],
        head_dim=16,
        time_step_limit=(0.0, float("inf")),
    ),
    "gpt_oss": dict(  # attention sinks, sliding window 8 on every second layer, MoE
        model_type="gpt_oss",
        num_hidden_layers=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=VOCAB,
        rms_norm_eps=1e-5,
        hidden_size=64,
        intermediate_size=64,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
        rope_theta=10000,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
}
# multimodal wrappers as mlx-lm builds them: the text model under ``language_model``
CONFIGS["gemma4"] = dict(model_type="gemma4", text_config=dict(CONFIGS["gemma4_text"]), vocab_size=VOCAB)
CONFIGS["gemma3"] = dict(model_type="gemma3", text_config=dict(CONFIGS["gemma3_text"]), vocab_size=VOCAB)
CONFIGS["mistral3"] = dict(model_type="mistral3", text_config=dict(CONFIGS["llama"]))
CONFIGS["qwen2_vl"] = dict(model_type="qwen2_vl", text_config=dict(CONFIGS["qwen2"]))
CONFIGS["qwen3_vl"] = dict(
    model_type="qwen3_vl",
    text_config=dict(
        _SMALL,
        model_type="qwen3",
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]},
    ),
)

ARCHS = tuple(CONFIGS)
SLIDING = ("gemma3_text", "gemma4_text", "gemma4_text_moe", "gpt_oss")
HYBRIDS = ("qwen3_next", "qwen3_5", "lfm2", "nemotron_h")
WRAPPERS = ("gemma4", "gemma3", "mistral3", "qwen2_vl", "qwen3_vl", "qwen3_5")
#: (arch, scale) of the target/draft pairs the draft method's lossless checks run on.
PAIRS = [("llama", 2.0), ("qwen2", 1.5), ("gemma4_text", 1.5)]


def tiny_model(arch: str | dict, seed: int = 0, scale: float = 1.0, **overrides):
    """A float32 mlx-lm model with random weights (``scale`` sharpens logits);
    ``arch`` names one of CONFIGS or is a config dict; ``overrides`` change
    config fields (e.g. ``vocab_size``)."""
    from mlx_lm.utils import _get_classes

    cfg = {**(CONFIGS[arch] if isinstance(arch, str) else arch), **overrides}
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    params = model.parameters()
    keys = iter(mx.random.split(mx.random.key(seed), 10_000))

    def rnd(x):
        if x.ndim < 2:
            return x
        return mx.random.normal(x.shape, key=next(keys)) * (scale / x.shape[-1] ** 0.5)

    model.update(tree_map(rnd, params))
    for layer in model.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is not None and "sinks" in attn:  # gpt-oss: give the sinks weight
            attn.sinks = mx.random.normal(attn.sinks.shape, key=next(keys))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def tiny_target(
    arch: str = "llama", seed: int = 0, scale: float = 1.0, *, tokenizer: bool = False, **overrides
) -> Target:
    """A tiny random model; ``tokenizer=True`` adds ``char_tokenizer()``."""
    return Target.from_mlx_lm(
        tiny_model(arch, seed, scale, **overrides), char_tokenizer() if tokenizer else None
    )


def char_tokenizer():
    """A character-level tokenizer for the tiny models, one character per
    token: printable ASCII is ids 0-94, newline 95, ids 96-126 are the
    characters U+00A1.., and 127 is "∎", the EOS token."""
    from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer, TokenizerWrapper
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    chars += [chr(0xA1 + i) for i in range(VOCAB - 1 - len(chars))] + ["∎"]
    tok = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(chars)}, unk_token="∎"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="∎")
    return TokenizerWrapper(hf, NaiveStreamingDetokenizer, eos_token_ids=[VOCAB - 1])


def random_prompt(n: int, seed: int = 0) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def perturbed_target(arch: str, scale: float = 1.0, noise: float = 0.05, seed: int = 0) -> Target:
    """The ``tiny_target(arch, seed, scale)`` model with small random changes to
    its weights: a draft model that agrees with the target often, not always."""
    model = tiny_model(arch, seed, scale)
    keys = iter(mx.random.split(mx.random.key(seed + 7), 10_000))

    def jitter(x):
        if x.ndim < 2:
            return x
        return x + mx.random.normal(x.shape, key=next(keys)) * noise * mx.abs(x).mean()

    model.update(tree_map(jitter, model.parameters()))
    mx.eval(model.parameters())
    return Target.from_mlx_lm(model)
