"""Hostile and careless input: one clear error (or a correct answer), never a
crash, a hang, a NaN, or a user's file overwritten."""

import json
import time

import mlx.core as mx
import numpy as np
import pytest
from helpers import UNGATED
from models import VOCAB, random_prompt, tiny_model, tiny_target

import hf2q_py
from hf2q_py.tools.cli import main
from hf2q_py.draft_length import MAX_K, AdaptiveK, validate_k
from hf2q_py.errors import Hf2qError
from hf2q_py.proposers.ngram import MAX_NGRAM, validate_ngram
from hf2q_py.sampling import SamplingConfig, filtered_probs
from hf2q_py.stats import Round


def cli(capsys, *argv):
    """Run the CLI in-process: (exit code, stdout, stderr lines)."""
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse errors
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err.strip().splitlines()


def assert_one_line_error(result, *words):
    rc, _, err = result
    assert rc == 2, err
    assert len(err) == 1, err
    for w in words:
        assert w in err[0], err[0]


@pytest.fixture
def no_model_load(monkeypatch):
    """Any model load fails the test: the error must come before it."""

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(hf2q_py, "load", refuse)


# -- 1. a draft model with a smaller embedding than the shared tokenizer --------


def test_a_draft_smaller_than_the_tokenizer_is_refused():
    target = tiny_target("llama", tokenizer=True)
    draft = tiny_target("llama", seed=1, tokenizer=True, vocab_size=100)  # tokenizer ids go to 127
    with pytest.raises(
        Hf2qError, match=r"draft model's vocabulary \(100\) is smaller than its tokenizer's \(128"
    ):
        hf2q_py.generate(target, "abc", max_tokens=4, method="draft", draft=draft)


def test_target_padding_ids_never_index_past_the_draft_embedding():
    """A target with a padded vocabulary (160 rows, tokenizer 128) may emit ids
    the draft has no row for: drafting goes on, output equals plain decoding."""
    target = tiny_target("llama", scale=3.0, tokenizer=True, vocab_size=160)
    target.eos_token_ids = set()
    draft = tiny_target("llama", seed=1, scale=3.0, tokenizer=True)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 128, 12)]
    want = hf2q_py.generate(target, prompt, max_tokens=40).tokens
    assert max(want) >= VOCAB  # the case under test: ids past the draft's table
    got = hf2q_py.generate(
        target,
        prompt,
        max_tokens=40,
        method="draft",
        draft=draft,
        k=4,
        adaptive=False,
        **UNGATED,
    )
    assert got.tokens == want and got.stats.drafted > 0


# -- 2. the draft length: bounded, chosen in linear time -----------------------


def test_k_has_a_documented_maximum():
    validate_k(MAX_K)
    for bad in (0, MAX_K + 1, 10**6, True, 2.0, "3"):
        with pytest.raises(Hf2qError, match="k"):
            validate_k(bad)


def reference_rate(policy, i, key=None):
    """The conditional acceptance estimate as defined (recursively)."""
    prior = policy.profile.prior_rate if i == 0 or policy.acceptance.tried[i] >= 0.5 else reference_rate(policy, i - 1)
    pooled = (policy.acceptance.hits[i] + prior * policy.acceptance.prior_weight) / (policy.acceptance.tried[i] + policy.acceptance.prior_weight)
    if key is None or key not in policy.acceptance.keyed:
        return pooled
    tried, hits = policy.acceptance.keyed[key]
    return (hits[i] + pooled * policy.acceptance.key_weight) / (tried[i] + policy.acceptance.key_weight)


def test_adaptive_rates_match_their_definition():
    policy = AdaptiveK(12)
    for drafted, accepted, key in [(12, 3, "a"), (4, 4, "b"), (8, 0, None), (2, 1, "a")]:
        policy.update(Round(drafted=drafted, accepted=accepted, key=key, cost_seconds=0.01))
    for key in (None, "a", "b", "never seen"):
        assert policy.acceptance.rates(key) == pytest.approx([reference_rate(policy, i, key) for i in range(12)])


def test_choosing_k_at_the_maximum_is_fast():
    """It was cubic in K (6.4 s per round at k=512, a RecursionError near 990)."""
    policy = AdaptiveK(MAX_K)
    policy.update(Round(cost_seconds=0.01))
    for _ in range(20):
        policy.update(Round(drafted=MAX_K, accepted=MAX_K - 1, cost_seconds=0.02))
    t0 = time.perf_counter()
    for _ in range(50):
        k = policy.next_k()
    assert time.perf_counter() - t0 < 1.0
    assert 1 <= k <= MAX_K


