"""The prompt cache on disk: states written by one Target (or server
process) and restored by the next are exactly the saved ones, and what
follows equals a cold generation; blocks are shared between prompts, the
disk keeps its bound, and a file that is damaged, foreign or half-written
is never used."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import openai
import pytest
from helpers import assert_same_greedy
from models import random_prompt, tiny_model, tiny_target
from server_process import running_server, server_command

import hf2q_py
from hf2q_py import disk_cache
from hf2q_py.cache import LayerState
from hf2q_py.cache_file import CacheFileError, Host, read_file, write_file
from hf2q_py.cache_layout import layout_of, leaves
from hf2q_py.disk_cache import DiskCache, block_name
from hf2q_py.errors import Hf2qError
from hf2q_py.prompt_cache import PromptCache, Snapshot
from hf2q_py.target import Target

#: Full attention, sliding windows of 16 (the prompts run past them), Gemma 4's
#: shared KV, and hybrids whose recurrent state is valid at its exact end only.
ARCHS = ("llama", "gemma3_text", "gemma4_text", "qwen3_next", "lfm2")
BLOCK = 16
LOG = "hf2q_py.prompt_cache"


def with_disk(target: Target, directory: Path, **kw) -> Target:
    kw = {"block_tokens": BLOCK, "min_tokens": BLOCK, **kw}
    target.prompt_cache = PromptCache(disk=DiskCache(target, directory, **kw))
    return target


def started(arch: str, directory: Path, seed: int = 0, **kw) -> Target:
    """The model as a freshly started process has it: nothing in memory, the disk tier on ``directory``."""
    return with_disk(tiny_target(arch, seed=seed, scale=4.0), directory, **kw)


def generate(target: Target, prompt: list[int], n: int = 12):
    result = hf2q_py.generate(target, prompt, max_tokens=n, method="baseline")
    if target.prompt_cache is not None:
        target.prompt_cache.flush()
    return result


def cold(arch: str, prompt: list[int], n: int = 12) -> list[int]:
    return generate(tiny_target(arch, scale=4.0), prompt, n).tokens


def assert_same_state(a: Snapshot, b: Snapshot) -> None:
    assert a.tokens == b.tokens and len(a.layers) == len(b.layers)
    for x, y in zip(a.layers, b.layers):
        assert (x.kind, x.offset, x.start, x.window) == (y.kind, y.offset, y.start, y.window)
        xs, ys = leaves(x.arrays), leaves(y.arrays)
        assert [p for p, _ in xs] == [p for p, _ in ys]
        for (_, u), (_, v) in zip(xs, ys):
            assert u.dtype == v.dtype and mx.array_equal(u, v).item()


def held(target: Target, tokens: list[int]) -> Snapshot:
    (snap,) = [s for s in target.prompt_cache.snapshots() if list(s.tokens) == tokens]
    return snap


def from_disk(arch: str, directory: Path, prompt: list[int]) -> Snapshot:
    """What a freshly started process reads from disk for ``prompt``."""
    snap, _ = started(arch, directory).prompt_cache.disk.lookup(prompt, len(prompt) - 1)
    return snap


def files(directory: Path, prefix: str = "") -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.startswith(prefix) and p.suffix == ".safetensors"}


def cache_log(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG]


# -- round trips ------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_after_a_restart_the_states_read_from_disk_are_the_saved_ones_and_answers_equal_a_cold_run(
    arch, tmp_path
):
    prompt = random_prompt(70)  # past the sliding windows (16)
    first = started(arch, tmp_path)
    answer = generate(first, prompt)
    assert answer.stats.cached_tokens == 0 and files(tmp_path)

    # the same request again: full attention restores whole blocks (64), the
    # others the state at the prompt's end (69), which a prompt-end tail holds
    again = generate(started(arch, tmp_path), prompt)
    assert again.stats.cached_tokens == (64 if arch == "llama" else 69)
    if arch != "llama":  # the very state the cold prefill made: the same computation follows
        assert again.tokens == answer.tokens
    assert_same_greedy(first.model, prompt, again.tokens, answer.tokens)

    # the next turn: the whole conversation from disk, the same arrays as the saved state
    conversation = prompt + answer.tokens[:-1]
    follow = prompt + answer.tokens + random_prompt(9, seed=3)
    assert_same_state(from_disk(arch, tmp_path, follow), held(first, conversation))
    restarted = started(arch, tmp_path)
    got = generate(restarted, follow)
    assert got.stats.cached_tokens == len(conversation)
    assert restarted.prompt_cache.disk.stats.hits == 1
    assert got.tokens == generate(first, follow).tokens  # from memory: the same state, the same computation
    assert_same_greedy(first.model, follow, got.tokens, cold(arch, follow))


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_next"])
def test_states_of_batched_rows_round_trip_as_a_single_sequences_do(arch, tmp_path):
    prompts = [random_prompt(70, seed=s) for s in (1, 2)]
    first = started(arch, tmp_path)
    answers = hf2q_py.batch_generate(first, prompts, max_tokens=10, method="baseline")
    first.prompt_cache.flush()
    for prompt, answer in zip(prompts, answers):
        conversation = prompt + answer.tokens[:-1]
        follow = prompt + answer.tokens + [4, 5, 6]
        assert_same_state(from_disk(arch, tmp_path, follow), held(first, conversation))
        got = generate(started(arch, tmp_path), follow)
        assert got.stats.cached_tokens == len(conversation)
        assert_same_greedy(first.model, follow, got.tokens, cold(arch, follow))


def test_a_bfloat16_model_round_trips_and_its_dtype_is_part_of_the_key(tmp_path, caplog):
    def bf16_target() -> Target:
        t = tiny_target("llama", scale=4.0)
        t.model.set_dtype(mx.bfloat16)
        return with_disk(t, tmp_path)

    prompt = random_prompt(70)
    first = bf16_target()
    answer = generate(first, prompt)
    conversation = prompt + answer.tokens[:-1]
    follow = prompt + answer.tokens + [5, 6, 7]
    assert generate(bf16_target(), follow).stats.cached_tokens == len(conversation)
    assert_same_state(
        bf16_target().prompt_cache.disk.lookup(follow, len(follow) - 1)[0], held(first, conversation)
    )
    with caplog.at_level(logging.INFO, logger=LOG):
        assert generate(started("llama", tmp_path), follow).stats.cached_tokens == 0  # float32: other names
    assert cache_log(caplog) == []


def test_the_disk_is_read_only_when_memory_falls_short_and_what_it_gives_joins_memory(tmp_path):
    target = started("qwen3_next", tmp_path)
    prompt = random_prompt(70)
    first = generate(target, prompt)
    assert generate(target, prompt).stats.cached_tokens == 69  # from memory
    assert target.prompt_cache.disk.stats.hits == 0
    target.prompt_cache.clear()
    again = generate(target, prompt)
    assert again.stats.cached_tokens == 69 and target.prompt_cache.disk.stats.hits == 1
    assert generate(target, prompt).stats.cached_tokens == 69
    assert target.prompt_cache.disk.stats.hits == 1
    assert again.tokens == first.tokens


def test_a_folder_removed_while_running_is_made_again(tmp_path):
    import shutil

    folder = tmp_path / "cache"
    target = started("llama", folder)
    prompt = random_prompt(70)
    generate(target, prompt)
    shutil.rmtree(folder)
    target.prompt_cache.clear()
    assert generate(target, prompt).stats.cached_tokens == 0
    assert files(folder, "b-")
    assert generate(started("llama", folder), prompt).stats.cached_tokens == 64


# -- blocks -----------------------------------------------------------------------
def test_prompts_sharing_a_prefix_store_its_blocks_once_and_a_growing_conversation_writes_only_new_ones(
    tmp_path,
):
    target = started("llama", tmp_path)
    system = random_prompt(48, seed=1)  # three blocks
    generate(target, system + random_prompt(20, seed=2), n=4)  # 71 tokens kept: 4 blocks and a tail
    before, written = files(tmp_path), target.prompt_cache.disk.stats.files_written
    assert len(files(tmp_path, "b-")) == 4 and len(files(tmp_path, "t-")) == 1

    second = system + random_prompt(20, seed=3)
    answer = generate(target, second, n=4)
    new = files(tmp_path) - before
    assert len([n for n in new if n.startswith("b-")]) == 1  # the system prompt's blocks were there
    assert len([n for n in new if n.startswith("t-")]) == 1
    assert target.prompt_cache.disk.stats.files_written - written == 2

    before, written = files(tmp_path), target.prompt_cache.disk.stats.files_written
    generate(target, second + answer.tokens + random_prompt(30, seed=4), n=4)  # 71 -> 104 tokens
    assert len(files(tmp_path, "b-") - before) == 2  # blocks 5 and 6 only
    assert target.prompt_cache.disk.stats.files_written - written == 3

    other = system + random_prompt(30, seed=5)
    got = generate(started("llama", tmp_path), other, n=4)
    assert got.stats.cached_tokens == 48
    assert_same_greedy(target.model, other, got.tokens, cold("llama", other, 4))


def test_the_disk_keeps_its_bytes_least_recently_used_out(tmp_path):
    prompts = [random_prompt(40, seed=s) for s in range(3)]
    probe = started("llama", tmp_path / "probe")
    generate(probe, prompts[0], n=4)
    one = sum(p.stat().st_size for p in (tmp_path / "probe").iterdir())
    bound = int(one * 2.5)
    folder = tmp_path / "bounded"
    for p in prompts[:2]:
        generate(started("llama", folder, max_bytes=bound), p, n=4)
    assert generate(started("llama", folder, max_bytes=bound), prompts[0], n=4).stats.cached_tokens == 32
    generate(started("llama", folder, max_bytes=bound), prompts[2], n=4)  # over the bound: prompts[1] goes

    assert sum(p.stat().st_size for p in folder.iterdir()) <= bound
    reused = [generate(started("llama", folder), p, n=4).stats.cached_tokens for p in prompts]
    assert reused[0] == reused[2] == 32  # used last, and written last
    assert reused[1] < 32  # used least recently: its chain lost blocks from its end


def test_short_prompts_are_not_written(tmp_path):
    target = tiny_target("llama", scale=4.0)
    target.prompt_cache = PromptCache(disk=DiskCache(target, tmp_path))  # at least 256 tokens
    generate(target, random_prompt(70))
    assert files(tmp_path) == set()


# -- files that are not used -------------------------------------------------------
def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "a flipped data byte": flip,
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:-100]),
    "a garbage header": lambda p: p.write_bytes(b"\xff" * 16 + p.read_bytes()[16:]),
    "empty": lambda p: p.write_bytes(b""),
}


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize(
    ("arch", "which", "reused"),
    [
        ("llama", "block", 32),  # the two blocks before it
        ("qwen3_next", "tail", 69),  # the prompt's own tail, found next
        ("qwen3_next", "block", 0),  # no tail is reachable past a broken chain
    ],
)
def test_a_damaged_file_is_skipped_with_one_log_line_and_removed(
    tmp_path, caplog, damage, arch, which, reused
):
    prompt = random_prompt(70)
    first = started(arch, tmp_path)
    answer = generate(first, prompt)
    disk = first.prompt_cache.disk
    conversation = prompt + answer.tokens[:-1]
    chain = disk.chain(conversation, 5)
    if which == "block":  # the third block
        name = block_name(chain[3])
    else:  # the conversation's tail (81 tokens); the prompt's (69) is still there
        (name,) = [n for n in files(tmp_path, "t-") if n.startswith(f"t-{chain[5]}")]
    DAMAGE[damage](tmp_path / name)

    follow = conversation + [answer.tokens[-1], 9, 8, 7]
    with caplog.at_level(logging.INFO, logger=LOG):
        got = generate(started(arch, tmp_path), follow)
    (line,) = cache_log(caplog)
    assert "skipped" in line and name in line
    assert got.stats.cached_tokens == reused
    assert not (tmp_path / name).exists() or read_file(
        tmp_path / name
    )  # removed (written whole again if needed)
    assert_same_greedy(first.model, follow, got.tokens, cold(arch, follow))


def rewrite(path: Path, **metadata: str) -> None:
    """The file written again with some metadata changed (its checksum still right)."""
    arrays, meta = read_file(path)
    write_file(path, arrays, {**meta, **metadata})


def test_another_models_files_are_never_read_and_one_under_this_models_name_is_skipped(tmp_path, caplog):
    prompt = random_prompt(70)
    generate(started("llama", tmp_path, seed=0), prompt)
    other = started("llama", tmp_path, seed=1)  # other weights, same shapes
    with caplog.at_level(logging.INFO, logger=LOG):
        assert generate(other, prompt).stats.cached_tokens == 0
    assert cache_log(caplog) == []  # its names never match

    theirs = started("llama", tmp_path, seed=0).prompt_cache.disk
    ours = other.prompt_cache.disk
    foreign = tmp_path / block_name(theirs.chain(prompt, 1)[1])
    target = tmp_path / block_name(ours.chain(prompt, 1)[1])
    target.unlink()
    foreign.rename(target)
    rewrite(target, parent=ours.root, root=ours.root)  # as if it belonged to this chain
    with caplog.at_level(logging.INFO, logger=LOG):
        got = generate(started("llama", tmp_path, seed=1), prompt)
    (line,) = cache_log(caplog)
    assert "another model" in line and target.name in line
    assert got.stats.cached_tokens == 0
    assert read_file(target)[1]["model"] == ours.model  # removed, and written again by this model


def test_a_file_of_another_cache_layout_is_skipped_with_one_log_line(tmp_path, caplog):
    prompt = random_prompt(70)
    generate(started("llama", tmp_path), prompt)
    disk = started("llama", tmp_path).prompt_cache.disk
    path = tmp_path / block_name(disk.chain(prompt, 2)[2])
    rewrite(path, layout="0" * 32)
    with caplog.at_level(logging.INFO, logger=LOG):
        got = generate(started("llama", tmp_path), prompt)
    (line,) = cache_log(caplog)
    assert "another cache layout" in line and path.name in line
    assert got.stats.cached_tokens == 16


def quantized(snap: Snapshot, bits: int) -> Snapshot:
    """``snap`` with every key and value stored as ``(packed, scales, biases)``."""
    layers = []
    for layer in snap.layers:
        arrays = tuple(tuple(mx.quantize(a, group_size=32, bits=bits)) for a in layer.arrays)
        nbytes = sum(a.nbytes for _, a in leaves(arrays))
        layers.append(LayerState(layer.kind, arrays, layer.offset, nbytes))
    return Snapshot(snap.tokens, tuple(layers))


def test_nested_quantized_arrays_round_trip_and_another_quantization_never_matches(
    tmp_path, monkeypatch, caplog
):
    tokens = tuple(random_prompt(40))
    kv = tuple(mx.random.normal((1, 2, 40, 64), key=mx.random.key(i)) for i in range(2))
    plain = Snapshot(tokens, tuple(LayerState("kv", kv, 40, 0) for _ in range(3)))
    eight, four = quantized(plain, 8), quantized(plain, 4)
    target = tiny_target("llama")

    def disk_for(snap: Snapshot) -> DiskCache:
        monkeypatch.setattr(disk_cache, "probe_layout", lambda t: layout_of(snap.layers))
        return DiskCache(target, tmp_path, block_tokens=BLOCK, min_tokens=BLOCK)

    writer = disk_for(eight)
    writer.add(eight)
    writer.flush()
    got, n = disk_for(eight).lookup(list(tokens), 40)
    assert n == 40
    assert_same_state(got, eight)
    with caplog.at_level(logging.INFO, logger=LOG):
        assert disk_for(four).lookup(list(tokens), 40) == (None, 0)
    assert cache_log(caplog) == []


WRITER = """
import sys
import numpy as np
from pathlib import Path
import hf2q_py
from hf2q_py.cache_file import Host, write_file

