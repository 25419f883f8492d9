"""The drafter's attention pattern, computed by hand: full layers see the
whole block, sliding layers see it causally and within the window (context
included), and a config's ``is_causal`` overrides both, as in the published
reference."""

import mlx.core as mx
import numpy as np
import pytest

from hf2q_py.proposers.dflash_drafter import Drafter, DrafterConfig

S, L, WINDOW = 6, 5, 3  # context positions, block length, sliding window


def tiny_drafter(is_causal=None) -> Drafter:
    cfg = DrafterConfig(
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=16,
        vocab_size=32,
        target_layer_ids=(0,),
        mask_token_id=31,
        block_size=L,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=WINDOW,
        is_causal=is_causal,
    )
    mx.random.seed(1)
    return Drafter(cfg)


def by_hand(attn, x, ctx_k, ctx_v, rope, block_pos, visible):
    """softmax(q k^T * scale) v over the keys ``visible(i, key_position)`` allows."""
    q = np.array(rope(attn._heads(attn.q_proj(x), 1, attn.q_norm), offset=block_pos))[0, 0]
    k = np.array(rope(attn._heads(attn.k_proj(x), 1, attn.k_norm), offset=block_pos))[0, 0]
    v = np.array(attn._heads(attn.v_proj(x), 1, None))[0, 0]
    keys = np.concatenate([np.array(ctx_k)[0, 0], k])
    values = np.concatenate([np.array(ctx_v)[0, 0], v])
    positions = list(range(block_pos - S, block_pos + L))
    out = np.zeros((L, v.shape[-1]), np.float32)
    for i in range(L):
        qp = block_pos + i
        idx = [j for j, kp in enumerate(positions) if visible(qp, kp)]
        scores = keys[idx] @ q[i] * attn.scale
        w = np.exp(scores - scores.max())
        out[i] = (w / w.sum()) @ values[idx]
    return np.array(attn.o_proj(mx.array(out)[None]))[0]


def sliding_causal(q, k):
    return k <= q and q - k < WINDOW


def full_bidirectional(q, k):
    return True


def full_causal(q, k):
    return k <= q


def sliding_bidirectional(q, k):
    return abs(q - k) < WINDOW


@pytest.mark.parametrize(
    "is_causal, rules",
    [
        (None, (sliding_causal, full_bidirectional)),  # the reference's default
        (True, (sliding_causal, full_causal)),
        (False, (sliding_bidirectional, full_bidirectional)),
    ],
)
def test_each_layer_kind_attends_as_computed_by_hand(is_causal, rules):
    drafter = tiny_drafter(is_causal)
    block_pos = S + 4  # the block follows a context of S positions ending at block_pos - 1
    x = mx.random.normal((1, L, 8), key=mx.random.key(2))
    ctx = mx.random.normal((1, S, 8), key=mx.random.key(3))
    for layer, rule in zip(drafter.layers, rules):
        attn = layer.self_attn
        ctx_k, ctx_v = attn.context_kv(ctx, drafter._rope, block_pos - S)
        got = np.array(attn(x, ctx_k, ctx_v, drafter._rope, block_pos, None))[0]
        want = by_hand(attn, x, ctx_k, ctx_v, drafter._rope, block_pos, rule)
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_sliding_layers_draft_does_not_depend_on_later_block_positions():
    """Causal inside the block: changing block position 3 leaves positions 0..2 as they were."""
    drafter = tiny_drafter()
    attn = drafter.layers[0].self_attn
    ctx_k, ctx_v = attn.context_kv(mx.random.normal((1, S, 8), key=mx.random.key(3)), drafter._rope, 0)
    x = mx.random.normal((1, L, 8), key=mx.random.key(2))
    y = mx.concatenate([x[:, :3], x[:, 3:] + 1.0], axis=1)
    a = attn(x, ctx_k, ctx_v, drafter._rope, S, None)
    b = attn(y, ctx_k, ctx_v, drafter._rope, S, None)
    assert mx.allclose(a[:, :3], b[:, :3], atol=1e-6).item()
    full = drafter.layers[1].self_attn
    ctx_k, ctx_v = full.context_kv(mx.random.normal((1, S, 8), key=mx.random.key(3)), drafter._rope, 0)
    a, b = full(x, ctx_k, ctx_v, drafter._rope, S, None), full(y, ctx_k, ctx_v, drafter._rope, S, None)
    assert not mx.allclose(a[:, :3], b[:, :3], atol=1e-3).item()


def test_the_config_round_trips_is_causal_and_the_embedding_scale():
    cfg = tiny_drafter(True).config
    cfg.input_embedding_scale = 2.0
    d = cfg.to_dict()
    assert d["is_causal"] is True and d["dflash_config"]["input_embedding_scale"] == 2.0
    back = DrafterConfig.from_dict(d)
    assert back.is_causal is True and back.input_embedding_scale == 2.0
