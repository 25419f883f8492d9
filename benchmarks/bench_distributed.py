"""Speculation on a sharded model: plain decoding and each method on 1 and on
2 local ranks (ring backend on loopback), same model,
same prompts, whole-call decode tokens per second, identical-output flags;
where the time goes on 2 ranks (the forward's collectives, measured alone, vs
the rest); and a model of two Macs joined by a link of per-collective latency
λ and bandwidth B, built from the measured compute and the measured count of
rounds and fed tokens of every run.

    python benchmarks/bench_distributed.py --model qwen05.gguf [--methods ngram,layerskip]
        [--only code] [--max-tokens 128] [--repeats 2] [--results PATH]

Each configuration runs in its own process(es), one after the other (never
two timed jobs at once); on 2 ranks each rank's OpenBLAS gets one thread
(``--threads-per-rank``), so the two ranks share this machine's two cores
as one process's two threads do. The ranks start as ``mlx.launch`` starts
them (``MLX_RANK``, ``MLX_HOSTFILE``), without ``mlx.launch`` itself, whose
output relay keeps a core busy; one more 2-rank run under ``mlx.launch``
times forwards only, to show that cost.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hf2q_py

#: Assumed links between two Macs: (name, per-collective latency in s, bandwidth in bytes/s).
LINKS = [
    ("loopback (measured here)", None, None),
    ("Thunderbolt 5, RDMA (JACCL)", 10e-6, 80e9 / 8),
    ("Thunderbolt bridge, TCP (ring)", 50e-6, 20e9 / 8),
    ("10 GbE, TCP (ring)", 100e-6, 10e9 / 8),
]
WIDTHS = (1, 9, 17, 33)


# -- the worker: one configuration, run as users run it ------------------------
def worker(args: argparse.Namespace) -> None:
    import hf2q_py  # first: OpenBLAS before mlx.core
    import mlx.core as mx

    from hf2q_py.distributed import launched_group
    from hf2q_py.generation import encode_prompt
    from hf2q_py.tools.workloads import default_workloads

    group = launched_group()
    t0 = time.perf_counter()
    target = hf2q_py.load(args.model, group=group) if group else hf2q_py.load(args.model)
    load_seconds = time.perf_counter() - t0
    workloads = [
        w for w in default_workloads() if not w.then and any(x in w.name for x in args.only.split(","))
    ]
    methods = ["baseline", *[m for m in args.methods.split(",") if m]]
    runs = []
    for w in [] if args.probe_only else workloads:
        ids = encode_prompt(target, w.prompt)
        for r in range(args.repeats):
            order = methods if r % 2 == 0 else methods[::-1]
            for m in order:
                target.memory.clear()
                res = hf2q_py.generate(target, ids, max_tokens=args.max_tokens, method=m)
                s = res.stats
                runs.append(dict(workload=w.name, kind=w.kind, method=m, repeat=r, tokens=res.tokens,
                                 tok_s=s.tokens_per_second, decode_seconds=s.decode_seconds,
                                 rounds=s.rounds, drafted=s.drafted, accepted=s.accepted))  # fmt: skip
    probe = forward_costs(target, mx)
    if group is None or group.rank() == 0:
        Path(args.out).write_text(
            json.dumps(
                dict(
                    ranks=group.size() if group else 1,
                    load_seconds=load_seconds,
                    layers=target.num_layers,
                    hidden=target.hidden_size,
                    runs=runs,
                    **probe,
                )
            )  # fmt: skip
        )


def forward_costs(target, mx) -> dict:
    """Median seconds of a forward of n tokens after 64, and (sharded) of the
    forward's collectives alone: two all_sums of (1, n, hidden) per layer."""
    rt = target.runtime()
    mx.eval(rt.prefill(list(range(100, 164)), logits="none").logits)
    forward, collectives = {}, {}
    for n in WIDTHS:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            mx.eval(rt.forward(list(range(200, 200 + n))).logits)
            times.append(time.perf_counter() - t)
            rt.trim(n)
        forward[n] = statistics.median(times[1:])
        sh = target.sharding
        if sh is not None and sh.mode == "tensor":
            x = mx.ones((1, n, target.hidden_size))
            times = []
            for _ in range(9):
                t = time.perf_counter()
                y = x
                for _ in range(2 * target.num_layers):
                    y = mx.distributed.all_sum(y, group=sh.group) * 0.5
                mx.eval(y)
                times.append(time.perf_counter() - t)
            collectives[n] = statistics.median(times[1:])
    return dict(forward=forward, collectives=collectives)