# -- 3-5. train-dflash: the output folder, resuming, early checks ---------------


def model_folder(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"weights the user owns")
    return folder


def test_train_dflash_never_overwrites_a_model_folder(tmp_path, capsys, no_model_load):
    folder = model_folder(tmp_path)
    assert_one_line_error(
        cli(capsys, "train-dflash", "--out", str(folder), "--samples", "2", "--holdout", "1"),
        "not empty",
        "--overwrite",
    )
    assert (folder / "model.safetensors").read_bytes() == b"weights the user owns"
    assert not (folder / "train-state").exists()


def test_the_python_trainer_refuses_a_model_folder_too(tmp_path):
    from hf2q_py.tools.dflash_train import TrainConfig, train

    folder = model_folder(tmp_path)
    with pytest.raises(Hf2qError, match="not empty"):
        train(tiny_target("llama"), TrainConfig(out=str(folder), samples=2, holdout=1), [])
    assert (folder / "config.json").read_text() == '{"model_type": "llama"}'


def test_overwrite_starts_afresh(tmp_path):
    from hf2q_py.tools.dflash_train import TrainConfig, prepare_out, run_record

    folder = model_folder(tmp_path)
    (folder / "README.md").write_text("kept")
    cfg = TrainConfig(out=str(folder), samples=2, holdout=1, overwrite=True)
    data = prepare_out(cfg, run_record(None, ["a", "b"], 8))
    assert not (folder / "config.json").exists() and not (folder / "model.safetensors").exists()
    assert (folder / "README.md").read_text() == "kept"
    assert (
        data.parent.name == "train-state"
        and json.loads((data.parent / "run.json").read_text())["prompts"] == 2
    )


def test_resuming_with_other_prompts_or_target_is_refused(tmp_path, capsys, no_model_load):
    from hf2q_py.tools.dflash_train import TrainConfig, prepare_out, run_record

    out = tmp_path / "drafter"
    cfg = TrainConfig(out=str(out), samples=2, holdout=1)
    prepare_out(cfg, run_record(None, ["first prompt", "second prompt"], 8))
    prepare_out(cfg, run_record(None, ["first prompt", "second prompt"], 8))  # the same run resumes
    with pytest.raises(Hf2qError, match="--prompts"):
        prepare_out(cfg, run_record(None, ["first prompt", "another prompt"], 8))
    with pytest.raises(Hf2qError, match="--target"):
        prepare_out(cfg, run_record(str(tmp_path), ["first prompt", "second prompt"], 8))
    with pytest.raises(Hf2qError, match="--max-new-tokens"):
        prepare_out(cfg, run_record(None, ["first prompt", "second prompt"], 9))
    prompts = tmp_path / "p.txt"
    prompts.write_text("first prompt\nthird prompt\n")
    assert_one_line_error(
        cli(
            capsys,
            "train-dflash",
            "--out",
            str(out),
            "--prompts",
            str(prompts),
            "--samples",
            "2",
            "--holdout",
            "1",
            "--max-new-tokens",
            "8",
        ),
        "--prompts",
    )


def test_a_run_without_a_record_is_not_resumed_blindly(tmp_path):
    from hf2q_py.tools.dflash_train import TrainConfig, prepare_out, run_record

    work = tmp_path / "d" / "train-state"
    work.mkdir(parents=True)
    (work / "data.jsonl").write_text('{"prompt_tokens": 1, "tokens": [1, 2, 3]}\n')
    with pytest.raises(Hf2qError, match="without a record"):
        prepare_out(
            TrainConfig(out=str(tmp_path / "d"), samples=2, holdout=1), run_record(None, ["a", "b"], 8)
        )


@pytest.mark.parametrize(
    "args, words",
    [
        (["--target-layers", "-1"], ["target layer id"]),
        (["--target-layers", "1,1"], ["twice"]),
        (["--mask-token-id", "-5"], ["mask-token-id"]),
        (["--block-size", str(MAX_K + 2)], ["block-size"]),
        (["--lr", "nan"], ["lr"]),
    ],
)
def test_train_dflash_options_are_checked_before_loading(tmp_path, capsys, no_model_load, args, words):
    assert_one_line_error(cli(capsys, "train-dflash", "--out", str(tmp_path / "d"), *args), *words)


