"""Quantized KV caches (kv_bits 8 and 4): every method's greedy output equals
plain decoding with the same bits, single and batched, on full attention,
sliding windows past their wrap, Gemma 4's shared KV and a hybrid's attention
layers; rollback never re-quantizes; quantized_kv_start is a function of
positions; prompt-cache entries are reused only by the same layout; the bytes
per token; bad options are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache

import mlx.core as mx
import pytest
from helpers import NEAR_TIE, UNGATED, assert_one_line_error, cli
from mlx.utils import tree_flatten
from models import char_tokenizer, random_prompt, tiny_model, tiny_target
from test_batching import assert_fed_rows_equal_solo
from test_engine import loopy_prompt

import hf2q_py
from hf2q_py.tools.ab import near_tie_bound
from hf2q_py.cache import QuantizedKVCache, SlidingWindowCache
from hf2q_py.errors import Hf2qError
from hf2q_py.kv import KVConfig, kv_bytes_per_token, kv_footprint
from hf2q_py.prompt_cache import PromptCache
from hf2q_py.scheduler import Scheduler, SchedulerConfig
from hf2q_py.tools.dflash_make import drafter_for, save_drafter

#: (weight scale, config overrides): head dimensions of 32 and more, so groups of 32 fit.
ARCHS = {
    "llama": (2.0, dict(head_dim=32)),  # full attention
    "gemma3_text": (1.0, {}),  # sliding windows of 16 (the answers run past them)
    "gemma4_text": (1.5, dict(head_dim=32, global_head_dim=64)),  # windows and shared KV
    "qwen3_next": (1.0, dict(head_dim=32)),  # gated-delta layers between attention layers
}
GROUP = 32
#: n-gram drafting with a fixed K and no memory: many drafts, many rejected.
REJECTING = dict(method="ngram", k=4, adaptive=False, memory=False)
PROMPTS = [loopy_prompt(24), random_prompt(20, 1), random_prompt(5, 2), loopy_prompt(40)[3:], [7]]


def target_for(arch: str, bits: int | None = None, seed: int = 0, start: int = 0) -> hf2q_py.Target:
    scale, overrides = ARCHS[arch]
    target = tiny_target(arch, seed=seed, scale=scale, **overrides)
    if bits is not None:
        target.kv = KVConfig(bits, GROUP, start)
    return target


def margin_with_kv(target, tokens: list[int]) -> float:
    """Top-1 minus top-2 logit after ``tokens``, with the target's KV storage."""
    logits = target.runtime().prefill(tokens, logits="last").logits[-1]
    top = mx.sort(logits)[-2:].tolist()
    return top[1] - top[0]


def assert_same_greedy_kv(target, prompt: list[int], got: list[int], want: list[int]) -> None:
    """Equal token for token, or the first difference is a numerical near-tie
    of the quantized model (batched and single-token forwards round alike)."""
    if got == want:
        return
    i = next((j for j in range(min(len(got), len(want))) if got[j] != want[j]), None)
    assert i is not None, f"lengths differ with equal prefix: {len(got)} vs {len(want)}"
    margin = margin_with_kv(target, prompt + want[:i])
    # quantized KV widens near-ties (a key rounded to the next grid step), by how much depends
    # on the BLAS kernels of the machine: the bound is measured here, as ``hf2q-py ab`` does
    bound = max(NEAR_TIE, near_tie_bound(target, prompt + want).bound)
    assert margin < bound, (
        f"diverged at token {i} where the top-2 margin is {margin:.4g} (bound {bound:.4g}): "
        f"{got[i]} vs {want[i]}"
    )


@cache
def plain(arch: str, bits: int, prompt: tuple[int, ...], n: int, start: int = 0) -> tuple[int, ...]:
    target = target_for(arch, bits, start=start)
    return tuple(hf2q_py.generate(target, list(prompt), max_tokens=n, method="baseline").tokens)


