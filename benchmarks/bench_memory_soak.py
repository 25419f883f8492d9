"""A memory soak: concurrent long agent sessions against one ``hf2q-py
serve --memory-budget`` for some minutes, and what the server's memory does.

Each session is an agent-like conversation: a long system prompt (standard-
library source standing in for an agent's instructions and tools, different
per session), then turns that append the model's answer and a new request,
each turn streamed with the ``max_tokens`` agents ask (32,000, cut by the
server to what the context and the budget leave). A session whose
conversation outgrows the context starts over (as an agent compacts). A 429
(the documented answer of a full memory queue) is retried after a second,
as agent clients do. A sampler reads the server's ``/metrics`` (MLX's
active and peak memory, bytes held by kind, requests waiting for memory)
and the process's resident memory every ``--interval`` seconds.

Reported: per time slice, the highest MLX active memory, MLX peak memory
since start, resident memory, KV reserved and requests waiting; requests
sent, finished, refused with 429, other errors by status and requests lost
(no answer); the verdict: the peak within the budget, nothing failed but
the documented 429s.

    python benchmarks/bench_memory_soak.py [--model PATH] [--budget 3GB] [--sessions 8] [--minutes 10]
        [--system-tokens 3000] [--max-tokens 32000] [--results benchmarks/results/memory_soak.json]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import hf2q_py  # first: loads OpenBLAS before mlx.core

import openai
from prometheus_client.parser import text_string_to_metric_families

from hf2q_py.budget import format_bytes, parse_size

from hf2q_py.errors import run_script
from hf2q_py.generation import context_length, encode_messages
from hf2q_py.tools import results
from hf2q_py.tools.files import check_writable

sys.path.insert(0, str(Path(__file__).parent))
from bench_server import free_port, wait_ready  # noqa: E402

START_SECONDS = 300
MODULES = ("json.decoder", "json.encoder", "textwrap", "inspect", "heapq", "shlex", "statistics", "argparse")
ASKS = ("Summarise what this code does.", "Which function is the most complex, and why?",
        "Suggest one refactoring.", "Write a docstring for the first class.",
        "List the functions in order.", "Explain the error handling.")  # fmt: skip


@dataclass
class Tally:
    """What the sessions saw, under a lock."""

    sent: int = 0
    finished: int = 0
    statuses: Counter = field(default_factory=Counter)
    restarts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            if key in ("sent", "finished", "restarts"):
                setattr(self, key, getattr(self, key) + n)
            else:
                self.statuses[key] += n


def system_prompt(tokenizer, session: int, tokens: int) -> str:
    """About ``tokens`` tokens of standard-library source, starting at a different module per session."""
    import importlib

    ids: list[int] = []
    names = MODULES[session % len(MODULES) :] + MODULES[: session % len(MODULES)]
    for name in names * 4:
        ids += tokenizer.encode(inspect.getsource(importlib.import_module(name)))
        if len(ids) >= tokens:
            break
    return f"Session {session}. You are a coding agent.\n" + tokenizer.decode(ids[:tokens])


def start(args, log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "hf2q_py", "serve", "--port", str(port), "--memory-budget", str(args.budget),
           "--memory-queue", str(args.memory_queue), "--max-batch", str(args.max_batch), "--no-disk-cache"]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url, "the server", START_SECONDS)
    return proc, url


def session(url: str, index: int, system: str, args, deadline: float, tally: Tally) -> None:
    """One agent session: turns until the deadline, 429s retried, starting
    over when the conversation fills three quarters of the context (as an
    agent compacts it)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": ASKS[index % len(ASKS)]}]
    turn = 0
    while time.monotonic() < deadline:
        if turn and args.count(messages) > 0.75 * args.context:
            messages, turn = messages[:2], 0
            tally.add("restarts")
        tally.add("sent")
        try:
            text = turn_text(client, messages, args.max_tokens)
        except openai.APIStatusError as e:
            tally.add(str(e.status_code))
            if e.status_code == 429:
                time.sleep(1.0)
                continue
            messages, turn = messages[:2], 0  # an error: start over
            tally.add("restarts")
            continue
        except openai.APIError as e:  # a connection lost, an error event in the stream
            tally.add(f"error: {type(e).__name__}")
            continue
        tally.add("finished")
        tally.add("200")
        turn += 1
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": ASKS[(index + turn) % len(ASKS)]},
        ]


def turn_text(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> str:
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, stream=True)
    parts = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


