"""Every mapped GGUF architecture round-trips: a tiny random mlx-lm model
written as llama.cpp's converter writes it loads back with equal logits."""

import mlx.core as mx
import pytest
from gguf_export import EXPORTS, Q, VOCAB, export

import hf2q_py

PROMPT = [(37 * i + 11) % VOCAB for i in range(24)]  # longer than gemma3's sliding window (8)


def logits_gap(path, model) -> float:
    target = hf2q_py.load(path, dtype="float32")
    x = mx.array([PROMPT])
    return mx.abs(target.model(x) - model(x)).max().item()


@pytest.mark.parametrize("name", list(EXPORTS))
def test_float32_logits_equal_the_source_model(tmp_path, name):
    path = tmp_path / f"{name}.gguf"
    model = export(path, name, Q.F32)
    assert logits_gap(path, model) < 1e-4


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q5_0], ids=lambda q: q.name)
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_stored_types_load_to_the_values_in_the_file(tmp_path, name, qtype):
    """F16/Q8_0/Q4_0 through mx.load, Q5_0 through the numpy dequantizer."""
    path = tmp_path / f"{name}.gguf"
    model = export(path, name, qtype)
    assert logits_gap(path, model) < 1e-4


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_heads(tmp_path, tied):
    path = tmp_path / "llama.gguf"
    model = export(path, "llama", Q.F32, tied=tied)
    target = hf2q_py.load(path, dtype="float32")
    assert ("lm_head" in target.model) != tied
    assert logits_gap(path, model) < 1e-4


def test_llama3_rope_scaling_comes_from_rope_freqs(tmp_path):
    """Without the file's rope_freqs the logits would be far off."""
    from mlx_lm.models.rope_utils import initialize_rope

    path = tmp_path / "llama3.gguf"
    model = export(path, "llama3-rope", Q.F32)
    assert logits_gap(path, model) < 1e-4
    for layer in model.model.layers:  # the same model with plain rope
        layer.self_attn.rope = initialize_rope(16, 500000.0, False, None, 4096)
    assert logits_gap(path, model) > 1e-2


def test_sentencepiece_vocabulary_loads_with_the_model(tmp_path):
    path = tmp_path / "gemma3.gguf"
    export(path, "gemma3", Q.F32)
    tok = hf2q_py.load(path).tokenizer
    text = "def f(x):\n    return 😀"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.encode("a")[0] == 1  # BOS, as the file says


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    """qwen3moe and Mixtral GGUFs (4 experts, 2 a token), each with a differently seeded draft."""
    root = tmp_path_factory.mktemp("moe")
    files = {}
    for name in ("qwen3moe", "mixtral"):
        export(root / f"{name}.gguf", name, Q.F32, seed=0)
        export(root / f"{name}-draft.gguf", name, Q.F32, seed=1)
        files[name] = (root / f"{name}.gguf", root / f"{name}-draft.gguf")
    return files


@pytest.mark.parametrize("method", ["ngram", "draft", "layerskip", "dflash"])
@pytest.mark.parametrize("name", ["qwen3moe", "mixtral"])
def test_every_method_on_mixture_of_experts_files_equals_plain_greedy(moe_files, name, method):
    from helpers import UNGATED, assert_same_greedy, reference_greedy

    from hf2q_py.tools.dflash_make import drafter_for

    path, draft_path = moe_files[name]
    target = hf2q_py.load(path, dtype="float32")
    target.eos_token_ids = set()  # compared with mlx-lm's greedy, which runs past them
    opts = {
        "draft": {"draft": hf2q_py.load(draft_path, dtype="float32"), **UNGATED},
        "layerskip": {"skip_layers": [1]},
        "dflash": {"drafter": drafter_for(target, layers=1, target_layer_ids=[0, 2], block_size=9)},
    }.get(method, {})
    prompt = PROMPT[:10] * 3
    want = reference_greedy(target.model, prompt, 30)
    r = hf2q_py.generate(target, prompt, max_tokens=30, method=method, k=8, adaptive=False, **opts)
    assert_same_greedy(target.model, prompt, r.tokens, want)
    assert r.stats.drafted > 0
