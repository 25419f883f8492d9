"""A Claude-Code-shaped agent session (``claude_session.py``) replayed through
three servers on the Qwen2.5-Coder 0.5B GGUF's weights: ``hf2q-py serve``
(``/v1/messages``, from the GGUF), mlx-dspark's server (``/v1/messages``, its
drafter-free lookup mode) and ``mlx_lm.server`` (chat completions, each turn
translated as a proxy does, the billing line in the system text), streamed.

First the conversation is recorded once with plain greedy decoding
(``hf2q-py serve``, ``hf2q.method`` ``baseline``): each user turn, the
model's answer, the tools' results, the answer after them. That recording
(``--script``) is the conversation every server is then given, request by
request, on a freshly started server, so every server answers the same
prompts; each answer is compared with plain decoding's (the same text
outside calls, the same calls). Per request: time to first content, total
time, prompt tokens, tokens read from the prompt cache (hf2q-py and
mlx_lm.server report it), generated tokens. hf2q-py also runs a *warm
start*: a server restarted on a prompt cache folder that an earlier
server filled with another session's first request (the same system
prompt and tools, another question).

    python benchmarks/bench_agent_session.py --results benchmarks/results/agent_session.json
    python benchmarks/bench_agent_session.py --short --servers hf2q-py   # a trimmed session, minutes

``--streams PATH`` also writes the recorded requests as replay streams
(prompt ids, answer ids, the quoted views hf2q-py drafts from) for
``python -m hf2q_py.tools.replay``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hf2q_py

import hf2q_py  # noqa: E402  first: OpenBLAS before mlx.core

import claude_session as cs  # noqa: E402
from bench_server import free_port, stop, wait_ready  # noqa: E402
from session_clients import Answer, chat_call, messages_call, messages_whole, tool_reader  # noqa: E402

from hf2q_py.blas import find_openblas  # noqa: E402
from hf2q_py.errors import Hf2qError, run_script  # noqa: E402
from hf2q_py.tools import results  # noqa: E402
from hf2q_py.tools.files import check_writable  # noqa: E402

SERVERS = ("hf2q-py", "mlx-dspark", "mlx_lm.server")
GGUF = Path("/work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
START_SECONDS = 900
PEER_FLAGS = {  # mlx-dspark on a CPU: its Metal probes and calibrations off
    "mlx-dspark": ["--mode", "lookup", "--wide-gemm-min", "0", "--cpu-split", "0", "--no-small-m",
                   "--no-sdpa-split", "--no-multirow-attn", "--no-memory-guard", "--max-tokens-cap", "32768"],
}  # fmt: skip


# -- servers -------------------------------------------------------------------------------------
def start(name: str, args: argparse.Namespace, log, cache_dir: Path | None = None, method: str | None = None):
    """A freshly started server: (process, url)."""
    port, env = free_port(), dict(os.environ)
    if name == "hf2q-py":
        cmd = [sys.executable, "-m", "hf2q_py", "serve", "--model", str(args.gguf), "--port", str(port)]
        cmd += ["--prompt-cache-dir", str(cache_dir)] if cache_dir else ["--no-disk-cache"]
        cmd += ["--method", method] if method else []
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    else:
        blas = find_openblas()
        if blas:
            env["LD_PRELOAD"] = blas
        python = sys.executable if name == "mlx_lm.server" else args.peers_python
        module = "mlx_lm.server" if name == "mlx_lm.server" else "mlx_dspark"
        cmd = [python, "-m", module, *(["serve"] if name == "mlx-dspark" else [])]
        cmd += ["--model", str(args.folder), "--port", str(port), *PEER_FLAGS.get(name, [])]
    print(f"starting {name}: {shlex.join(cmd)}", file=log, flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, name, START_SECONDS, _ready)
    except Hf2qError:
        stop(proc)
        raise
    return proc, url


def _ready(body: bytes) -> bool:
    """Whether a health answer says the model is ready (mlx-dspark reports its warm-up)."""
    try:
        health = json.loads(body)
    except ValueError:
        return True
    return not (isinstance(health, dict) and health.get("warming_up"))


def ask(name: str, url: str, body: dict[str, Any], reader, chat: bool = False) -> Answer:
    """One request: mlx_lm.server (and mlx-dspark with ``chat``) through chat completions."""
    if name == "mlx_lm.server" or chat:
        return chat_call(url, cs.openai_request(body, "default_model" if name == "mlx_lm.server" else body["model"]), reader)  # fmt: skip
    return messages_call(url, body, reader)


# -- the recorded conversation -------------------------------------------------------------------
def record_script(args: argparse.Namespace, shape: cs.Shape, log) -> dict[str, Any]:
    """The session with plain greedy decoding: every request's messages and answer."""
    reader = tool_reader(shape.tools)

    def ask(body):
        a = messages_whole(url, {**body, "hf2q": {"return_tokens": True}}, reader)
        return a.text, a.calls, a.record()

    proc, url = start("hf2q-py", args, log, method="baseline")
    try:
        log_line = lambda line: print(f"recorded {line}", file=sys.stderr, flush=True)  # noqa: E731
        script = cs.run_session(shape, ask, args.max_tokens, log=log_line, turns=args.turns)
    finally:
        stop(proc)
    return {"session": cs.fingerprint(shape), "short": args.short, "max_tokens": args.max_tokens, "turns": args.turns, **script}  # fmt: skip


