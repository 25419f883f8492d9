"""Sharded targets under ``mlx.launch -n 2 --backend ring`` on loopback: every
method's tokens on two ranks equal one process's, the command line prints on
rank 0 alone, and models that cannot shard are refused in one line."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
from gguf_export import export
from helpers import assert_same_greedy
from models import tiny_target
from prometheus_client.parser import text_string_to_metric_families
from server_process import running_server

import hf2q_py

from hf2q_py.distributed import plan
from hf2q_py.errors import UnsupportedModelError
from hf2q_py.tools.dflash_make import drafter_for, save_drafter

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent
LAUNCH = BIN / "mlx.launch"
HF2Q = BIN / "hf2q-py"
TIMEOUT = 300
TOKENS = {"hf2q": {"return_tokens": True}}
CODE = "def f(x):\n    return x\ndef f(x):\n"
#: What distributed_run.py's ranks compare with each other only (not with one process).
BETWEEN_RANKS = ("unseeded", "/sizes", "/cached")


def free_port() -> int:
    """A loopback port with the next one free as well (the ring takes one per rank)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two free ports in a row")


def launch(*command: str, ranks: int = 2) -> subprocess.CompletedProcess:
    """``command`` on ``ranks`` local ranks, as a user starts it."""
    argv = [str(LAUNCH), "-n", str(ranks), "--backend", "ring", "--starting-port", str(free_port())]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run([*argv, *command], capture_output=True, text=True, timeout=TIMEOUT, env=env)


