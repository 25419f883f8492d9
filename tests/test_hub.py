"""Models named on the Hugging Face hub: names as users type them, the files a
name picks, and ``hf2q-py`` downloading from a stand-in hub on a loopback port
(``tests/hub_server.py``): once with progress, then from the cache (offline,
or with the hub gone), one-line refusals, a download cut mid-file, and
``serve`` under the repo id."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from hub_server import TOKEN, Cut, Hub, tiny_drafter_files, tiny_gguf_files, tiny_mlx_files
from server_process import running_server

from hf2q_py.errors import ModelLoadError
from hf2q_py.loaders.hub import HubName, choose_gguf, display_name, gguf_models, parse_source

GONE = "http://127.0.0.1:9"  # nothing listens there: the hub is gone
MLX_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


# -- names (no hub) ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, want",
    [
        ("owner/name", HubName("owner/name")),
        ("owner/name:Q4_K_M", HubName("owner/name", quant="Q4_K_M")),
        ("owner/name:q8_0", HubName("owner/name", quant="q8_0")),
        ("owner/name/sub/model-Q8_0.gguf", HubName("owner/name", file="sub/model-Q8_0.gguf")),
    ],
)
def test_hub_names_parse_as_llama_cpp_and_mlx_lm_take_them(text, want):
    assert parse_source(text) == want and str(want) == text


@pytest.mark.parametrize(
    "text", ["name", "a/b/c", "a/b/c.safetensors", "owner/na me", "owner/name:", "./x/y"]
)
def test_what_is_neither_a_path_nor_a_hub_name_is_refused(text):
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        parse_source(text)


def test_an_existing_folder_wins_over_a_hub_name(tmp_path, monkeypatch):
    (tmp_path / "owner" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_source("owner/name") == Path("owner/name")
    assert display_name("owner/name") == "name" and display_name("owner/other:Q8_0") == "owner/other:Q8_0"
    assert display_name("/models/x.Q4_1.gguf") == "x.Q4_1"


REPO = [
    "README.md",
    "model-Q4_K_M.gguf",
    "model-Q8_0.gguf",
    "model-IQ3_XXS.gguf",
    "mmproj-model-F16.gguf",
    "big/model-F16-00001-of-00002.gguf",
    "big/model-F16-00002-of-00002.gguf",
]


def test_gguf_models_group_split_parts_and_leave_out_vision_projectors():
    models = {m.quant: m.files for m in gguf_models(REPO)}
    assert models == {
        "F16": ("big/model-F16-00001-of-00002.gguf", "big/model-F16-00002-of-00002.gguf"),
        "IQ3_XXS": ("model-IQ3_XXS.gguf",),
        "Q4_K_M": ("model-Q4_K_M.gguf",),
        "Q8_0": ("model-Q8_0.gguf",),
    }


@pytest.mark.parametrize(
    "name, files",
    [
        ("o/r:q4_k_m", ("model-Q4_K_M.gguf",)),
        ("o/r:Q4", ("model-Q4_K_M.gguf",)),  # the only Q4_*
        ("o/r:f16", ("big/model-F16-00001-of-00002.gguf", "big/model-F16-00002-of-00002.gguf")),
        (
            "o/r/big/model-F16-00002-of-00002.gguf",
            ("big/model-F16-00001-of-00002.gguf", "big/model-F16-00002-of-00002.gguf"),
        ),
    ],
)
def test_a_quantization_or_a_file_picks_its_gguf(name, files):
    assert choose_gguf(parse_source(name), REPO).files == files


@pytest.mark.parametrize(
    "name, words",
    [
        ("o/r", ["several GGUF models", "F16, IQ3_XXS, Q4_K_M, Q8_0", "o/r:F16"]),
        ("o/r:Q5_K_M", ["no Q5_K_M GGUF file", "Q4_K_M"]),
        ("o/r/model-Q2_K.gguf", ["no file model-Q2_K.gguf"]),
    ],
)
def test_a_name_that_picks_no_one_gguf_is_refused_listing_what_is_there(name, words):
    with pytest.raises(ModelLoadError) as e:
        choose_gguf(parse_source(name), REPO)
    for w in words:
        assert w in str(e.value)


def test_a_repo_with_one_gguf_and_no_config_picks_it():
    assert choose_gguf(HubName("o/r"), ["README.md", "x.Q4_0.gguf"]).files == ("x.Q4_0.gguf",)


# -- downloads from the stand-in hub ---------------------------------------------------
@pytest.fixture(scope="module")
def hub():
    mlx, ggufs = tiny_mlx_files(), tiny_gguf_files(split="Q4_0")
    with Hub() as h:
        h.add("owner/tiny-mlx-model", mlx)
        h.add("owner/tiny-drafter", tiny_drafter_files(mlx))
        h.add("owner/tiny-gguf-repo", ggufs)
        h.add("owner/cut-model", tiny_mlx_files(vocab_size=48_000))  # weights past one download chunk
        h.add("owner/broken-model", mlx)
        h.add("owner/gated-model", mlx, gated=True)
        h.add("owner/private-model", mlx, private=True)
        yield h


def env(home: Path, endpoint: str, offline: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a user whose Hugging Face cache is ``home``."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    out.update(HF_HOME=str(home), HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="1" if offline else "0", **extra)
    return out


def run(environ: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hf2q_py", *args], env=environ, capture_output=True, text=True, timeout=300
    )


def generate(environ: dict[str, str], model: str, *flags: str) -> subprocess.CompletedProcess:
    return run(environ, "generate", "--model", model, "--prompt", "Hi", "--max-tokens", "4", *flags)


def fetched(hub: Hub, repo: str) -> list[str]:
    """The files of ``repo`` the hub sent (GETs), in order."""
    return [name for name, _ in hub.fetched(repo)]


def assert_one_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_a_hub_model_downloads_its_model_files_once_with_progress_then_loads_from_the_cache(hub, tmp_path):
    first = generate(env(tmp_path, hub.url), "owner/tiny-mlx-model", "--progress")
    assert first.returncode == 0, first.stderr
    assert "100%" in first.stderr  # huggingface_hub's bars
    assert set(fetched(hub, "owner/tiny-mlx-model")) == MLX_FILES  # not the README, not original/
    again = generate(env(tmp_path, hub.url), "owner/tiny-mlx-model")
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr
    assert len(fetched(hub, "owner/tiny-mlx-model")) == len(MLX_FILES)  # nothing downloaded twice
    for environ, flags in ((env(tmp_path, GONE, offline=True), ()), (env(tmp_path, GONE), ("--offline",))):
        offline = generate(environ, "owner/tiny-mlx-model", *flags)
        assert offline.returncode == 0 and offline.stdout == first.stdout, offline.stderr
    gone = generate(env(tmp_path, GONE), "owner/tiny-mlx-model")  # the hub unreachable: the cache serves
    assert gone.returncode == 0 and gone.stdout == first.stdout, gone.stderr


def test_a_quantization_downloads_only_its_file_and_works_offline_after(hub, tmp_path):
    first = generate(env(tmp_path, hub.url), "owner/tiny-gguf-repo:q8_0", "--json")
    assert first.returncode == 0, first.stderr
    assert first.stderr == ""  # quiet under --json
    assert json.loads(first.stdout)["stats"]["method"] == "ngram"
    assert fetched(hub, "owner/tiny-gguf-repo") == ["tiny-Q8_0.gguf"]
    offline = generate(env(tmp_path, GONE, offline=True), "owner/tiny-gguf-repo:Q8_0", "--json")
    assert offline.returncode == 0, offline.stderr
    assert json.loads(offline.stdout)["tokens"] == json.loads(first.stdout)["tokens"]
    assert_one_line(  # another quantization, with the hub gone: the cache does not hold it
        generate(env(tmp_path, GONE), "owner/tiny-gguf-repo:Q4_0"), "not in the local", "cannot be reached"
    )


def test_a_drafter_and_a_draft_model_come_from_the_hub_too(hub, tmp_path):
    dflash = generate(
        env(tmp_path, hub.url),
        "owner/tiny-mlx-model",
        "--method",
        "dflash",
        "--drafter",
        "owner/tiny-drafter",
    )
    assert dflash.returncode == 0, dflash.stderr
    assert set(fetched(hub, "owner/tiny-drafter")) == {"config.json", "model.safetensors"}  # not the README
    draft = generate(
        env(tmp_path, GONE, offline=True),
        "owner/tiny-mlx-model",
        "--method",
        "draft",
        "--draft-model",
        "owner/tiny-mlx-model",
    )
    assert draft.returncode == 0, draft.stderr
    assert_one_line(
        generate(
            env(tmp_path, hub.url),
            "owner/tiny-mlx-model",
            "--method",
            "dflash",
            "--drafter",
            "owner/no-drafter",
        ),
        "--drafter",
        "no such model on the hub",
    )


def test_a_split_gguf_downloads_every_part(hub, tmp_path):
    proc = generate(env(tmp_path, hub.url), "owner/tiny-gguf-repo:Q4_0")
    assert proc.returncode == 0, proc.stderr
    parts = [f for f in fetched(hub, "owner/tiny-gguf-repo") if "Q4_0" in f]
    assert parts == [f"tiny-Q4_0-{i:05d}-of-00005.gguf" for i in range(1, 6)]


def test_offline_a_model_not_in_the_cache_is_one_line_and_asks_the_hub_nothing(hub, tmp_path):
    before = len(hub.requests)
    assert_one_line(
        generate(env(tmp_path, hub.url, offline=True), "owner/tiny-mlx-model"),
        "not in the local",
        "HF_HUB_OFFLINE",
    )
    assert_one_line(generate(env(tmp_path, hub.url), "owner/tiny-mlx-model", "--offline"), "--offline")
    assert len(hub.requests) == before


@pytest.mark.parametrize(
    "model, words",
    [
        ("owner/no-such-model", ["no such model on the hub"]),
        ("owner/private-model", ["no such model on the hub", "private", "HF_TOKEN"]),
        ("owner/gated-model", ["gated model", "accept its terms", "HF_TOKEN"]),
        ("owner/tiny-gguf-repo", ["several GGUF models", "F16, Q4_0, Q8_0"]),  # the rest: choose_gguf's tests
    ],
)
def test_names_that_name_nothing_readable_are_one_line_errors(hub, tmp_path, model, words):
    assert_one_line(generate(env(tmp_path, hub.url), model), *words)


def test_a_gated_model_loads_with_a_token(hub, tmp_path):
    proc = generate(env(tmp_path, hub.url, HF_TOKEN=TOKEN), "owner/gated-model")
    assert proc.returncode == 0, proc.stderr


def test_a_download_cut_mid_file_resumes_where_it_stopped(hub, tmp_path):
    chunk = 10 << 20  # huggingface_hub writes what it received in chunks of 10 MiB
    assert len(hub.repos["owner/cut-model"].files["model.safetensors"]) > chunk + 100_000
    hub.cuts[("owner/cut-model", "model.safetensors")] = Cut(after=chunk + 100_000)
    proc = generate(env(tmp_path, hub.url), "owner/cut-model")
    assert proc.returncode == 0, proc.stderr
    ranges = [r for name, r in hub.fetched("owner/cut-model") if name == "model.safetensors"]
    assert ranges == [None, f"bytes={chunk}-"]


def test_a_broken_download_is_one_line_and_the_next_run_fetches_only_what_is_missing(hub, tmp_path):
    cut = hub.cuts[("owner/broken-model", "model.safetensors")] = Cut(after=1000, then=500)
    assert_one_line(generate(env(tmp_path, hub.url), "owner/broken-model"), "owner/broken-model", "500")
    before = len(fetched(hub, "owner/broken-model"))
    cut.then = None  # the server is mended
    proc = generate(env(tmp_path, hub.url), "owner/broken-model")
    assert proc.returncode == 0, proc.stderr
    assert fetched(hub, "owner/broken-model")[before:] == ["model.safetensors"]  # the rest came before


# -- serve -------------------------------------------------------------------------------
def test_serve_names_a_hub_model_by_its_repo_id_and_answers_any_model_name(hub, tmp_path, monkeypatch):
    for key, value in env(tmp_path, hub.url).items():
        monkeypatch.setenv(key, value)
    with running_server("--model", "owner/tiny-mlx-model", "--max-tokens", "4") as server:
        client = openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=60)
        (card,) = client.models.list().data
        assert card.id == "owner/tiny-mlx-model" and card.model_extra["max_model_len"] == 4096
        for asked in ("owner/tiny-mlx-model", "gpt-4o", "anything"):
            r = client.chat.completions.create(model=asked, messages=[{"role": "user", "content": "Hi"}])
            assert r.model == "owner/tiny-mlx-model" and r.usage.completion_tokens >= 1