def sample(url: str, pid: int) -> dict[str, float]:
    """The server's memory now: /metrics and the process's resident memory."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("." + ".".join(s.labels.values()) if s.labels else "")
            values[key] = s.value
    return {
        "t": time.monotonic(),
        "active": values.get("hf2q_mlx_memory_bytes.active", 0.0),
        "peak": values.get("hf2q_mlx_memory_bytes.peak", 0.0),
        "kv_reserved": values.get("hf2q_memory_bytes.kv_reserved", 0.0),
        "kv_in_use": values.get("hf2q_memory_bytes.kv_in_use", 0.0),
        "prompt_cache": values.get("hf2q_memory_bytes.prompt_cache", 0.0),
        "waiting": values.get("hf2q_memory_waiting", 0.0),
        "rss": resident(pid),
    }


def resident(pid: int) -> float:
    """The process's resident memory in bytes (/proc on Linux, ps elsewhere)."""
    status = Path(f"/proc/{pid}/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) * 1024
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    return float(out.stdout.strip() or 0) * 1024


def sampler(url: str, pid: int, interval: float, stop: threading.Event, out: list[dict]) -> None:
    while not stop.is_set():
        with contextlib.suppress(OSError):  # a scrape that timed out: the next one counts
            out.append(sample(url, pid))
        stop.wait(interval)


def slices(samples: list[dict], t0: float, width: float) -> list[list[str]]:
    """One row per time slice: its highest values."""
    rows = []
    end = max(s["t"] for s in samples) - t0
    k = 0
    while k * width < end + 1e-9:
        part = [s for s in samples if k * width <= s["t"] - t0 < (k + 1) * width]
        if part:
            top = {key: max(s[key] for s in part) for key in part[0] if key != "t"}
            rows.append([f"{k * width / 60:.1f}-{(k + 1) * width / 60:.1f}", format_bytes(top["active"]),
                         format_bytes(top["peak"]), format_bytes(top["rss"]), format_bytes(top["kv_reserved"]),
                         format_bytes(top["prompt_cache"]), f"{top['waiting']:.0f}"])  # fmt: skip
        k += 1
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="the served model (default: the built-in model)")
    ap.add_argument("--budget", default="3GB", help="--memory-budget of the server (default 3GB)")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--system-tokens", type=int, default=3000, help="each session's system prompt")
    ap.add_argument("--max-tokens", type=int, default=32000, help="max_tokens of each turn (as agents ask)")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--memory-queue", type=int, default=8)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    args.budget = parse_size(args.budget, "--budget")
    if args.results:
        check_writable(args.results, "--results file")
    target = hf2q_py.load(args.model) if args.model else hf2q_py.load()
    tokenizer = target.tokenizer
    args.context = context_length(target) or 1 << 30
    args.count = lambda messages: len(encode_messages(target, messages))
    systems = [system_prompt(tokenizer, i, args.system_tokens) for i in range(args.sessions)]
    tally, samples, stop = Tally(), [], threading.Event()
    with tempfile.TemporaryFile("w+") as log:
        proc, url = start(args, log)
        try:
            t0 = time.monotonic()
            watch = threading.Thread(target=sampler, args=(url, proc.pid, args.interval, stop, samples))
            watch.start()
            deadline = t0 + args.minutes * 60
            threads = [threading.Thread(target=session, args=(url, i, systems[i], args, deadline, tally))
                       for i in range(args.sessions)]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            stop.set()
            watch.join()
            samples.append(sample(url, proc.pid))
        finally:
            proc.terminate()
            proc.wait(120)
        log.seek(0)
        server_errors = [line for line in log.read().splitlines() if " ERROR " in line or "Traceback" in line]
    report(args, tally, samples, t0, server_errors, proc.returncode)


def report(args, tally: Tally, samples: list[dict], t0: float, server_errors: list[str], code: int) -> None:
    peak = max(s["peak"] for s in samples)
    others = {k: v for k, v in tally.statuses.items() if k not in ("200", "429")}
    lost = tally.sent - tally.finished - tally.statuses.get("429", 0) - sum(others.values())
    width = max(args.interval, args.minutes * 60 / 10)
    cols = ["minutes", "MLX active", "MLX peak", "resident", "KV reserved", "prompt cache", "waiting"]
    summary = [["budget", format_bytes(args.budget)], ["MLX peak since start", format_bytes(peak)],
               ["peak / budget", f"{peak / args.budget:.1%}"], ["requests sent", str(tally.sent)],
               ["finished", str(tally.finished)], ["429 (memory queue full)", str(tally.statuses.get("429", 0))],
               ["other errors", ", ".join(f"{k}: {v}" for k, v in sorted(others.items())) or "none"],
               ["lost (no answer)", str(lost)], ["sessions started over", str(tally.restarts)],
               ["server log errors", str(len(server_errors))], ["server exit status", str(code)],
               ["within the budget, no error but 429s",
                "yes" if peak <= args.budget and not others and lost == 0 and not server_errors else "NO"]]  # fmt: skip
    model = args.model or "the built-in SmolLM2-135M-Instruct"
    notes = (f"{model}; hf2q-py serve --memory-budget {args.budget} --memory-queue {args.memory_queue} "
             f"--max-batch {args.max_batch} --no-disk-cache; {args.sessions} sessions for {args.minutes:g} "
             f"minutes, each a conversation of a {args.system_tokens}-token system prompt and growing turns "
             f"(max_tokens {args.max_tokens}), streamed, 429s retried after 1 s; /metrics sampled every "
             f"{args.interval:g} s; each row the highest value in its slice.")  # fmt: skip
    rec = results.record(
        shlex.join(["python", *sys.argv]),
        [results.table(cols, slices(samples, t0, width), "lrrrrrr"), results.table(["", ""], summary, "lr")],
        notes=notes,
        data={"samples": [{**s, "t": s["t"] - t0} for s in samples], "sent": tally.sent,
              "finished": tally.finished, "statuses": dict(tally.statuses), "lost": lost,
              "server_errors": server_errors[:20], "budget": args.budget, "peak": peak},
    )  # fmt: skip
    results.publish(rec, args.results)


if __name__ == "__main__":
    run_script(main)