# -- the driver ----------------------------------------------------------------
def run_config(
    args: argparse.Namespace, ranks: int, launcher: str = "direct", probe_only: bool = False
) -> dict:
    """One configuration's results, from rank 0 of ``ranks`` processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, __file__, "--worker", "--out", str(out), "--model", args.model,
               "--methods", args.methods, "--only", args.only, "--max-tokens", str(args.max_tokens),
               "--repeats", str(args.repeats), *(["--probe-only"] if probe_only else [])]  # fmt: skip
        threads = f"OPENBLAS_NUM_THREADS={args.threads_per_rank}"
        print(f"running on {ranks} rank(s) ({launcher}): {shlex.join(cmd)}", file=sys.stderr, flush=True)
        if ranks == 1:
            procs = [subprocess.Popen(cmd, text=True, stderr=subprocess.PIPE)]
        elif launcher == "mlx.launch":
            launch = Path(sys.executable).parent / "mlx.launch"
            launched = [str(launch), "-n", str(ranks), "--backend", "ring", "--env", threads, *cmd]
            procs = [subprocess.Popen(launched, text=True, stderr=subprocess.PIPE)]
        else:
            procs = ring_ranks(cmd, ranks, Path(tmp), threads)
        errors = [p.communicate()[1] for p in procs]
        if not out.exists():
            raise SystemExit(f"the {ranks}-rank run failed:\n{''.join(errors)[-3000:]}")
        return json.loads(out.read_text())


def ring_ranks(cmd: list[str], ranks: int, tmp: Path, threads: str) -> list[subprocess.Popen]:
    """``cmd`` as ``ranks`` ring-backend ranks on loopback, started as
    ``mlx.launch`` starts them (``MLX_RANK``, ``MLX_HOSTFILE``) but without
    its output relay, whose threads poll their ranks' stdin without waiting
    and keep one core busy (mlx 0.32.4): on two cores, half the machine."""
    hostfile = tmp / "hosts.json"
    port = free_port(ranks)
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port + r}"] for r in range(ranks)]))
    key, value = threads.split("=")
    env = {**os.environ, "MLX_HOSTFILE": str(hostfile), key: value}
    return [subprocess.Popen(cmd, text=True, stderr=subprocess.PIPE, env={**env, "MLX_RANK": str(r)})
            for r in range(ranks)]  # fmt: skip


def free_port(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports."""
    import socket

    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        socks = []
        try:
            for i in range(count):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", first + i))
            return first
        except OSError:
            continue
        finally:
            for x in socks:
                x.close()
    raise SystemExit("no free loopback ports")


def medians(data: dict) -> dict:
    """(workload, method) -> median tok/s, and the first repeat's run."""
    groups: dict = {}
    for r in data["runs"]:
        groups.setdefault((r["workload"], r["method"]), []).append(r)
    return {k: (statistics.median(x["tok_s"] for x in v), v[0]) for k, v in groups.items()}


def speed_table(one: dict, two: dict, methods: list[str]) -> tuple[dict, list]:
    from hf2q_py.tools import results

    m1, m2 = medians(one), medians(two)
    rows, ratios = [], []
    for (w, m), (rate2, run2) in m2.items():
        if m == "baseline":
            continue
        base1, base2 = m1[(w, "baseline")][0], m2[(w, "baseline")][0]
        rate1 = m1[(w, m)][0]
        same = run2["tokens"] == m2[(w, "baseline")][1]["tokens"] == m1[(w, "baseline")][1]["tokens"]
        ratios.append((m, rate2 / base2, rate1 / base1))
        rows.append([w, m, f"{base1:.2f}", f"{rate1:.2f}", f"{rate1 / base1:.2f}x", f"{base2:.2f}",
                     f"{rate2:.2f}", f"{rate2 / base2:.2f}x", "yes" if same else "NO"])  # fmt: skip
    cols = ["workload", "method", "1 rank plain", "1 rank method", "speed-up", "2 ranks plain",
            "2 ranks method", "speed-up", "identical (1 = 2 ranks)"]  # fmt: skip
    return results.table(cols, rows, "llrrrrrrl", "decode tok/s, median of the repeats"), ratios


def cost_table(one: dict, two: dict, launched: dict) -> dict:
    from hf2q_py.tools import results

    rows = []
    for n in WIDTHS:
        f1, f, c = one["forward"][str(n)], two["forward"][str(n)], two["collectives"].get(str(n))
        share = f"{c / f:.0%}" if c is not None else "-"
        rows.append([n, f"{f1 * 1e3:.1f}", f"{f * 1e3:.1f}", f"{c * 1e3:.1f}" if c is not None else "-", share,
                     f"{launched['forward'][str(n)] * 1e3:.1f}"])  # fmt: skip
    return results.table(
        ["tokens fed", "forward ms (1 rank)", "forward ms (2 ranks)", f"{2 * two['layers']} all_sums alone ms",
         "collective share", "forward ms (2 ranks under mlx.launch)"],
        rows, "rrrrrr", "where a forward's time goes (median of 4, after a 64-token prompt)",
    )  # fmt: skip


#: Compute speeds modelled: as measured here, and ten times faster (a stand-in
#: for an Apple GPU, where a forward of this model takes milliseconds).
COMPUTE_SCALES = ((1.0, "as measured"), (0.1, "10x faster"))