def test_target_layers_and_mask_are_checked_against_the_target_before_data():
    from hf2q_py.tools.dflash_train import TrainConfig

    target = tiny_target("llama")  # 4 layers, vocabulary 128
    TrainConfig(out="x", target_layer_ids=[0, 3], mask_token_id=127).check_target(target)
    with pytest.raises(Hf2qError, match=r"target-layers \[4\] are out of range"):
        TrainConfig(out="x", target_layer_ids=[0, 4]).check_target(target)
    with pytest.raises(Hf2qError, match="mask-token-id 128"):
        TrainConfig(out="x", mask_token_id=128).check_target(target)


@pytest.mark.slow
def test_train_dflash_checks_target_layers_before_generating_data(tmp_path, capsys):
    out = tmp_path / "d"
    result = cli(
        capsys,
        "train-dflash",
        "--out",
        str(out),
        "--target-layers",
        "1,99",
        "--samples",
        "2",
        "--holdout",
        "1",
        "--max-new-tokens",
        "4",
    )
    assert_one_line_error(result, "out of range", "30 layers")
    data = out / "train-state" / "data.jsonl"
    assert not data.exists() or data.read_text() == ""


# -- 6. tracebacks -> one line ---------------------------------------------------


@pytest.fixture
def not_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    return str(path)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt-file", "{f}"],
        ["ab", "--prompts", "{f}"],
        ["ab", "--prompt-file", "{f}"],
        ["train-dflash", "--out", "{d}", "--prompts", "{f}"],
    ],
)
def test_prompt_files_that_are_not_utf8(tmp_path, capsys, no_model_load, not_utf8, argv):
    argv = [a.format(f=not_utf8, d=tmp_path / "d") for a in argv]
    assert_one_line_error(cli(capsys, *argv), "not UTF-8")


@pytest.mark.parametrize(
    "argv",
    [
        ["ab", "--prompt", "hi", "--markdown", "{t}/no/such/folder/ab.md"],
        ["bench", "--markdown", "{t}/no/such/folder/b.md"],
        ["bench", "--chart", "{t}"],
    ],
)
def test_unwritable_outputs_are_refused_before_the_run(tmp_path, capsys, no_model_load, argv):
    argv = [a.format(t=tmp_path) for a in argv]
    assert_one_line_error(cli(capsys, *argv), "file")
    assert list(tmp_path.iterdir()) == []


def test_an_output_check_leaves_no_file_behind(tmp_path):
    from hf2q_py.tools.files import check_writable

    check_writable(tmp_path / "new.md")
    assert not (tmp_path / "new.md").exists()
    (tmp_path / "old.md").write_text("kept")
    check_writable(tmp_path / "old.md")
    assert (tmp_path / "old.md").read_text() == "kept"


@pytest.mark.parametrize(
    "methods, words",
    [
        ("ngram:temperature=0.5", ["unknown method option 'temperature'", "--temp"]),
        ("ngram:k=0", ["k (draft length)"]),
        ("ngram:k=x", ["bad value for k"]),
        ("ngram:ngram_max=99", ["ngram-max"]),
        ("magic", ["unknown method"]),
        ("draft", ["draft model"]),
        ("layerskip:skip_layers=early:x", ["skip recipe"]),
    ],
)
def test_bench_method_options_are_checked_before_loading(capsys, no_model_load, methods, words):
    assert_one_line_error(cli(capsys, "bench", "--methods", methods), *words)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["ab", "--methods", "ngram,magic"], ["unknown method 'magic'"]),
        (["ab", "--methods", ","], ["--methods is empty"]),
        (["ab", "--methods", "draft"], ["needs a draft model", "--draft-model"]),
        (["ab", "--methods", "dflash"], ["needs a drafter", "--drafter"]),
        (["ab", "--k", str(MAX_K + 1)], ["k (draft length)"]),
        (["ab", "--prompt", " "], ["empty"]),
        (["ab", "--methods", "layerskip", "--skip-layers", "1,x"], ["bad skip layers"]),
        (["ab", "--methods", "dflash", "--drafter", "/no/such/folder"], ["no such folder"]),
        (["bench", "--temp", "-1"], ["temperature"]),
        (["bench", "--only", "no-such-workload"], ["no workload"]),
        (["bench", "--methods", "baseline"], ["no method"]),
        (["bench", "--dtype", "int3"], ["dtype"]),
        (
            ["generate", "--prompt", "hi", "--method", "draft", "--draft-model", "/no/such.gguf"],
            ["no such file"],
        ),
    ],
)
def test_bench_and_ab_error_paths(capsys, no_model_load, argv, words):
    assert_one_line_error(cli(capsys, *argv), *words)


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(target_layer_ids=["1", "2"]), ["target_layer_ids entry", "integer"]),
        (dict(block_size="8"), ["block_size", "integer"]),
        (dict(hidden_size="64"), ["hidden_size", "integer"]),
        (dict(num_attention_heads=0), ["num_attention_heads"]),
        (dict(num_key_value_heads=3), ["multiple of num_key_value_heads"]),
        (dict(dflash_config=[1, 2]), ["dflash_config must be an object"]),
        (dict(layer_types="full_attention"), ["layer_types"]),
        (dict(rope_theta="big"), ["rope_theta"]),
    ],
)
def test_drafter_configs_with_wrong_types_are_refused(tmp_path, change, words):
    from hf2q_py.proposers.dflash_drafter import load_drafter
    from test_dflash import published_folder

    folder = published_folder(tmp_path, tiny_target("llama"))
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in change.items():
        (cfg["dflash_config"] if key == "target_layer_ids" else cfg)[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Hf2qError) as e:
        load_drafter(folder)
    for w in words:
        assert w in str(e.value)