def load_script(args: argparse.Namespace, shape: cs.Shape, log) -> dict[str, Any]:
    """The recorded conversation from ``--script`` when it was made from this
    session with these settings, else recorded (and saved there)."""
    path = Path(args.script) if args.script else None
    want = (cs.fingerprint(shape), args.short, args.max_tokens, args.turns)
    if path is not None and path.is_file():
        script = json.loads(path.read_text(encoding="utf-8"))
        if tuple(script.get(k) for k in ("session", "short", "max_tokens", "turns")) == want:
            return script
        print(f"{path}: recorded from another session or settings: recording again", file=sys.stderr)
    script = record_script(args, shape, log)
    if path is not None:
        path.write_text(json.dumps(script, ensure_ascii=False, indent=1), encoding="utf-8")
    return script


def bodies(
    shape: cs.Shape, script: dict[str, Any], max_tokens: int, fixed_nonce: bool
) -> list[dict[str, Any]]:
    """Every request of the recorded conversation, each with its own billing
    nonce (``fixed_nonce``: all with the first one's)."""
    msgs = script["messages"]
    return [cs.request_body(shape, msgs[: r["messages"]], 0 if fixed_nonce else i, max_tokens)
            for i, r in enumerate(script["requests"])]  # fmt: skip


# -- running the servers -------------------------------------------------------------------------
def session(
    name: str, url: str, requests: list[dict[str, Any]], reader, chat: bool = False
) -> list[dict[str, Any]]:
    out = []
    for i, body in enumerate(requests):
        a = ask(name, url, body, reader, chat)
        out.append(a.record())
        print(f"  {name} request {i + 1}/{len(requests)}: ttft {a.ttft:.1f} s, total {a.total:.1f} s, "
              f"{a.output_tokens} tokens, cached {a.cached_tokens}", file=sys.stderr, flush=True)  # fmt: skip
    return out


def prime(args: argparse.Namespace, shape: cs.Shape, cache_dir: Path, log) -> None:
    """Fill ``cache_dir`` with another session's first request (same system prompt and tools)."""
    proc, url = start("hf2q-py", args, log, cache_dir)
    try:
        body = cs.request_body(shape, cs.first_user(shape, "List the files in this folder."), 999, 1)
        messages_call(url, body, tool_reader(shape.tools))
    finally:
        stop(proc)  # exits once its queued writes are on disk


def run_servers(args: argparse.Namespace, shape: cs.Shape, requests: list[dict], log, tmp: Path) -> dict:
    reader, runs = tool_reader(shape.tools), {}
    for name in args.servers:
        cache = tmp / f"cache-{name}"
        proc, url = start(name, args, log, cache if name == "hf2q-py" else None)
        try:
            runs[name] = session(
                name, url, requests, reader, name == "mlx-dspark" and args.dspark_api == "chat"
            )
        finally:
            stop(proc)
        print(f"{name}: {sum(x['total'] for x in runs[name]):.1f} s", file=sys.stderr, flush=True)
    if "hf2q-py" in args.servers and args.warm_start:
        cache = tmp / "cache-warm"
        prime(args, shape, cache, log)
        proc, url = start("hf2q-py", args, log, cache)
        try:
            runs["hf2q-py, warm start"] = session("hf2q-py", url, requests, reader)
        finally:
            stop(proc)
    return runs


# -- tables --------------------------------------------------------------------------------------
SHORT_NAMES = {"hf2q-py": "hf2q-py", "mlx-dspark": "dspark", "mlx_lm.server": "mlx_lm", "hf2q-py, warm start": "hf2q-py warm"}  # fmt: skip


def _same(run: list[dict], script: dict) -> list[bool]:
    return [Answer(**a).same(Answer(**r["answer"])) for a, r in zip(run, script["requests"])]


def _calls(answer: dict) -> str:
    return ", ".join(c["name"] for c in answer["calls"]) or "(text)"


