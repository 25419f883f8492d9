"""Tiny random-weight models of mlx-lm's own architectures, for tests."""

from __future__ import annotations

import hf2q_py  # noqa: F401
import mlx.core as mx
from mlx.utils import tree_map

from hf2q_py.target import Target

VOCAB = 128

CONFIGS = {
    "llama": dict(
        model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
        rope_theta=10000.0, tie_word_embeddings=True,
    ),
    "qwen2": dict(
        model_type="qwen2", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=VOCAB,
        rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=4096,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
        vocab_size=VOCAB, sliding_window=16, sliding_window_pattern=3, query_pre_attn_scalar=32,
        rope_local_base_freq=10000.0, rope_global_base_freq=1000000.0,
    ),
    "gemma4_text": dict(
        model_type="gemma4_text", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
        num_attention_heads=2, head_dim=16, global_head_dim=32, num_key_value_heads=1,
        num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size=VOCAB,
        vocab_size_per_layer_input=VOCAB, sliding_window=16, sliding_window_pattern=3,
        rms_norm_eps=1e-6, final_logit_softcapping=30.0,
    ),
    "gemma4_text_moe": dict(
        model_type="gemma4_text", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
        num_attention_heads=2, head_dim=16, global_head_dim=32, num_key_value_heads=1,
        num_kv_shared_layers=0, hidden_size_per_layer_input=0, vocab_size=VOCAB,
        vocab_size_per_layer_input=VOCAB, sliding_window=16, sliding_window_pattern=3,
        rms_norm_eps=1e-6, final_logit_softcapping=30.0, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=32,
    ),
}

ARCHS = tuple(CONFIGS)
SLIDING = ("gemma3_text", "gemma4_text", "gemma4_text_moe")


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
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def tiny_target(arch: str = "llama", seed: int = 0, scale: float = 1.0, *, tokenizer: bool = False,
                **overrides) -> Target:
    """A tiny random model; ``tokenizer=True`` adds ``char_tokenizer()``."""
    return Target.from_mlx_lm(tiny_model(arch, seed, scale, **overrides), char_tokenizer() if tokenizer else None)


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
