"""Agent sessions through the OpenAI API: ``hf2q-py serve`` against
``mlx_lm.server`` on the same model, same requests, greedy.

A session is one growing conversation about one standard-library function:
an edit of the pasted code, the same request retried, then two follow-up
edits of the model's own answer; five sessions (five functions) run in turn.
Each repeat starts both servers afresh (nothing remembered from the repeat
before), warms each up with an unrelated question, and replays the sessions
through the ``openai`` client, streaming, one server at a time, alternating
which goes first. Both servers load the built-in model saved as an MLX
folder (float32) with OpenBLAS loaded (hf2q-py loads it itself;
mlx_lm.server through LD_PRELOAD). Also measured: what the server itself
costs, as one request (nothing remembered) through ``hf2q_py.generate`` in
this process against the same request streamed through the server.

    python benchmarks/bench_server.py [--repeats 3] [--max-tokens 256] [--results benchmarks/results/server_sessions.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import hf2q_py  # first: loads OpenBLAS before mlx.core

import mlx.core as mx
import openai
from mlx.utils import tree_flatten

from hf2q_py.blas import find_openblas
from hf2q_py.errors import Hf2qError, run_script
from hf2q_py.tools import results
from hf2q_py.tools.files import check_writable

#: One agent session per function: (module, function, name to rename, new name).
SESSIONS = (
    ("textwrap", "indent", "predicate", "should_indent"),
    ("textwrap", "dedent", "margin", "common_prefix"),
    ("heapq", "nsmallest", "result", "smallest"),
    ("shlex", "split", "posix", "use_posix"),
    ("statistics", "median", "n", "count"),
)
LABELS = ("edit", "retry", "follow-up: type hints", "follow-up: docstring")


def turns(module: str, function: str, old: str, new: str) -> tuple[tuple[str, str | None], ...]:
    """The session's requests: (label, user message), None for a retry."""
    code = inspect.getsource(getattr(importlib.import_module(module), function))
    return (
        ("edit", f"Rename `{old}` to `{new}` in this function. Reply with the full function only.\n\n"
                 f"```python\n{code}```"),
        ("retry", None),
        ("follow-up: type hints", "Add type hints to this function. Reply with the full function only."),
        ("follow-up: docstring", "Add a docstring that explains each argument. Reply with the full function only."),
    )  # fmt: skip


#: The warm-up of each fresh server: nothing the session could copy or reuse.
WARM_UP = (("warm-up", "What is the capital of France?"),)
START_SECONDS = 180


def export_builtin(folder: Path) -> None:
    """The built-in model as an MLX folder: config.json, float32 weights, tokenizer."""
    export_target(hf2q_py.load(dtype="float32"), folder)