def request_table(runs: dict, script: dict) -> dict:
    names = [n for n in runs]
    cols = ["request", "answer", "prompt tokens", "generated"]
    for n in names:
        cols += [f"{SHORT_NAMES[n]} TTFT s", f"{SHORT_NAMES[n]} total s"]
    cols += ["hf2q-py read from cache", "identical to plain decoding"]
    same = {n: _same(runs[n], script) for n in names}
    rows = []
    for i, r in enumerate(script["requests"]):
        ref = r["answer"]
        row = [f"{i + 1}. {r['label']}", _calls(ref), str(ref["prompt_tokens"]), str(ref["output_tokens"])]
        for n in names:
            row += [f"{runs[n][i]['ttft']:.2f}", f"{runs[n][i]['total']:.2f}"]
        ours = runs.get("hf2q-py", [None] * len(script["requests"]))[i]
        row.append(
            f"{ours['cached_tokens'] / ours['prompt_tokens']:.1%}" if ours and ours["prompt_tokens"] else "-"
        )
        row.append(", ".join(f"{SHORT_NAMES[n]} {'yes' if same[n][i] else 'NO'}" for n in names))
        rows.append(row)
    totals = ["**session**", "", "", ""]
    for n in names:
        totals += ["", f"**{sum(x['total'] for x in runs[n]):.2f}**"]
    totals += ["", ", ".join(f"{SHORT_NAMES[n]} {'yes' if all(same[n]) else 'NO'}" for n in names)]
    rows.append(totals)
    align = "llrr" + "rr" * len(names) + "rl"
    return results.table(cols, rows, align, title="A Claude-Code-shaped session, request by request")


def summary_table(runs: dict, script: dict) -> dict:
    totals = {n: sum(x["total"] for x in run) for n, run in runs.items()}
    peers = [n for n in ("mlx-dspark", "mlx_lm.server") if n in totals]
    faster = min(peers, key=totals.get) if peers else None
    rows = []
    for n, t in totals.items():
        later = runs[n][1:]
        hit = [x["cached_tokens"] / x["prompt_tokens"] for x in later if x.get("cached_tokens") is not None and x["prompt_tokens"]]  # fmt: skip
        rows.append([
            n, f"{t:.2f}", f"{runs[n][0]['ttft']:.2f}", f"{t - runs[n][0]['total']:.2f}", str(runs[n][0]["prompt_tokens"]),
            f"{min(hit):.1%}" if hit else "-",
            f"{totals[faster] / t:.2f}x" if faster else "-", "yes" if all(_same(runs[n], script)) else "NO",
        ])  # fmt: skip
    cols = ["server", "session s", "first request TTFT s", "later requests s", "first request's prompt tokens",
            "least read from cache (later requests)", f"speed-up over {faster or 'the faster peer'}", "identical"]  # fmt: skip
    return results.table(cols, rows, "lrrrrrrl", title="The session end to end")


def speculation_table(runs: dict, script: dict) -> dict:
    rows = []
    for i, (a, r) in enumerate(zip(runs["hf2q-py"], script["requests"])):
        s = a.get("hf2q") or {}
        out = a["output_tokens"] or 0
        rows.append([f"{i + 1}. {r['label']}", str(out), str(s.get("drafted", "-")), str(s.get("accepted", "-")),
                     str(s.get("rounds", "-")), f"{s['rounds'] / out:.2f}" if out and s.get("rounds") else "-",
                     f"{s.get('mean_accepted_length', 0):.2f}", f"{s.get('prefill_seconds', 0):.2f}"])  # fmt: skip
    cols = ["request", "generated", "drafted", "accepted", "forwards", "forwards per token",
            "mean accepted length", "prefill s"]  # fmt: skip
    return results.table(
        cols, rows, "lrrrrrrr", title="hf2q-py's speculation per request (counts, not times)"
    )


# -- replay streams ------------------------------------------------------------------------------
def write_streams(
    path: str, args: argparse.Namespace, shape: cs.Shape, script: dict, requests: list[dict]
) -> None:
    """The recorded requests as replay streams: prompt ids as hf2q-py makes them,
    plain decoding's answer ids, the quoted views it drafts from."""
    from hf2q_py.server.anthropic_protocol import MessagesRequest, conversation
    from hf2q_py.server.conversation import normalized
    from hf2q_py.server.tool_calls import quoted_views
    from hf2q_py.tools.replay import Stream, measure_costs, save
    from hf2q_py.request import encode_messages

    target = hf2q_py.load(str(args.gguf), dtype="float32")
    tok = target.tokenizer
    streams = []
    for i, (body, r) in enumerate(zip(requests, script["requests"])):
        conv = conversation(MessagesRequest.model_validate(body))
        ids = encode_messages(target, normalized(conv.messages), tools=conv.tools)
        out = r["answer"]["tokens"]
        views = [list(tok.encode(t, add_special_tokens=False)) for t in quoted_views(conv.messages)]
        streams.append(Stream(f"{i + 1}. {r['label']}", "agent", ids, out, "claude-code", sorted(target.line_breaks), views))  # fmt: skip
    save(path, streams, measure_costs(target, streams[0].prompt[-2048:]), str(target.source))