path, n = Path(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
for i in range(n):
    data = rng.standard_normal((64, 1024 * (1 + i % 4))).astype(np.float32)
    write_file(path, {"x": Host(data, "F32")}, {"i": str(i)})
"""


def test_a_reader_never_sees_a_file_another_process_is_writing(tmp_path):
    path = tmp_path / "b-0123456789abcdef0123456789abcdef.safetensors"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "150"])
    seen = set()
    while proc.poll() is None:
        try:
            arrays, meta = read_file(path)  # raises CacheFileError on a partial file
        except FileNotFoundError:
            continue
        assert arrays["x"].data.shape[0] == 64
        seen.add(meta["i"])
    assert proc.returncode == 0 and len(seen) > 1
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_file_checks_name_what_is_wrong(tmp_path):
    path = tmp_path / "f.safetensors"
    write_file(path, {"x": Host(np.arange(6, dtype=np.float32).reshape(2, 3), "F32")}, {})
    arrays, meta = read_file(path)
    assert arrays["x"].data.tolist() == [[0, 1, 2], [3, 4, 5]] and meta["format"] == "hf2q-prompt-cache"
    header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    header["x"]["shape"] = [3, 3]
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + path.read_bytes()[-24:])
    with pytest.raises(CacheFileError, match="wrong size"):
        read_file(path)


# -- the library ------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_save_cache_and_load_cache_carry_the_prompt_cache_to_another_target(arch, tmp_path):
    target = tiny_target(arch, scale=4.0)
    target.prompt_cache = PromptCache()
    prompt = random_prompt(40)
    answer = generate(target, prompt)
    assert target.save_cache(tmp_path / "saved") == len(target.prompt_cache)

    other = tiny_target(arch, scale=4.0)
    assert other.load_cache(tmp_path / "saved") == len(target.prompt_cache)
    conversation = prompt + answer.tokens[:-1]
    assert_same_state(held(other, conversation), held(target, conversation))
    follow = prompt + answer.tokens + [1, 2, 3]
    got = generate(other, follow)
    assert got.stats.cached_tokens == len(conversation)
    assert got.tokens == generate(target, follow).tokens


def test_load_cache_refuses_another_models_damaged_or_missing_files_naming_them(tmp_path):
    target = tiny_target("llama", scale=4.0)
    target.prompt_cache = PromptCache()
    generate(target, random_prompt(40))
    saved = tmp_path / "saved"
    target.save_cache(saved)
    with pytest.raises(Hf2qError, match="another model"):
        Target.from_mlx_lm(tiny_model("llama", seed=1, scale=4.0)).load_cache(saved)
    victim = sorted(saved.iterdir())[0]
    flip(victim)
    with pytest.raises(Hf2qError, match=f"{victim.name}.*checksum"):
        tiny_target("llama", scale=4.0).load_cache(saved)
    (tmp_path / "empty").mkdir()
    with pytest.raises(Hf2qError, match="holds no prompt cache files"):
        target.load_cache(tmp_path / "empty")
    with pytest.raises(Hf2qError, match="no prompt cache folder"):
        target.load_cache(tmp_path / "nowhere")


def test_an_unwritable_directory_is_refused_naming_it(tmp_path):
    (tmp_path / "file").write_text("x")
    target = tiny_target("llama")
    with pytest.raises(Hf2qError, match="cannot write to prompt cache directory .*file/sub"):
        DiskCache(target, tmp_path / "file" / "sub")
    with pytest.raises(Hf2qError, match="is not a folder"):
        DiskCache(target, tmp_path / "file")
    with pytest.raises(Hf2qError, match="block_tokens"):
        DiskCache(target, tmp_path, block_tokens=0)


# -- the server -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    from hub_server import tiny_mlx_files

    folder = tmp_path_factory.mktemp("tiny-llama")
    for name, data in tiny_mlx_files(seed=2).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def complete(server, ids: list[int]):
    client = openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(
        model="m", prompt=ids, max_tokens=16, temperature=0, extra_body={"hf2q": {"return_tokens": True}}
    )


def answer_of(r) -> tuple[list[int], int]:
    return r.model_extra["hf2q"]["tokens"], r.usage.prompt_tokens_details.cached_tokens


def test_a_restarted_server_answers_from_the_disk_as_a_cold_run_did(tiny_folder, tmp_path):
    ids = [int(i) for i in np.random.default_rng(1).integers(2, 512, 600)]
    cache = str(tmp_path / "cache")
    with running_server("--model", str(tiny_folder), "--prompt-cache-dir", cache) as s:
        tokens, cached = answer_of(complete(s, ids))
    assert cached == 0 and tokens
    with running_server("--model", str(tiny_folder), "--prompt-cache-dir", cache) as s:
        assert answer_of(complete(s, ids)) == (tokens, 512)  # four blocks of 128; the rest prefilled
        assert "hf2q_prompt_cache_disk_hits_total 1.0" in s.raw("GET", "/metrics")[2].decode()

    (second,) = [p for p in Path(cache).glob("b-*") if read_file(p)[1]["start"] == "256"]
    flip(second)
    with running_server("--model", str(tiny_folder), "--prompt-cache-dir", cache) as s:
        assert answer_of(complete(s, ids)) == (tokens, 256)
        assert s.alive()
    (line,) = [line for line in s.stderr().splitlines() if "skipped" in line]
    assert second.name in line and "checksum" in line

    with running_server("--model", str(tiny_folder), "--no-disk-cache") as s:
        assert answer_of(complete(s, ids)) == (tokens, 0)


def test_an_unwritable_prompt_cache_dir_is_a_one_line_error_before_the_model_loads(tmp_path):
    (tmp_path / "file").write_text("x")
    out = subprocess.run(
        server_command("--prompt-cache-dir", str(tmp_path / "file" / "sub")),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert "--prompt-cache-dir" in line and "file/sub" in line


@pytest.mark.slow
def test_the_built_in_models_long_prompt_comes_back_from_disk_after_a_restart(tmp_path):
    from hf2q_py.generation import encode_messages

    pasted = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}" for i in range(60))
    messages = [{"role": "system", "content": pasted}, {"role": "user", "content": "Which function adds 49?"}]
    cache = str(tmp_path / "cache")
    answers = []
    for _ in range(2):
        with running_server("--prompt-cache-dir", cache) as s:
            client = openai.OpenAI(base_url=s.base, api_key="unused", max_retries=0, timeout=300)
            r = client.chat.completions.create(
                model="m",
                messages=messages,
                max_tokens=16,
                temperature=0,
                extra_body={"hf2q": {"return_tokens": True}},
            )
            answers.append(answer_of(r))
    (want, cold_cached), (got, cached) = answers
    assert cold_cached == 0 and cached >= 512
    smol = hf2q_py.load()
    assert_same_greedy(smol.model, encode_messages(smol, messages), got, want)


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_quantized_states_round_trip_through_the_disk_as_the_same_kv_layout(arch, tmp_path):
    from hf2q_py.kv import KVConfig

    def quantized_target() -> Target:
        target = tiny_target(arch, scale=2.0, head_dim=32)
        target.kv = KVConfig(8, 32, 0)
        return with_disk(target, tmp_path)

    prompt = random_prompt(70)
    first = quantized_target()
    answer = generate(first, prompt)
    restarted = quantized_target()
    again = generate(restarted, prompt)
    assert again.stats.cached_tokens == (64 if arch == "llama" else 69)
    assert restarted.prompt_cache.disk.stats.hits == 1
    if arch != "llama":  # the very state the cold prefill made (llama re-prefills the last 5)
        assert again.tokens == answer.tokens
    # a full-precision generation on the same target never reads the quantized states
    plain = hf2q_py.generate(quantized_target(), prompt, max_tokens=4, method="baseline", kv_bits=None)
    assert plain.stats.cached_tokens == 0