def method_options(method: str, arch: str, tmp_path) -> dict:
    if method == "ngram":
        return REJECTING
    if method == "draft":  # a different random model: drafts often rejected
        return dict(method="draft", draft=target_for(arch, seed=1), k=3, adaptive=False, **UNGATED)
    if method == "layerskip":
        return dict(method="layerskip", skip_layers=[1], k=3, adaptive=False)
    target = target_for(arch)
    folder = tmp_path / "drafter"
    save_drafter(drafter_for(target, layers=1, block_size=8, target_layer_ids=[0, 2]), folder)
    return dict(method="dflash", drafter=str(folder), k=7, adaptive=False)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("method", ["ngram", "draft", "layerskip", "dflash"])
def test_every_method_equals_plain_decoding_with_the_same_kv_bits(arch, bits, method, tmp_path):
    target = target_for(arch, bits)
    options = method_options(method, arch, tmp_path)
    rejected = 0
    for prompt in (PROMPTS[0], PROMPTS[1]):
        want = list(plain(arch, bits, tuple(prompt), 40))
        got = hf2q_py.generate(target, prompt, max_tokens=40, **options)
        assert_same_greedy_kv(target, prompt, got.tokens, want)
        rejected += got.stats.drafted - got.stats.accepted
    assert rejected > 0, "the test should exercise rollback"
    assert all(isinstance(c, (QuantizedKVCache, SlidingWindowCache)) for c in _attention(target.runtime()))


def _attention(rt) -> list:
    return [c for c in rt.cache if not hasattr(c, "cache")]  # every cache but recurrent ones


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_row_of_a_batch_equals_its_solo_generation_with_the_same_kv_bits(arch, bits):
    target = target_for(arch)  # full precision; the generations ask for the bits
    options = dict(REJECTING, kv_bits=bits, kv_group_size=GROUP)
    want = [hf2q_py.generate(target, p, max_tokens=40, **options) for p in PROMPTS]
    got = hf2q_py.batch_generate(target, PROMPTS, max_tokens=40, max_batch=3, **options)
    quantized = target_for(arch, bits)
    for p, g, w in zip(PROMPTS, got, want):
        assert_same_greedy_kv(quantized, p, g.tokens, w.tokens)
        assert_same_greedy_kv(quantized, p, w.tokens, list(plain(arch, bits, tuple(p), 40)))
    assert sum(g.stats.drafted - g.stats.accepted for g in got) > 0


class Collect:
    def __init__(self):
        self.tokens, self.error = [], None

    def chunk(self, chunk):
        self.tokens += chunk.tokens

    def done(self, stats, error=None):
        self.error = error


def submit(scheduler, prompt, **options):
    sink = Collect()
    entry = scheduler.submit(list(prompt), hf2q_py.generation.make_config(**options), sink)
    return entry, sink


def test_rows_joining_and_leaving_a_quantized_batch_each_equal_solo():
    target = target_for("gemma4_text", 8)
    scheduler = Scheduler(target, SchedulerConfig(max_batch=2, prefill_chunk=8))
    budgets = [50, 12, 33, 5, 41]
    sinks = []
    for i, (prompt, n) in enumerate(zip(PROMPTS, budgets)):
        sinks.append(submit(scheduler, prompt, max_tokens=n, **REJECTING)[1])
        for _ in range(3 * i):  # later prompts arrive while earlier ones run
            scheduler.step()
    scheduler.run()
    for prompt, n, sink in zip(PROMPTS, budgets, sinks):
        assert sink.error is None
        assert_same_greedy_kv(target, prompt, sink.tokens, list(plain("gemma4_text", 8, tuple(prompt), n)))
    assert max(scheduler.rounds_by_size) == 2