# -- main ----------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=GGUF, help=f"the Qwen2.5-Coder 0.5B GGUF (default {GGUF})")
    ap.add_argument("--folder", type=Path, default=None,
                    help="its weights as an MLX folder for the peers (made when absent; default: a temporary one)")  # fmt: skip
    ap.add_argument("--peers-python", default="/work/peers-venv/bin/python",
                    help="the Python that has mlx-dspark installed")  # fmt: skip
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {', '.join(SERVERS)}")
    ap.add_argument("--short", action="store_true", help="the trimmed session (for development)")
    ap.add_argument("--max-tokens", type=int, default=512, help="each request's max_tokens (default 512)")
    ap.add_argument("--turns", type=int, default=None, help="only the first N user turns (default: all)")
    ap.add_argument(
        "--script", default=None, help="the recorded conversation: read if it matches, else written"
    )
    ap.add_argument("--dspark-api", choices=("messages", "chat"), default="messages",
                    help="mlx-dspark's API: messages (/v1/messages, as Claude Code talks to it; it folds the "
                    "environment message into the user's turn, so its prompt differs) or chat (the requests as "
                    "mlx_lm.server gets them: the same prompt as hf2q-py's)")  # fmt: skip
    ap.add_argument("--fixed-nonce", action="store_true",
                    help="send every request with the same billing nonce (as a proxy that strips it would), "
                    "so the peers' own prompt caches can hit")  # fmt: skip
    ap.add_argument("--no-warm-start", dest="warm_start", action="store_false",
                    help="skip hf2q-py's warm-start session")  # fmt: skip
    ap.add_argument("--streams", default=None, help="also write replay streams (JSON) here")
    ap.add_argument("--results", default=None, help="also write a results file (JSON) here")
    args = ap.parse_args()
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if unknown := [s for s in args.servers if s not in SERVERS]:
        raise Hf2qError(f"--servers: unknown {', '.join(unknown)} (known: {', '.join(SERVERS)})")
    if args.max_tokens < 1 or (args.turns is not None and args.turns < 1):
        raise Hf2qError("--max-tokens and --turns must be >= 1")
    if not args.gguf.is_file():
        raise Hf2qError(f"--gguf: no file {args.gguf} (see benchmarks/qwen_gguf.py)")
    for path, what in ((args.results, "--results file"), (args.streams, "--streams file")):
        if path:
            check_writable(path, what)
    return args


def main() -> None:
    args = parse_args()
    shape = cs.claude_code_shape(args.short)
    with tempfile.TemporaryDirectory() as tmp_name, open(Path(tmp_name) / "servers.log", "w") as log:
        tmp = Path(tmp_name)
        if any(s != "hf2q-py" for s in args.servers):
            args.folder = args.folder or tmp / "qwen05-mlx"
            if not (args.folder / "config.json").is_file():
                from bench_server import export_target

                export_target(hf2q_py.load(str(args.gguf), dtype="float32"), args.folder)
        started = time.perf_counter()
        script = load_script(args, shape, log)
        requests = bodies(shape, script, args.max_tokens, args.fixed_nonce)
        runs = run_servers(args, shape, requests, log, tmp)
        wall = time.perf_counter() - started
        if args.streams:
            write_streams(args.streams, args, shape, script, requests)
    tables = [summary_table(runs, script), request_table(runs, script)]
    if "hf2q-py" in runs:
        tables.append(speculation_table(runs, script))
    kind = "trimmed (--short: system prompt and environment cut, 4 tools)" if args.short else "Claude Code's captured system prompt, environment message and 12 tools"  # fmt: skip
    notes = (
        f"Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF: hf2q-py serve from the GGUF (float32, its defaults: method "
        f"ngram, memory, prompt cache in memory and on disk, a new cache folder per server), mlx-dspark 0.20.3 "
        f"serve --mode lookup (through {'chat completions' if args.dspark_api == 'chat' else '/v1/messages'}) and "
        f"mlx_lm.server from the same weights saved as an MLX folder (float32); OpenBLAS "
        f"in all three. {len(requests)} requests of one session ({kind}), "
        f"{'all with one billing nonce (--fixed-nonce)' if args.fixed_nonce else 'each with a new billing nonce'}, "
        f"streamed, greedy, max_tokens {args.max_tokens}; the conversation is plain decoding's (hf2q-py, method "
        f"baseline), the same for every server; mlx_lm.server gets each request as chat completions. Each server "
        f"freshly started, one run each; 'warm start': hf2q-py restarted on a cache folder an earlier server "
        f"filled with another session's first request. Whole run: {wall / 60:.0f} min."
    )
    data = {"script": script, "runs": runs, "wall_seconds": wall}
    results.publish(
        results.record(shlex.join(["python", *sys.argv]), tables, notes=notes, data=data), args.results
    )


if __name__ == "__main__":
    run_script(main)