def link_table(two: dict, methods: list[str]) -> dict:
    """Modelled decode tok/s over each link: each run's measured time less its
    loopback collectives (fitted a + b * tokens fed per forward), scaled by
    the compute factor, plus the link's cost per forward (2 all_sums per
    layer: latency, and the hidden states over the bandwidth)."""
    from hf2q_py.tools import results

    c = {int(k): v for k, v in two["collectives"].items()}
    b = max(0.0, (c[WIDTHS[-1]] - c[1]) / (WIDTHS[-1] - 1))
    a = max(0.0, c[1] - b)
    fit = (a, b, 2 * two["layers"], two["hidden"])
    m2 = medians(two)
    rows = []
    for scale, compute in COMPUTE_SCALES:
        for name, lat, bw in LINKS:
            latency = fit[2] * lat if lat is not None else a
            per_token = fit[2] * fit[3] * 4 / bw if bw is not None else b
            cells = [compute, name, f"{latency * 1e3:.2f}", f"{per_token * 1e3:.3f}"]
            plain = [
                _modelled(m2[(w, "baseline")][1], fit, lat, bw, scale) for (w, m) in m2 if m == "baseline"
            ]
            cells.append(f"{statistics.median(plain):.1f}")
            for m in methods:
                ups = [_modelled(run, fit, lat, bw, scale) / _modelled(m2[(w, "baseline")][1], fit, lat, bw, scale)
                       for (w, meth), (_, run) in m2.items() if meth == m]  # fmt: skip
                cells.append(f"{statistics.median(ups):.2f}x")
            rows.append(cells)
    return results.table(
        ["compute", "link", "collectives: ms a forward", "+ ms a token fed", "plain tok/s", *methods], rows,
        "llrrr" + "r" * len(methods),
        "modelled: two ranks over a link (speed-ups over plain decoding, median over the workloads)",
    )  # fmt: skip


def _modelled(run: dict, fit: tuple, lat, bw, scale: float) -> float:
    """Decode tokens per second of ``run`` with compute scaled by ``scale``
    and its collectives moved onto a link (None: loopback as measured)."""
    a, b, per_forward, hidden = fit
    fed = run["rounds"] + run["drafted"]
    measured = run["rounds"] * a + fed * b
    seconds = (run["decode_seconds"] - measured) * scale
    if lat is None:
        seconds += measured
    else:
        seconds += run["rounds"] * per_forward * lat + fed * per_forward * hidden * 4 / bw
    return len(run["tokens"]) / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a GGUF file or model folder that shards over 2 ranks")
    p.add_argument("--methods", default="ngram,layerskip")
    p.add_argument("--only", default="code", help="workload names containing one of these (comma-separated)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--results", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--probe-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help="save the runs' raw data here (or, if it exists, render it)")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    from hf2q_py.tools import results

    methods = [m for m in args.methods.split(",") if m]
    if args.data and Path(args.data).exists():  # re-render earlier runs
        one, two, launched = (json.loads(Path(args.data).read_text())[k] for k in ("one", "two", "launched"))
    else:
        one, two = run_config(args, 1), run_config(args, 2)
        launched = run_config(args, 2, launcher="mlx.launch", probe_only=True)
        if args.data:
            Path(args.data).write_text(json.dumps(dict(one=one, two=two, launched=launched)))
    speeds, ratios = speed_table(one, two, methods)
    summary_rows = []
    for m in methods:
        r2 = [x[1] for x in ratios if x[0] == m]
        r1 = [x[2] for x in ratios if x[0] == m]
        summary_rows.append([m, f"{statistics.median(r1):.2f}x", f"{statistics.median(r2):.2f}x"])
    summary = results.table(
        ["method", "1 rank", "2 ranks"], summary_rows, "lrr", "median speed-up over plain"
    )
    tables = [speeds, summary, cost_table(one, two, launched), link_table(two, methods)]
    argv = sys.argv[1:]
    if "--data" in argv:  # where the raw runs were kept is no part of the command
        i = argv.index("--data")
        argv = argv[:i] + argv[i + 2 :]
    command = "python benchmarks/bench_distributed.py " + shlex.join(argv)
    notes = (
        f"Model {Path(args.model).name}, {args.max_tokens} new tokens, greedy, {args.repeats} alternating "
        f"repeat(s); 2 ranks: ring backend on loopback, started without mlx.launch, {args.threads_per_rank} "
        f"OpenBLAS thread(s) a rank; load {one['load_seconds']:.1f} s (1 rank), {two['load_seconds']:.1f} s (2 ranks). "
        "Links other than loopback are modelled: assumed latency and bandwidth per all_sum; compute as measured, "
        "or ten times faster."
    )
    rec = results.record(
        command, tables, notes=notes, data=dict(one=one, two=two, launched=launched, links=LINKS)
    )
    print(results.render(rec))
    if args.results:
        results.write(args.results, rec)


if __name__ == "__main__":
    from hf2q_py.errors import run_script

    run_script(main)