def alone(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def error_lines(stderr: str) -> list[str]:
    """hf2q-py's own lines (mlx.launch adds its own about each rank's exit)."""
    return [line for line in stderr.splitlines() if line.startswith("hf2q-py")]


def test_every_method_on_two_ranks_gives_the_tokens_of_one(tmp_path):
    """Greedy and seeded sampling, tensor and pipeline, rollback on sliding
    windows (gpt-oss) and recurrent layers (qwen3-next), alone and batched;
    unseeded sampling and the batch sizes agree between the ranks, and a
    prompt-cache state one rank lacks is reused by neither."""
    drafter = tmp_path / "drafter"
    target = tiny_target("llama", seed=1, scale=2.0)
    save_drafter(drafter_for(target, layers=1, target_layer_ids=(1, 3), block_size=8), drafter)
    script = str(HERE / "distributed_run.py")
    one = json_lines(alone(sys.executable, script, str(drafter)).stdout)[0]
    proc = launch(sys.executable, script, str(drafter))
    ranks = json_lines(proc.stdout)
    assert len(ranks) == 2, proc.stderr[-3000:]
    assert {r["rank"] for r in ranks} == {0, 1} and all(r["ranks"] == 2 for r in ranks)
    for r in ranks:
        for name, tokens in one.items():
            if name.endswith(BETWEEN_RANKS) or name in ("rank", "ranks"):
                continue
            if name.startswith("qwen2/pipeline/") and name.endswith(("layerskip", "dflash")):
                assert "a pipeline-sharded rank holds only some" in r[name]  # refused alike
            else:
                assert r[name] == tokens, (r["rank"], name)
    for name in (n for n in one if n.endswith(BETWEEN_RANKS)):
        assert ranks[0][name] == ranks[1][name], name
    for name in (n for n in one if n.endswith("/sizes")):
        assert any(int(size) > 1 for size in ranks[0][name]), (name, ranks[0][name])  # rounds were shared
    cached = ranks[0]["llama/tensor/prompt_cache/cached"]
    assert one["llama/tensor/prompt_cache/cached"][1] > 0 and cached[1] == 0 and cached[2] > 0, cached


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "llama.gguf"
    export(path, "llama", seed=4)
    return path


def generate_args(model: Path, method: str) -> list[str]:
    return [
        "generate", "--model", str(model), "--method", method, "--max-tokens", "24",
        "--no-chat-template", "--prompt", "def f(x):\n    return x\ndef f(x):\n", "--json",
    ]  # fmt: skip


def test_generate_under_mlx_launch_prints_once_and_names_its_ranks(tiny_gguf):
    one = json_lines(alone(str(HF2Q), *generate_args(tiny_gguf, "ngram")).stdout)[0]
    proc = launch(str(HF2Q), *generate_args(tiny_gguf, "ngram"))
    printed = json_lines(proc.stdout)
    assert len(printed) == 1, proc.stdout + proc.stderr[-2000:]
    assert printed[0]["tokens"] == one["tokens"]
    assert (printed[0]["ranks"], printed[0]["shard"]) == (2, "tensor")
    assert (one["ranks"], one["shard"]) == (1, "none")


def test_ab_under_mlx_launch_finds_every_method_identical(tiny_gguf):
    proc = launch(
        str(HF2Q), "ab", "--model", str(tiny_gguf), "--methods", "ngram,layerskip", "--max-tokens", "16",
        "--no-chat-template", "--prompt", "abc abc abc", "--json",
    )  # fmt: skip
    printed = json_lines(proc.stdout)
    assert len(printed) == 1, proc.stdout + proc.stderr[-2000:]
    verdicts = [r["verdict"] for r in printed[0]["results"]]
    assert verdicts and all(v == "identical" for v in verdicts), verdicts


@pytest.mark.parametrize(
    "flags, words",
    [
        ([], ["llama", "9 attention heads", "divide by 2"]),  # the built-in model
        (["--shard", "pipeline"], ["llama", "no pipeline split"]),
    ],
)
def test_a_model_that_cannot_shard_is_refused_in_one_line(flags, words):
    proc = launch(str(HF2Q), "generate", "--prompt", "hi", "--max-tokens", "4", *flags)
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and not proc.stdout.strip()
    for w in words:
        assert w in lines[0], lines[0]


def test_shard_plans_name_the_reason():
    base = dict(model_type="qwen2", num_hidden_layers=4, num_attention_heads=14, num_key_value_heads=2)
    assert plan({**base, "intermediate_size": 4864}, "auto", 2) == "tensor"
    assert plan({**base, "intermediate_size": 4864}, "auto", 4) == "pipeline"  # 14 heads, 4 ranks
    with pytest.raises(UnsupportedModelError, match="4 layers, fewer than the 8 ranks"):
        plan(base, "pipeline", 8)
    with pytest.raises(UnsupportedModelError, match="gemma4_text cannot be sharded"):
        plan(dict(model_type="gemma4_text", num_hidden_layers=4), "auto", 2)


def launcher() -> list[str]:
    return [str(LAUNCH), "-n", "2", "--backend", "ring", "--starting-port", str(free_port())]


def test_serve_under_mlx_launch_answers_as_one_process_would_and_stops_on_ctrl_c(tiny_gguf):
    """Rank 0 answers HTTP while both ranks run each request: greedy answers
    equal one process's, a retried request drafts from the first answer on
    both ranks, a client leaving mid-stream ends the job on both ranks."""
    alone_target = hf2q_py.load(tiny_gguf)
    prompt = "def f(x):\n    return x\ndef f(x):\n"
    ids = hf2q_py.encode_prompt(alone_target, prompt, chat_template=False)
    want = hf2q_py.generate(alone_target, ids, max_tokens=24, method="ngram").tokens
    want_sampled = hf2q_py.generate(
        alone_target, ids, max_tokens=24, method="ngram", temperature=0.8, seed=5
    ).tokens
    with running_server("--model", str(tiny_gguf), "--method", "ngram", launcher=launcher()) as s:
        client = openai.OpenAI(base_url=s.base, api_key="unused", max_retries=0, timeout=120)

        def complete(method: str | None = None):
            extra = {"hf2q": {**TOKENS["hf2q"], **({"method": method} if method else {})}}
            r = client.completions.create(
                model="llama", prompt=prompt, max_tokens=24, temperature=0, extra_body=extra
            )
            return r.model_extra["hf2q"]

        first = complete()
        assert first["tokens"] == want, s.stderr()[-3000:]
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        body = {"model": "llama", "prompt": "a b c", "max_tokens": 4000, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        conn.getresponse().read1(100)
        conn.sock.close()
        conn.close()
        # a fixed K: how far adaptive K drafts depends on both ranks' timings, not on the memory
        again = complete("ngram:fixed")
        assert again["tokens"] == want, s.stderr()[-3000:]
        assert again["accepted"] >= len(want) - 2  # drafted from the first answer, on both ranks
        time.sleep(0.5)  # idle ticks between requests
        sampled = client.completions.create(
            model="llama", prompt=prompt, max_tokens=24, temperature=0.8, seed=5, extra_body=TOKENS
        )
        assert sampled.model_extra["hf2q"]["tokens"] == want_sampled
    # Ctrl-C: rank 0 stops the other rank and both exit; mlx.launch itself
    # ends on the KeyboardInterrupt, its ranks within moments of it.
    deadline = time.monotonic() + 15
    while session_alive(s.process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not session_alive(s.process.pid)
    assert "hf2q_py" not in s.stderr() and "error" not in s.stderr().lower(), s.stderr()[-3000:]


def session_alive(session: int) -> bool:
    try:
        os.killpg(session, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_sharded_server_batches_concurrent_clients_with_its_ranks_in_step(tiny_gguf):
    """Every rank steps the same scheduler: two clients at once share batched
    forwards beside a third (rounds of 2 in /metrics), each answer equal to
    the same request alone and to one process's; the third leaving mid-stream
    ends its row on both ranks; a request's errors, before the ranks see it
    and after, leave them serving; the served draft model (sent by name)
    drafts on both; Ctrl-C stops both."""
    model = hf2q_py.load(tiny_gguf)
    asks = {"a": (CODE, 40), "b": ("class A:\n    def f(self):\n        return 1\nclass B(A):\n", 24)}
    ids = {k: hf2q_py.encode_prompt(model, p, chat_template=False) for k, (p, _) in asks.items()}
    want = {
        k: hf2q_py.generate(model, ids[k], max_tokens=n, method="ngram").tokens for k, (_, n) in asks.items()
    }
    flags = ("--model", str(tiny_gguf), "--method", "ngram", "--draft-model", str(tiny_gguf))
    with running_server(*flags, launcher=launcher()) as s:
        client = openai.OpenAI(base_url=s.base, api_key="unused", max_retries=0, timeout=120)

        def complete(key: str, **extra) -> list[int]:
            prompt, n = asks[key]
            r = client.completions.create(
                model="llama", prompt=prompt, max_tokens=n, temperature=0, extra_body={**TOKENS, **extra}
            )
            return r.model_extra["hf2q"]["tokens"]

        for key in asks:
            assert complete(key) == want[key], s.stderr()[-3000:]  # alone: as one process
        before = batch_rounds(s)
        leaving = open_stream(s, "a b c", 4000, "baseline")  # generating until it leaves
        got: dict[str, list[int]] = {}
        clients = [threading.Thread(target=lambda k=k: got.update({k: complete(k)})) for k in asks]
        for t in clients:
            t.start()
        deadline = time.monotonic() + 120
        while batch_rounds(s).get(2, 0) == before.get(2, 0) and time.monotonic() < deadline:
            time.sleep(0.05)  # until a client's row shares the leaving one's forwards
        leaving.sock.close()
        leaving.close()
        for t in clients:
            t.join(120)
        for key in asks:
            assert_same_greedy(model.model, ids[key], got[key], want[key])
        assert batch_rounds(s).get(2, 0) > before.get(2, 0), batch_rounds(s)
        with pytest.raises(openai.BadRequestError, match="temperature"):  # refused before any rank runs it
            client.completions.create(model="llama", prompt=CODE, max_tokens=4, temperature=5)
        with pytest.raises(openai.BadRequestError, match="out of range"):  # every rank fails it alike
            complete("a", hf2q={**TOKENS["hf2q"], "method": "layerskip:skip_layers=[99]"})
        assert complete("a") == want["a"], s.stderr()[-3000:]
        drafted = complete("a", hf2q={**TOKENS["hf2q"], "method": "draft:k=4"})
        assert_same_greedy(model.model, ids["a"], drafted, want["a"])
    deadline = time.monotonic() + 15
    while session_alive(s.process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not session_alive(s.process.pid)
    assert "hf2q_py" not in s.stderr() and "error" not in s.stderr().lower(), s.stderr()[-3000:]


def open_stream(server, prompt: str, max_tokens: int, method: str) -> http.client.HTTPConnection:
    """A streamed completion whose first bytes are read: it is generating."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": "llama", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "hf2q": {"method": method}}  # fmt: skip
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    conn.getresponse().read1(100)
    return conn


def batch_rounds(server) -> dict[int, float]:
    """The server's batched forwards by batch size (from /metrics)."""
    raw = server.raw("GET", "/metrics")[2].decode()
    return {
        int(s.labels["size"]): s.value
        for f in text_string_to_metric_families(raw)
        for s in f.samples
        if s.name == "hf2q_batch_rounds_total"
    }