def test_a_generation_whose_kv_config_differs_from_the_batch_runs_alone_and_is_exact():
    target = target_for("llama", 8)
    scheduler = Scheduler(target, SchedulerConfig(max_batch=4))
    jobs = [(PROMPTS[0], {}), (PROMPTS[1], {}), (PROMPTS[3], dict(kv_bits=4, kv_group_size=GROUP))]
    entries = [submit(scheduler, p, max_tokens=30, **REJECTING, **o) for p, o in jobs]
    while not scheduler.idle:
        scheduler.step()
        assert entries[2][0] not in scheduler.rows
    for (prompt, options), (_, sink) in zip(jobs, entries):
        bits = options.get("kv_bits", 8)
        assert_same_greedy_kv(
            target_for("llama", bits), prompt, sink.tokens, list(plain("llama", bits, tuple(prompt), 30))
        )
    assert max(scheduler.rounds_by_size) == 2


def stored(cache, n: int) -> list[mx.array]:
    """The quantized triplets a layer cache holds for positions 0 .. n - 1 that it keeps."""
    lo = getattr(cache, "start", 0)
    return [x[..., : n - lo, :] for store in (cache.keys, cache.values) for x in store]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_rollback_leaves_the_quantized_storage_of_kept_positions_unchanged(arch):
    target = target_for(arch, 4)
    rt = target.runtime(slack=16)
    tokens = random_prompt(40)  # past gemma3's window of 16: the buffers have wrapped
    rt.prefill(tokens[:30], logits="none")
    mx.eval(rt.state())
    before = [[mx.array(x) for x in stored(c, 30)] for c in _attention(rt)]
    rt.verify(tokens[30:40])
    rt.trim(7)  # three of the ten kept
    mx.eval(rt.state())
    for c, old in zip(_attention(rt), before):
        assert c.offset == 33
        for a, b in zip(stored(c, 30), old):
            assert mx.array_equal(a, b).item()


def test_quantizing_is_per_position_so_any_split_of_the_positions_stores_the_same_bits():
    keys = mx.random.normal((2, 3, 9, 64), key=mx.random.key(1))
    for bits in (8, 4):
        whole = KVConfig(bits, 32).quantize(keys)
        parts = [KVConfig(bits, 32).quantize(keys[:, :, i : i + 1]) for i in range(9)]
        for j, x in enumerate(whole):
            assert mx.array_equal(x, mx.concatenate([p[j] for p in parts], axis=2)).item()


def test_a_row_keeps_the_bits_of_the_sequence_it_came_from_and_leaves_with_them():
    from hf2q_py.batch.runtime import BatchRuntime

    target = target_for("llama", 8)
    prompts = [random_prompt(12, 1), random_prompt(20, 2)]
    rts = [target.runtime() for _ in prompts]
    for rt, p in zip(rts, prompts):
        rt.prefill(p, logits="none")
        mx.eval(rt.state())
    batch = BatchRuntime(target)
    for i, rt in enumerate(rts):
        batch.add(i, rt)
    batch.forward([[5, 6, 7], [8]])  # row 1 is padded: its last two slots are emptied
    batch.trim(0, 1)
    snap = batch.snapshot(1, prompts[1] + [8])
    assert snap.kv == target.kv
    back = target.runtime()
    back.restore(snap, 21)
    for solo, row, layer in zip(rts[1].cache, back.cache, snap.layers):
        assert layer.kv == target.kv and len(layer.arrays[0]) == 3
        for a, b in zip(stored(solo, 20), stored(row, 20)):
            assert mx.array_equal(a, b).item()


START = 20


def test_a_forward_crossing_quantized_kv_start_equals_single_decodes():
    target = target_for("gemma3_text", 8, start=START)
    tokens = random_prompt(40)
    crossing, single = target.runtime(), target.runtime()
    crossing.prefill(tokens[:15], logits="none")
    single.prefill(tokens[:15], logits="none")
    rows = crossing.verify(tokens[15:24]).logits  # positions 15..23 cross 20
    singles = mx.concatenate([single.decode(t).logits for t in tokens[15:24]])
    assert_close_rows(rows, singles)
    full = target.runtime(kv=KVConfig())  # below the start, queries read full-precision keys
    full.prefill(tokens[:15], logits="none")
    assert mx.array_equal(rows[:5], full.verify(tokens[15:20]).logits).item()
    crossing.trim(6)  # back below the start: its full-precision positions are still held
    single.trim(6)
    back = crossing.verify(tokens[18:26]).logits
    assert_close_rows(back, mx.concatenate([single.decode(t).logits for t in tokens[18:26]]))