def test_a_drafter_config_that_is_a_list_is_refused(tmp_path):
    from hf2q_py.proposers.dflash_drafter import load_drafter

    (tmp_path / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(Hf2qError, match="must hold an object"):
        load_drafter(tmp_path)


def test_prompts_with_lone_surrogates(tmp_path, capsys, no_model_load):
    target = tiny_target("llama", tokenizer=True)
    with pytest.raises(Hf2qError, match="lone surrogate"):
        hf2q_py.generate(target, "ab\ud800c", max_tokens=2)
    assert_one_line_error(cli(capsys, "generate", "--prompt", "x\udcff"), "lone surrogate")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "bad \\ud800 escape"}\n')
    assert_one_line_error(cli(capsys, "ab", "--prompts", str(jsonl)), "lone surrogate")
    assert_one_line_error(
        cli(
            capsys,
            "train-dflash",
            "--out",
            str(tmp_path / "d"),
            "--prompts",
            str(jsonl),
            "--samples",
            "1",
            "--holdout",
            "0",
        ),
        "lone surrogate",
    )


# -- 7. tiny temperatures --------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-30])
def test_tiny_temperatures_give_argmax_not_nan(temperature):
    logits = mx.array([[1.0, 3.0, 2.0, -50.0], [0.5, 0.5, 0.1, 0.0]])
    p = filtered_probs(logits, SamplingConfig(temperature=temperature))
    assert not np.isnan(np.array(p)).any()
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]  # ties share the mass


def test_sampling_at_a_tiny_temperature_is_greedy():
    target = tiny_target("llama", scale=2.0)
    prompt = random_prompt(8)
    want = hf2q_py.generate(target, prompt, max_tokens=12).tokens
    for method in ("baseline", "ngram"):
        got = hf2q_py.generate(target, prompt, max_tokens=12, temperature=1e-40, seed=1, method=method)
        assert got.tokens == want


@pytest.mark.parametrize(
    "opts",
    [
        dict(temperature=float("inf")),
        dict(temperature=float("nan")),
        dict(top_p=float("nan")),
        dict(repetition_penalty=float("inf")),
        dict(min_p=float("nan")),
        dict(draft_p_min=float("nan")),
    ],
)
def test_non_finite_numbers_are_refused(opts):
    with pytest.raises(Hf2qError, match="finite"):
        hf2q_py.generate(tiny_target("llama"), [1, 2], max_tokens=2, **opts)


# -- 8. context length -----------------------------------------------------------


def test_a_prompt_that_fills_the_context_is_refused_and_generation_stops_at_its_end():
    target = tiny_target("qwen2")  # max_position_embeddings in its config
    target.model.args.max_position_embeddings = 16
    with pytest.raises(Hf2qError, match="context holds 16"):
        hf2q_py.generate(target, random_prompt(16), max_tokens=2)
    r = hf2q_py.generate(target, random_prompt(10), max_tokens=50, method="ngram")
    assert len(r.tokens) == 6 and r.finish_reason == "length"


