"""What the prompt cache on disk saves after a restart: an agent's long
first request (a system prompt of N tokens and a short question) to a
freshly started ``hf2q-py serve``, cold, then to a second server process
started on the same ``--prompt-cache-dir``; the time to the first token of
each (streamed through the ``openai`` client, one token), the prompt tokens
the second reused, and the bytes the first wrote. Built-in model, float32.

    python benchmarks/bench_disk_cache.py [--tokens 4000] [--results benchmarks/results/disk_cache.json]
"""

from __future__ import annotations

import argparse
import inspect
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import hf2q_py  # first: loads OpenBLAS before mlx.core

import openai

from hf2q_py.errors import Hf2qError, run_script
from hf2q_py.generation import encode_messages
from hf2q_py.tools import results
from hf2q_py.tools.files import check_writable

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cache: Path, log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "hf2q_py", "serve", "--port", str(port), "--prompt-cache-dir", str(cache)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Hf2qError(f"the server exited at start (status {proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.25)
    proc.kill()
    raise Hf2qError(f"the server did not start in {START_SECONDS} s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()  # the server writes what it queued before it exits
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    if args.tokens < 300:
        raise Hf2qError("--tokens must be at least 300")
    if args.results:
        check_writable(args.results, "--results file")
    target = hf2q_py.load()
    messages = agent_messages(target, args.tokens)
    prompt_tokens = len(encode_messages(target, messages))
    runs = {}
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryFile("w+") as log:
        cache = Path(d) / "cache"
        for name in ("cold", "after a restart"):
            proc, url = start(cache, log)
            try:
                runs[name] = first_token(url, messages)
            finally:
                stop(proc)
            if name == "cold":
                files = list(cache.iterdir())
                written = sum(p.stat().st_size for p in files)
    (cold, _), (warm, reused) = runs["cold"], runs["after a restart"]
    row = [str(prompt_tokens), f"{cold:.2f}", f"{warm:.2f}", f"{warm / cold:.1%}", str(reused),
           f"{written / 2**20:.1f}", str(len(files))]  # fmt: skip
    cols = ["prompt tokens", "cold TTFT s", "TTFT after a restart s", "after / cold", "reused tokens",
            "written MiB", "files"]  # fmt: skip
    notes = (
        "Built-in SmolLM2-135M-Instruct, float32, hf2q-py serve at its defaults with --prompt-cache-dir "
        "a new folder; each request is the first one of a freshly started server process (streamed, one "
        "token); the second server starts on the folder the first wrote. One run each."
    )
    rec = results.record(
        shlex.join(["python", *sys.argv]),
        [results.table(cols, [row], "rrrrrrr")],
        notes=notes,
        data={
            "prompt_tokens": prompt_tokens,
            "cold": cold,
            "restart": warm,
            "reused": reused,
            "written": written,
        },
    )
    results.publish(rec, args.results)


if __name__ == "__main__":
    run_script(main)