def assert_close_rows(a: mx.array, b: mx.array) -> None:
    """The same tokens, and logits within batched-vs-single noise (measured here: ~1e-6)."""
    assert mx.array_equal(a.argmax(-1), b.argmax(-1)).item()
    assert mx.allclose(a, b, atol=1e-3).item()


@pytest.mark.parametrize("method", ["ngram", "layerskip"])
def test_every_method_crossing_quantized_kv_start_equals_plain_decoding(method, tmp_path):
    target = target_for("gemma4_text", 8, start=START)
    options = method_options(method, "gemma4_text", tmp_path)
    for prompt in (PROMPTS[0][:10], PROMPTS[2]):  # the answers cross position 20
        want = list(plain("gemma4_text", 8, tuple(prompt), 40, START))
        assert_same_greedy_kv(
            target, prompt, hf2q_py.generate(target, prompt, max_tokens=40, **options).tokens, want
        )


def test_rows_below_quantized_kv_start_run_alone_until_they_pass_it_and_stay_exact():
    target = target_for("llama", 8, start=START)
    scheduler = Scheduler(target, SchedulerConfig(max_batch=4))
    prompts = [random_prompt(30, 1), random_prompt(6, 2), PROMPTS[0][:8]]
    entries = [submit(scheduler, p, max_tokens=30, **REJECTING) for p in prompts]
    below_in_batch = False
    while not scheduler.idle:
        scheduler.step()
        below_in_batch |= any(len(e.seq.tokens) - 1 < START for e in scheduler.rows)
    assert not below_in_batch and max(scheduler.rounds_by_size) >= 2
    for prompt, (_, sink) in zip(prompts, entries):
        assert_same_greedy_kv(target, prompt, sink.tokens, list(plain("llama", 8, tuple(prompt), 30, START)))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_prompt_cache_reuse_with_quantized_entries_equals_a_cold_run(arch):
    target = target_for(arch, 8)
    target.prompt_cache = PromptCache(4)
    prompt = random_prompt(40)
    first = hf2q_py.generate(target, prompt, max_tokens=12, **REJECTING)
    follow_up = prompt + first.tokens + random_prompt(9, seed=3)
    second = hf2q_py.generate(target, follow_up, max_tokens=12, **REJECTING)
    assert second.stats.cached_tokens == len(prompt) + len(first.tokens) - 1
    assert_same_greedy_kv(target, follow_up, second.tokens, list(plain(arch, 8, tuple(follow_up), 12)))
    snap = target.prompt_cache.lookup(follow_up, len(follow_up) - 1, kv=target.kv)[0]
    attention = [layer for layer in snap.layers if layer.kind != "recurrent"]
    assert all(layer.kv == target.kv and len(layer.arrays[0]) == 3 for layer in attention)
    held = sum(sum(x.nbytes for _, x in tree_flatten(layer.arrays)) for layer in snap.layers)
    assert held <= snap.nbytes  # the buffers the arrays are views of: whole allocation steps
    if arch == "llama":  # one step of 256 positions of 8-bit triplets per layer
        assert snap.nbytes == kv_footprint(target).bytes(256)


