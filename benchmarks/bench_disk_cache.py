"""What the prompt cache on disk saves after a restart: an agent's long
first request to a freshly started ``hf2q-py serve``, cold, then to a second
server process started on the same ``--prompt-cache-dir``; the time to the
first token of each (streamed, one token), the prompt tokens the second
reused, and the bytes the first wrote.

The request is either a captured agent request (``--request``: Claude
Code's first request from ``tests/fixtures/agents/``, sent as it was to
``/v1/messages``, its billing nonce fresh each time) or a system prompt of
``--tokens`` tokens of standard-library source and a short question (chat
completions). ``--model``: the served model (default the built-in one);
``--serve-args``: more flags for both servers (e.g. ``--kv-bits 8``).

    python benchmarks/bench_disk_cache.py [--tokens 4000] [--results benchmarks/results/disk_cache.json]
    python benchmarks/bench_disk_cache.py --model MODEL.gguf \
        --request tests/fixtures/agents/claude_code_messages.json [--results ...]
"""

from __future__ import annotations

import argparse
import inspect
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import hf2q_py  # first: loads OpenBLAS before mlx.core

import openai


from hf2q_py.errors import Hf2qError, run_script
from hf2q_py.generation import encode_messages
from hf2q_py.tools import results
from hf2q_py.tools.files import check_writable

sys.path.insert(0, str(Path(__file__).parent))
from bench_server import free_port, wait_ready  # noqa: E402

START_SECONDS = 300


def agent_messages(target, n_tokens: int) -> list[dict]:
    """A system prompt of about ``n_tokens`` tokens (standard-library source
    standing in for an agent's instructions and tools) and a short question."""
    import json
    import textwrap

    ids: list[int] = []
    for module in (json.decoder, json.encoder, textwrap, inspect):
        ids += target.tokenizer.encode(inspect.getsource(module))
        if len(ids) >= n_tokens:
            break
    system = target.tokenizer.decode(ids[: n_tokens - 40])
    return [{"role": "system", "content": system}, {"role": "user", "content": "Which module is this?"}]


def start(cache: Path, log, flags: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "hf2q_py",
        "serve",
        "--port",
        str(port),
        "--prompt-cache-dir",
        str(cache),
        *flags,
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url, "the server", START_SECONDS)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()  # the server writes what it queued before it exits
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def fresh_nonce(body: dict) -> dict:
    """``body`` with a new billing nonce, as Claude Code sends on every request."""
    import json
    import re
    import secrets

    text = re.sub(r"cch=[0-9a-f]{5};", lambda m: f"cch={secrets.token_hex(3)[:5]};", json.dumps(body))
    return json.loads(text)


def first_event(url: str, body: dict) -> tuple[float, int, int]:
    """A captured Messages request, streamed with ``max_tokens`` 1: seconds to
    its first content event, the prompt tokens, and those read from the cache."""
    import json
    import http.client

    body = {**fresh_nonce(body), "max_tokens": 1, "stream": True}
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=3600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/messages?beta=true", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise Hf2qError(f"the server answered {resp.status}: {resp.read()[:300]!r}")
    ttft, usage = None, {}
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        event = json.loads(line[5:])
        if ttft is None and event["type"] in ("content_block_start", "content_block_delta", "message_delta"):
            ttft = time.perf_counter() - t0
        usage.update(event.get("message", {}).get("usage", {}) | event.get("usage", {}))
    conn.close()
    read = usage.get("cache_read_input_tokens", 0) or 0
    return ttft, usage.get("input_tokens", 0) + read, read


def first_token(url: str, messages: list[dict]) -> tuple[float, int]:
    """Seconds to the first streamed text, and the prompt tokens reused."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)
    t0 = time.perf_counter()
    ttft, cached = None, 0
    stream = client.chat.completions.create(
        model="m", messages=messages, max_tokens=1, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if (
            ttft is None
            and chunk.choices
            and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason)
        ):
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return ttft, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4000, help="system prompt tokens (default 4000)")
    ap.add_argument("--request", default=None, help="a captured agent request (tests/fixtures/agents/*.json)")
    ap.add_argument("--model", default=None, help="the served model (default: the built-in one)")
    ap.add_argument("--serve-args", default="", help="more flags for both servers, e.g. '--kv-bits 8'")
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    if args.tokens < 300:
        raise Hf2qError("--tokens must be at least 300")
    if args.results:
        check_writable(args.results, "--results file")
    flags = shlex.split(args.serve_args) + (["--model", args.model] if args.model else [])
    ask, prompt_tokens = request(args)
    runs, written, files = {}, 0, []
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryFile("w+") as log:
        cache = Path(d) / "cache"
        for name in ("cold", "after a restart"):
            proc, url = start(cache, log, flags)
            try:
                runs[name] = ask(url)
            finally:
                stop(proc)
            if name == "cold":
                files = list(cache.iterdir())
                written = sum(p.stat().st_size for p in files)
    publish(args, prompt_tokens or runs["cold"][1], runs, written, len(files))


def request(args) -> tuple:
    """How to ask a server for the first token (-> seconds, prompt tokens,
    reused tokens), and the prompt's tokens where known beforehand."""
    import json

    if args.request:
        body = json.loads(Path(args.request).read_text())["body"]
        return (lambda url: first_event(url, body)), None
    target = hf2q_py.load(args.model) if args.model else hf2q_py.load()
    messages = agent_messages(target, args.tokens)
    n = len(encode_messages(target, messages))

    def ask(url: str) -> tuple[float, int, int]:
        ttft, reused = first_token(url, messages)
        return ttft, n, reused

    return ask, n


def publish(args, prompt_tokens: int, runs: dict, written: int, files: int) -> None:
    (cold, _, _), (warm, _, reused) = runs["cold"], runs["after a restart"]
    row = [str(prompt_tokens), f"{cold:.2f}", f"{warm:.2f}", f"{warm / cold:.1%}", str(reused),
           f"{written / 2**20:.1f}", str(files)]  # fmt: skip
    cols = ["prompt tokens", "cold TTFT s", "TTFT after a restart s", "after / cold", "reused tokens",
            "written MiB", "files"]  # fmt: skip
    what = f"the captured request {Path(args.request).name} to /v1/messages" if args.request else (
        f"a {args.tokens}-token system prompt and a question to /v1/chat/completions")  # fmt: skip
    notes = (
        f"{args.model or 'built-in SmolLM2-135M-Instruct'}, float32, hf2q-py serve {args.serve_args} with "
        f"--prompt-cache-dir a new folder; {what}; each request is the first one of a freshly started "
        "server process (streamed, one token); the second server starts on the folder the first wrote. "
        "One run each."
    )
    data = {
        "prompt_tokens": prompt_tokens,
        "cold": cold,
        "restart": warm,
        "reused": reused,
        "written": written,
    }
    rec = results.record(shlex.join(["python", *sys.argv]), [results.table(cols, [row], "rrrrrrr")],
                         notes=notes, data=data)  # fmt: skip
    results.publish(rec, args.results)


if __name__ == "__main__":
    run_script(main)
