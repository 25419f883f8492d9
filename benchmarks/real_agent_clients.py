"""The real agent CLIs (``tests/agent_clients.py``: the same setup the tests use,
pinned by ``tests/agents/package.json``) against ``hf2q-py serve`` on a real
model, outside CI: one prompt each (read ``note.txt`` and say what it says),
the client's own tools allowed. Per client: the wall time, whether it exited
cleanly, the answer it printed, the tool output it reported (did it run a
tool on the note?), and the server's requests by endpoint and tokens read
from its prompt cache (``/metrics``).

    python benchmarks/real_agent_clients.py --model /work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
        --clients claude-code,codex --results benchmarks/results/real_agent_clients.json
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hf2q_py  # noqa: E402,F401  first: OpenBLAS before mlx.core

import agent_clients as ac  # noqa: E402
import bench_server  # noqa: E402
from bench_server import served_name, start, stop  # noqa: E402

from hf2q_py.errors import Hf2qError, run_script  # noqa: E402
from hf2q_py.tools import results  # noqa: E402
from hf2q_py.tools.files import check_writable  # noqa: E402

NOTE = "The deploy is on Friday at 10:00; bring the release notes."


def metrics(url: str) -> dict[str, float]:
    """The server's request and token counters."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    out = {}
    for line in lines:
        if line.startswith(
            ("hf2q_requests_total{", "hf2q_prompt_tokens_total", "hf2q_prompt_cache_reused_tokens_total")
        ):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def one(client: ac.AgentClient, model_path: str, timeout: float, log, tmp: Path) -> dict:
    """A fresh server, one session of ``client``, what it did."""
    proc, url = start("hf2q-py", Path(model_path), log)
    try:
        setup = client.setup(tmp / client.name, url, served_name("hf2q-py", url), NOTE)
        run = ac.run(setup, timeout)
        seen = metrics(url)
    finally:
        stop(proc)
    answer, tool = client.answer(run.stdout), client.tool_output(run.stdout)
    return {"client": client.name, "version": client.version(), "seconds": run.seconds,
            "returncode": run.returncode, "timed_out": run.timed_out, "answer": answer,
            "tool_output": tool, "tool_read_note": NOTE in tool, "metrics": seen,
            "stderr_tail": run.stderr[-2000:]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the served model (a GGUF or folder)")
    ap.add_argument("--clients", default=",".join(ac.CLIENTS), help=f"of {', '.join(ac.CLIENTS)}")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per client session")
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    names = [c.strip() for c in args.clients.split(",") if c.strip()]
    if unknown := [n for n in names if n not in ac.CLIENTS]:
        raise Hf2qError(f"--clients: unknown {', '.join(unknown)} (known: {', '.join(ac.CLIENTS)})")
    if missing := [m for n in names if (m := ac.CLIENTS[n].missing())]:
        raise Hf2qError(missing[0])
    if args.results:
        check_writable(args.results, "--results file")
    bench_server.START_SECONDS = 900
    runs = []
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "servers.log", "w") as log:
        for name in names:
            runs.append(one(ac.CLIENTS[name], args.model, args.timeout, log, Path(tmp)))
            r = runs[-1]
            print(f"{name}: {r['seconds']:.0f} s, exit {r['returncode']}, tool read the note: "
                  f"{r['tool_read_note']}", file=sys.stderr, flush=True)  # fmt: skip
    rows = [[r["client"], r["version"], f"{r['seconds']:.0f}", "timed out" if r["timed_out"] else r["returncode"],
             "yes" if r["tool_read_note"] else "no", " ".join(r["answer"].split())[:120] or "-"]
            for r in runs]  # fmt: skip
    table = results.table(["client", "version", "seconds", "exit", "tool read the note", "answer (start)"], rows,
                          "llrlll", title="Real agent CLIs against hf2q-py serve")  # fmt: skip
    notes = (f"hf2q-py serve --model {Path(args.model).name} (float32 on this CPU), a fresh server per client "
             f"(an empty prompt cache); the prompt: {ac.PROMPT!r}, note.txt holding {NOTE!r}.")  # fmt: skip
    results.publish(
        results.record(shlex.join(["python", *sys.argv]), [table], notes=notes, data=runs), args.results
    )


if __name__ == "__main__":
    run_script(main)