def test_a_snapshot_is_never_restored_into_caches_of_another_kv_config():
    target = target_for("llama")
    target.prompt_cache = PromptCache(4)
    prompt = random_prompt(30)
    hf2q_py.generate(target, prompt, max_tokens=8, method="baseline")  # full precision
    again = hf2q_py.generate(target, prompt, max_tokens=8, method="baseline", kv_bits=8, kv_group_size=GROUP)
    assert again.stats.cached_tokens == 0
    assert list(again.tokens) == list(plain("llama", 8, tuple(prompt), 8))
    snap = target.prompt_cache.lookup(prompt, len(prompt) - 1)[0]
    with pytest.raises(ValueError, match="cannot be restored"):
        target.runtime(kv=KVConfig(8, GROUP)).restore(snap, 10)
    hit = hf2q_py.generate(target, prompt, max_tokens=8, method="baseline", kv_bits=8, kv_group_size=GROUP)
    assert hit.stats.cached_tokens == len(prompt) - 1  # the 8-bit entry is reused by 8-bit caches


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bytes_per_token_against_a_16_bit_cache(head_dim):
    target = tiny_target("llama", head_dim=head_dim)
    half = kv_bytes_per_token(target, KVConfig(), dtype=mx.float16)
    eight = kv_bytes_per_token(target, KVConfig(8, 64), dtype=mx.float16)
    four = kv_bytes_per_token(target, KVConfig(4, 64), dtype=mx.float16)
    assert eight / half == pytest.approx(0.53125) and eight / half <= 0.55
    assert four / half == pytest.approx(0.28125) and four / half <= 0.30
    full32 = kv_bytes_per_token(target, KVConfig())  # the model's own dtype: float32 here
    assert kv_bytes_per_token(target, KVConfig(8, 64)) / full32 == pytest.approx(0.28125)
    assert kv_bytes_per_token(target, KVConfig(4, 64)) / full32 == pytest.approx(0.15625)


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_the_footprint_counts_what_the_caches_hold(bits):
    target = target_for("llama", bits)
    rt = target.runtime()
    rt.prefill(random_prompt(256), logits="none")  # one whole allocation step
    mx.eval(rt.state())
    assert sum(c.nbytes for c in rt.cache) == kv_footprint(target).bytes(256)
    windows = kv_footprint(target_for("gemma3_text", bits))  # 2 full-attention layers, 4 windows of 16
    full = sum(windows.position_bytes(s) for s in windows.layers if s.kind == "kv")
    assert windows.bytes(4000) - windows.bytes(2000) == 2000 * full  # the windows stopped growing
    assert windows.bytes(16) == 16 * sum(windows.position_bytes(s) for s in windows.layers)
    hybrid = kv_footprint(target_for("qwen3_next", bits))
    recurrent = sum(s.fixed_bytes for s in hybrid.layers if s.kind == "recurrent")
    assert recurrent > 0 and hybrid.bytes(1) > recurrent


def test_bad_kv_options_are_refused_with_a_message_naming_the_option():
    target = target_for("llama")
    for options, words in (
        (dict(kv_bits=3), "kv_bits must be 4 or 8"),
        (dict(kv_bits=True), "kv_bits"),
        (dict(kv_bits=8, kv_group_size=48), "kv_group_size must be 32, 64 or 128"),
        (dict(kv_bits=8, quantized_kv_start=-1), "quantized_kv_start"),
        (dict(kv_group_size=32), "give kv_bits"),
        (
            dict(kv_bits=8, kv_group_size=64),
            "kv_group_size 64 does not divide this model's head dimension 32",
        ),
    ):
        with pytest.raises(Hf2qError, match=words):
            hf2q_py.generate(target, [1, 2, 3], max_tokens=2, **options)
    with pytest.raises(Hf2qError, match="head dimension 16"):  # no group size fits 16
        tiny_target("llama").kv = KVConfig(8, 32)
    with pytest.raises(Hf2qError, match="sinks"):
        tiny_target("gpt_oss").kv = KVConfig(8, 32)
    gemma2 = dict(model_type="gemma2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6, vocab_size=128)  # fmt: skip
    with pytest.raises(Hf2qError, match="computes its scores itself"):  # soft-capped, by hand
        tiny_target(gemma2).kv = KVConfig(8, 32)
    with pytest.raises(Hf2qError, match="kv_bits"):
        hf2q_py.load("/no/such/model.gguf", kv_bits=2)  # refused before anything is read
    with pytest.raises(Hf2qError, match="kv_group_size"):
        hf2q_py.batch_generate(target, [[1, 2]], max_tokens=2, kv_bits=8, kv_group_size=128)
    assert target.kv == KVConfig()  # a refused config leaves the target as it was


def model_folder(tmp_path, head_dim: int = 32):
    """A tiny random llama with a character tokenizer, as an mlx-lm folder."""
    from models import CONFIGS

    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    model = tiny_model("llama", scale=2.0, head_dim=head_dim)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    cfg = dict(CONFIGS["llama"], head_dim=head_dim, eos_token_id=127, max_position_embeddings=4096)
    (folder / "config.json").write_text(json.dumps(cfg))
    char_tokenizer()._tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--kv-bits", "3"], ["--kv-bits", "must be 4 or 8"]),
        (["--kv-bits", "8", "--kv-group-size", "48"], ["--kv-group-size", "32, 64 or 128"]),
        (["--kv-bits", "8", "--quantized-kv-start", "-2"], ["--quantized-kv-start", ">= 0"]),
        (["--kv-group-size", "32"], ["--kv-group-size", "--kv-bits"]),
    ],
)
def test_bad_kv_flags_are_one_line_errors(capsys, argv, words):
    assert_one_line_error(cli(capsys, "generate", "--prompt", "hi", *argv), *words)