# -- 9. n-gram size ----------------------------------------------------------------


def test_ngram_size_has_a_documented_maximum():
    validate_ngram(1, MAX_NGRAM)
    with pytest.raises(Hf2qError, match=f"ngram-max must be in \\[1, {MAX_NGRAM}\\]"):
        validate_ngram(1, 100_000)
    with pytest.raises(Hf2qError, match="ngram-min"):
        validate_ngram(MAX_NGRAM + 1, MAX_NGRAM + 1)


# -- 10. multi-line library errors -> one line -------------------------------------


def test_a_folder_without_tokenizer_files(tmp_path, capsys):
    from mlx.utils import tree_flatten
    from models import CONFIGS

    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIGS["llama"]))
    mx.save_safetensors(
        str(folder / "model.safetensors"), dict(tree_flatten(tiny_model("llama").parameters()))
    )
    assert_one_line_error(
        cli(capsys, "generate", "--prompt", "hi", "--model", str(folder)), "no tokenizer files"
    )


def test_a_gguf_with_missing_tensors(tmp_path, capsys):
    import gguf

    path = tmp_path / "partial.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(32)
    w.add_head_count(4)
    w.add_feed_forward_length(64)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_line_error(cli(capsys, "generate", "--prompt", "hi", "--model", str(path)), "GGUF")


# -- 11. the smaller ones ----------------------------------------------------------


@pytest.mark.parametrize(
    "argv, words",
    [
        (["generate", "--prompt", "hi", "--temp", "-1"], ["temperature"]),
        (["generate", "--prompt", "hi", "--top-p", "2"], ["top-p"]),
        (
            ["generate", "--prompt", "hi", "--method", "ngram", "--ngram-min", "4", "--ngram-max", "2"],
            ["ngram-max"],
        ),
        (["generate", "--prompt", "hi", "--stop", ""], ["stop"]),
        (
            ["generate", "--prompt", "hi", "--method", "layerskip", "--skip-layers", "middle:0"],
            ["skip recipe"],
        ),
        (
            ["generate", "--prompt", "hi", "--method", "dflash", "--drafter", "/no/such/drafter"],
            ["no such folder"],
        ),
        (["generate", "--prompt", "hi", "--model", "/no/such/folder"], ["no such file or folder"]),
    ],
)
def test_option_errors_come_before_the_model_loads(capsys, no_model_load, argv, words):
    assert_one_line_error(cli(capsys, *argv), *words)


def test_ctrl_c_is_seen_between_short_prefill_chunks(monkeypatch, capsys):
    from hf2q_py import target as target_module

    assert target_module.PREFILL_CHUNK <= 512
    target = tiny_target("llama")
    widths = []
    real = target_module.Runtime.forward

    def spy(self, tokens, **kw):
        widths.append(len(tokens))
        return real(self, tokens, **kw)

    monkeypatch.setattr(target_module.Runtime, "forward", spy)
    target.runtime().prefill(random_prompt(1100), logits="none")
    assert max(widths) <= target_module.PREFILL_CHUNK and sum(widths) == 1100

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf2q_py, "load", interrupted)
    rc, _, err = cli(capsys, "generate", "--prompt", "hi")
    assert rc == 130 and err == ["hf2q-py: interrupted"]


def test_the_draft_model_loads_with_the_requested_dtype(tmp_path, capsys, monkeypatch):
    loads = []

    def fake_load(source=None, *, dtype="auto"):
        loads.append(dtype)
        return tiny_target("llama", seed=len(loads), tokenizer=True)

    monkeypatch.setattr(hf2q_py, "load", fake_load)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    rc, out, err = cli(
        capsys,
        "generate",
        "--prompt",
        "ab",
        "--model",
        str(model),
        "--method",
        "draft",
        "--draft-model",
        str(model),
        "--dtype",
        "float16",
        "--max-tokens",
        "3",
        "--json",
    )
    assert rc == 0, err
    assert loads == ["float16", "float16"]