def export_target(target, folder: Path) -> None:
    """A loaded model (a GGUF's, say) as an MLX folder: config.json, its weights, tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.asdict(target.model.args)
    cfg["eos_token_id"] = sorted(target.eos_token_ids)
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(target.model.parameters())))
    tok = target.tokenizer._tokenizer
    tok.save_pretrained(folder)
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"  # the GGUF tokenizer's own class is ours
    tc_path.write_text(json.dumps(tc))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    name: str, folder: Path, log, *flags: str, tree: str | None = None, mlx_flags: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str]:
    """Start a server (``flags``: hf2q-py's, ``mlx_flags``: mlx_lm.server's);
    ``tree``: run hf2q-py from that checkout instead of this one. An hf2q-py
    server gets a cache folder of its own (``XDG_CACHE_HOME``, removed by
    :func:`stop`): its prompt cache on disk starts empty, as every start here
    must remember nothing."""
    port = free_port()
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = tree
    cache = None
    if name == "hf2q-py":
        cache = env["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="hf2q-bench-cache-")
        cmd = [sys.executable, "-m", "hf2q_py", "serve", "--model", str(folder), "--port", str(port), *flags]
    else:
        blas = find_openblas()
        if blas:
            env["LD_PRELOAD"] = blas
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(folder), "--port", str(port), *mlx_flags]
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, cwd=tree)
    proc.cache_dir = cache
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, f"{name} server", START_SECONDS)
    except Hf2qError:
        stop(proc)
        raise
    return proc, url


def wait_ready(
    proc: subprocess.Popen, url: str, what: str, seconds: float, ready: Callable[[bytes], bool] | None = None
) -> None:
    """Wait until the server at ``url`` answers ``/health`` (and ``ready``
    accepts the body); raises ``Hf2qError`` naming ``what`` if it exits or
    does not answer within ``seconds`` (then it is killed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Hf2qError(f"{what} exited at start (status {proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200 and (ready is None or ready(r.read())):
                    return
        except OSError:
            pass
        time.sleep(0.25)
    proc.kill()
    proc.wait()
    raise Hf2qError(f"{what} did not start in {seconds} s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if getattr(proc, "cache_dir", None):
        shutil.rmtree(proc.cache_dir, ignore_errors=True)


def ask(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int, extra=None) -> dict:
    """One streamed request: time to first text, total time, text, cached tokens."""
    t0 = time.perf_counter()
    first, parts, usage, spec = None, [], None, None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra,
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
        if (chunk.model_extra or {}).get("hf2q"):
            spec = chunk.model_extra["hf2q"]
    end = time.perf_counter()
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {
        "ttft": (first or end) - t0,
        "total": end - t0,
        "text": "".join(parts),
        "completion_tokens": usage.completion_tokens if usage else None,
        "cached_tokens": getattr(details, "cached_tokens", None) if details else None,
        "hf2q": spec,
    }


def session(url: str, model: str, max_tokens: int, requests) -> list[dict]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    messages: list[dict] = []
    out = []
    for label, prompt in requests:
        if prompt is not None:
            if out:
                messages.append({"role": "assistant", "content": out[-1]["text"]})
            messages.append({"role": "user", "content": prompt})
        out.append({"label": label, **ask(client, model, list(messages), max_tokens)})
    return out


def served_name(name: str, url: str) -> str:
    """The model name requests give: hf2q-py's served name; mlx_lm.server's
    name for the model it was started with."""
    if name != "hf2q-py":
        return "default_model"
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


#: The server's own cost: one request, nothing remembered, plain and n-gram decoding.
COST_PROMPT = "Write a long story about a dragon and a knight."
COST_METHODS = ("baseline", "ngram:memory=no")


def server_cost(folder: Path, repeats: int, max_tokens: int, log) -> dict[str, dict[str, list[float]]]:
    """Seconds of the same request through ``hf2q_py.generate`` in this process
    and streamed through ``hf2q-py serve --no-prompt-cache``, alternating."""
    from hf2q_py.method_spec import parse_method

    target = hf2q_py.load(str(folder))
    ids = hf2q_py.encode_prompt(target, COST_PROMPT)
    proc, url = start("hf2q-py", folder, log, "--no-prompt-cache")
    out: dict[str, dict[str, list[float]]] = {m: {"generate": [], "server": []} for m in COST_METHODS}
    try:
        model = served_name("hf2q-py", url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        messages = [{"role": "user", "content": COST_PROMPT}]
        for spec in COST_METHODS:
            opts = parse_method(spec).options
            hf2q_py.generate(target, ids, max_tokens=8, **opts)  # warm-up, both sides
            ask(client, model, messages, 8, {"hf2q": {"method": spec}})
            for _ in range(repeats):
                t0 = time.perf_counter()
                want = hf2q_py.generate(target, ids, max_tokens=max_tokens, **opts).text
                out[spec]["generate"].append(time.perf_counter() - t0)
                got = ask(client, model, messages, max_tokens, {"hf2q": {"method": spec}})
                out[spec]["server"].append(got["total"])
                if got["text"] != want:
                    raise Hf2qError(f"{spec}: the server's answer differs from generate's")
    finally:
        stop(proc)
    return out


def run(folder: Path, repeats: int, max_tokens: int, log) -> dict:
    """Per engine, per repeat: every session's requests, in order, on one fresh server."""
    runs: dict[str, list[list[list[dict]]]] = {"hf2q-py": [], "mlx_lm.server": []}
    for r in range(repeats):
        order = ["hf2q-py", "mlx_lm.server"] if r % 2 == 0 else ["mlx_lm.server", "hf2q-py"]
        for name in order:
            proc, url = start(name, folder, log)
            try:
                model = served_name(name, url)
                session(url, model, 8, WARM_UP)  # a fresh process's first forwards: another conversation
                runs[name].append([session(url, model, max_tokens, turns(*s)) for s in SESSIONS])
            finally:
                stop(proc)
            total = sum(x["total"] for sess in runs[name][-1] for x in sess)
            print(f"repeat {r + 1}/{repeats} {name}: {total:.1f} s", file=sys.stderr, flush=True)
    return runs


def _median(values) -> float:
    return statistics.median(list(values))


def tables(runs: dict, cost: dict) -> list[dict]:
    ours, theirs = runs["hf2q-py"], runs["mlx_lm.server"]
    rows = []
    for j, (module, function, *_) in enumerate(SESSIONS):
        for i, label in enumerate(LABELS):
            same = all(a[j][i]["text"] == b[j][i]["text"] for a, b in zip(ours, theirs))
            t_ttft, o_ttft = _median(x[j][i]["ttft"] for x in theirs), _median(x[j][i]["ttft"] for x in ours)
            t_tot, o_tot = _median(x[j][i]["total"] for x in theirs), _median(x[j][i]["total"] for x in ours)
            rows.append([
                f"{module}.{function}: {label}", f"{t_ttft:.2f}", f"{o_ttft:.2f}", f"{t_tot:.2f}", f"{o_tot:.2f}",
                f"{t_tot / o_tot:.2f}x", str(ours[0][j][i]["completion_tokens"]),
                str(ours[0][j][i]["cached_tokens"]), "yes" if same else "NO",
            ])  # fmt: skip
        t_s = _median(sum(x["total"] for x in run[j]) for run in theirs)
        o_s = _median(sum(x["total"] for x in run[j]) for run in ours)
        rows.append([f"**{module}.{function}: session**", "", "", f"{t_s:.2f}", f"{o_s:.2f}",
                     f"**{t_s / o_s:.2f}x**", "", "", ""])  # fmt: skip
    t_all = _median(sum(x["total"] for sess in run for x in sess) for run in theirs)
    o_all = _median(sum(x["total"] for sess in run for x in sess) for run in ours)
    same_all = all(r[-1] != "NO" for r in rows)
    rows.append(["**all sessions**", "", "", f"{t_all:.2f}", f"{o_all:.2f}", f"**{t_all / o_all:.2f}x**",
                 "", "", "yes" if same_all else "NO"])  # fmt: skip
    cols = ["request", "mlx_lm TTFT s", "hf2q-py TTFT s", "mlx_lm total s", "hf2q-py total s",
            "speed-up", "tokens", "hf2q-py cached tokens", "identical text"]  # fmt: skip
    overhead = []
    for spec, times in cost.items():
        gen, srv = _median(times["generate"]), _median(times["server"])
        overhead.append([spec, f"{gen:.2f}", f"{srv:.2f}", f"{srv / gen - 1:+.1%}"])
    return [
        results.table(cols, rows, "lrrrrrrrl", title="Agent sessions, streamed through the openai client"),
        results.table(["method", "hf2q_py.generate s", "streamed through hf2q-py serve s", "server cost"],
                      overhead, "lrrr", title="The server's own cost: one request, nothing remembered"),
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--folder", default=None, help="where to save the MLX folder (default: a temporary one)")
    ap.add_argument("--results", default=None, help="also write a results file (JSON) here")
    args = ap.parse_args()
    if args.repeats < 1 or args.max_tokens < 1:
        raise Hf2qError("--repeats and --max-tokens must be >= 1")
    if args.results:
        check_writable(args.results, "--results file")
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "servers.log", "w") as log:
        folder = Path(args.folder or Path(tmp) / "smollm2-mlx")
        export_builtin(folder)
        runs = run(folder, args.repeats, args.max_tokens, log)
        cost = server_cost(folder, max(args.repeats, 3), args.max_tokens, log)
    notes = (
        f"Built-in SmolLM2-135M-Instruct saved as an MLX folder (float32), OpenBLAS in both servers; "
        f"hf2q-py serve at its defaults (method ngram, memory and prompt cache on), mlx_lm.server at its "
        f"defaults (prompt cache on); at most {args.max_tokens} new tokens, greedy, streamed; medians of "
        f"{args.repeats} repeats, each on freshly started servers, alternating which runs first. "
        f"'server cost': '{COST_PROMPT}' ({args.max_tokens} tokens) through hf2q_py.generate in this process "
        f"and through hf2q-py serve --no-prompt-cache, alternating, medians of {max(args.repeats, 3)}."
    )
    rec = results.record(
        shlex.join(["python", *sys.argv]),
        tables(runs, cost),
        notes=notes,
        data={"runs": runs, "server_cost": cost, "max_tokens": args.max_tokens},
    )
    results.publish(rec, args.results)


if __name__ == "__main__":
    run_script(main)