def test_a_group_size_the_model_cannot_take_is_a_one_line_error(tmp_path, capsys):
    folder = model_folder(tmp_path)
    args = ["--model", str(folder), "--kv-bits", "8", "--kv-group-size", "128"]
    assert_one_line_error(cli(capsys, "generate", "--prompt", "hi", *args), "kv_group_size 128", "32")
    assert_one_line_error(cli(capsys, "bench", *args), "head dimension 32")


def test_cli_ab_with_kv_bits_checks_every_method_and_reports_the_effect_of_quantizing(tmp_path):
    folder = model_folder(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "hf2q_py", "ab", "--model", str(folder), "--kv-bits", "4",
         "--kv-group-size", "32", "--methods", "ngram;ngram:k=4,fixed", "--no-chat-template",
         "--prompt", "abcabcabcabc", "--prompt", "the cat sat on the mat", "--max-tokens", "24", "--json",
         "--markdown", str(tmp_path / "ab.md")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {r["verdict"] for r in out["results"]} <= {"identical", "near-tie"}
    effects = out["kv_effects"]
    assert len(effects) == 2 and all(e["kv"] == "4-bit KV (group 32)" for e in effects)
    assert all(e["first_difference"] is None or 0 <= e["first_difference"] <= 24 for e in effects)
    assert "vs full precision" in proc.stderr
    assert "4-bit KV (group 32) against full precision:" in (tmp_path / "ab.md").read_text()


def test_ab_with_kv_bits_refuses_engines_that_decode_at_full_precision(capsys):
    result = cli(capsys, "ab", "--kv-bits", "8", "--methods", "ngram,mlx-lm")
    assert_one_line_error(result, "--kv-bits", "mlx-lm")


def test_serve_with_kv_bits_answers_concurrent_requests_as_plain_decoding_with_those_bits(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from server_process import running_server

    folder = model_folder(tmp_path)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    want = [list(plain("llama", 8, tuple(p), 20)) for p in prompts]  # the same weights as the folder's
    with running_server("--model", str(folder), "--kv-bits", "8", "--kv-group-size", str(GROUP)) as s:

        def ask(prompt):
            body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "hf2q": {"return_tokens": True}}
            return s.post("/v1/completions", body)

        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(ask, prompts))
    target = target_for("llama", 8)
    for prompt, (status, body), w in zip(prompts, answers, want):
        assert status == 200, body
        assert_same_greedy_kv(target, prompt, body["hf2q"]["tokens"], w)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gemma4_text"])
def test_a_quantized_batch_computes_only_the_rows_it_feeds_and_each_equals_its_solo_forward(arch):
    assert_fed_rows_equal_solo(target_for(arch, 8))