@pytest.mark.parametrize(
    "opts",
    [
        dict(temperature="0.5"),
        dict(k="3"),
        dict(max_tokens="5"),
        dict(stop=5),
        dict(stop=[1]),
        dict(top_k=1.5),
        dict(seed="x"),
        dict(adaptive="no"),
        dict(ngram_max=2.0),
        dict(chat_template="yes"),
        dict(skip_layers=[1.5]),
        dict(method="layerskip", skip_layers=5),
        dict(draft=5),
        dict(k=True),
        dict(repetition_penalty=None),
    ],
)
def test_wrongly_typed_python_options_raise_hf2q_error(opts):
    with pytest.raises(Hf2qError):
        hf2q_py.generate(tiny_target("llama"), [1, 2, 3], **{"max_tokens": 2, **opts})


def test_wrongly_typed_prompts_and_configs_raise_hf2q_error():
    target = tiny_target("llama")
    for prompt in (None, 5, b"bytes", [1, "2"], [1.0], [True]):
        with pytest.raises(Hf2qError):
            hf2q_py.generate(target, prompt, max_tokens=2)
    with pytest.raises(Hf2qError, match="GenerationConfig"):
        list(hf2q_py.stream_generate(target, [1, 2], config={"max_tokens": 2}))


# -- stop strings and EOS ------------------------------------------------------------


def test_stop_strings_end_text_and_tokens_at_the_same_place():
    target = tiny_target("llama", scale=2.0, tokenizer=True)
    target.eos_token_ids = set()
    tok = target.tokenizer
    free = hf2q_py.generate(target, "hello world", max_tokens=40, chat_template=False)
    ends = [len(tok.decode(free.tokens[: i + 1])) for i in range(len(free.tokens))]
    assert tok.decode(free.tokens) == free.text
    unmatched = hf2q_py.generate(target, "hello world", max_tokens=40, chat_template=False, stop=["never"])
    assert unmatched.text == free.text and unmatched.tokens == free.tokens  # text held back is not repeated
    for method in ("baseline", "ngram"):
        for first, n in ((10, 3), (0, 1), (25, 6)):
            stop = tok.decode(free.tokens[first : first + n])
            cut = free.text.find(stop)
            r = hf2q_py.generate(
                target, "hello world", max_tokens=40, stop=[stop, "never"], chat_template=False, method=method
            )
            # the tokens whose text ends before the stop string, and their text
            assert r.tokens == [t for t, e in zip(free.tokens, ends) if e <= cut]
            assert r.text == tok.decode(r.tokens) == free.text[: max([0] + [e for e in ends if e <= cut])]
            assert r.finish_reason == "stop" and r.stats.generated_tokens == len(r.tokens)
            chunks = list(
                hf2q_py.stream_generate(
                    target, "hello world", max_tokens=40, stop=[stop], chat_template=False, method=method
                )
            )
            assert "".join(c.text for c in chunks) == r.text
            assert [t for c in chunks for t in c.tokens] == r.tokens


@pytest.mark.parametrize("method", ["baseline", "ngram", "draft"])
def test_eos_ends_sampled_generation_without_being_emitted(method):
    target = tiny_target("llama", scale=2.0)
    prompt = random_prompt(8) * 2  # repeats, so the n-gram proposer drafts
    opts = dict(method=method, temperature=0.9, seed=4)
    if method == "draft":
        opts.update(
            draft=tiny_target("llama", seed=1, scale=2.0),
            k=3,
            adaptive=False,
            **UNGATED,
        )
    free = hf2q_py.generate(target, prompt, max_tokens=30, **opts)
    eos = free.tokens[12]
    target.eos_token_ids = {eos}
    r = hf2q_py.generate(target, prompt, max_tokens=30, **opts)
    assert r.tokens == free.tokens[: free.tokens.index(eos)]
    assert r.finish_reason == "stop" and eos not in r.tokens


def test_benchmark_scripts_end_bad_input_with_one_line_and_status_2():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_draft_length.py"
    for args, message in (
        (["--results", "/nonexistent/dir/x.json"], "cannot write --results file /nonexistent/dir/x.json"),
        (["--fixed-ks", "2,0"], "--fixed-ks and --k must be draft lengths in [1, 256]"),
        (["--k", "300"], "--fixed-ks and --k must be draft lengths in [1, 256]"),
        (["--streams", "/nonexistent/s.json"], "cannot read recorded streams /nonexistent/s.json"),
        (["--record", "builtin", "builtin"], "--record needs --streams"),
        (["--seeds", "0"], "--seeds must be at least 1"),
    ):
        done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)
        assert done.returncode == 2
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("bench_draft_length.py: error: ") and message in last
        assert "Traceback" not in done.stderr
