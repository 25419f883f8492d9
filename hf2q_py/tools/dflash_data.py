"""Training text for a drafter: prompts, and the target's own answers to them
(self-distillation, so the drafter learns the target's distribution).

The default prompt set is built from Python standard-library functions and
module docstrings present on every machine, with editing and explaining
instructions. Modules used by the benchmark workloads are left out, so a
drafter is never trained on the prompts it is benchmarked on.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
import textwrap
import time
from pathlib import Path
from collections.abc import Callable, Iterator, Sequence

from ..errors import Hf2qError

#: Modules whose code or documents the benchmark workloads use.
BENCHMARK_MODULES = {"textwrap", "statistics", "heapq", "shlex", "json"}

SOURCE_MODULES = (
    "argparse",
    "base64",
    "bisect",
    "calendar",
    "colorsys",
    "configparser",
    "csv",
    "difflib",
    "dis",
    "email.utils",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "genericpath",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "html",
    "imaplib",
    "inspect",
    "ipaddress",
    "locale",
    "mimetypes",
    "ntpath",
    "numbers",
    "operator",
    "optparse",
    "pathlib",
    "pickle",
    "pkgutil",
    "platform",
    "posixpath",
    "pprint",
    "quopri",
    "random",
    "reprlib",
    "sched",
    "secrets",
    "shutil",
    "smtplib",
    "string",
    "tarfile",
    "tempfile",
    "tokenize",
    "trace",
    "traceback",
    "types",
    "urllib.parse",
    "uu",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "webbrowser",
    "zipfile",
)

CODE_TASKS = (
    "Add type hints to this function. Reply with the full function only.",
    "Rename the variable `{var}` to `{new}` throughout this function. Reply with the full function only.",
    "Rewrite this function with a longer docstring that explains each argument. Reply with the full function only.",
    "Add a short comment above each line of this function. Reply with the code only.",
    "Rename `{var}` to `{new}` in this function. Reply with the full function only.",
    "Explain what this function does, then show it again with clearer variable names.",
    "Remove the docstring and comments from this function. Reply with the code only.",
)

DOC_TASKS = (
    "Summarise this document in a few bullet points, quoting its names exactly.\n\n{doc}",
    "{doc}\n\nUsing the text above, list the functions or options it mentions and what each does.",
)

NEW_NAMES = ("value", "items", "result_list", "current", "total", "buffer", "index", "parts", "entry", "data")


def _stdlib_source(module_name: str) -> str | None:
    """A standard-library module's source, read from disk (never imported, so
    a same-named file elsewhere on sys.path cannot interfere)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = Path(*module_name.split("."))
    for path in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
        if path.is_file():
            return path.read_text(encoding="utf-8", errors="replace")
    return None


def _parse(module_name: str) -> tuple[ast.Module, list[str]] | None:
    source = _stdlib_source(module_name)
    if source is None:
        return None
    try:
        return ast.parse(source), source.splitlines()
    except SyntaxError:
        return None


def _functions(module_name: str, min_lines: int, max_lines: int) -> Iterator[tuple[str, list[str]]]:
    """(source, local variable names) of the module's top-level functions."""
    parsed = _parse(module_name)
    if parsed is None:
        return
    tree, lines = parsed
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
            n = node.end_lineno - node.lineno + 1
            if min_lines <= n <= max_lines:
                src = "\n".join(lines[node.lineno - 1 : node.end_lineno]) + "\n"
                names = sorted(
                    {t.id for t in ast.walk(node) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
                )
                yield src, names


def default_prompts(n: int, seed: int = 0, min_lines: int = 6, max_lines: int = 40) -> list[str]:
    """``n`` prompts: about 85% code edits of standard-library functions, the
    rest document tasks on module docstrings (benchmark modules excluded)."""
    rng = random.Random(seed)
    funcs = [
        f
        for m in SOURCE_MODULES
        if m.split(".")[0] not in BENCHMARK_MODULES
        for f in _functions(m, min_lines, max_lines)
    ]
    docs = []
    for m in SOURCE_MODULES:
        parsed = _parse(m)
        doc = (ast.get_docstring(parsed[0]) or "").strip() if parsed else ""
        if len(doc) > 400:
            docs.append(textwrap.dedent(doc)[:3000])
    if not funcs:
        raise Hf2qError("found no standard-library source to build training prompts from")
    rng.shuffle(funcs)
    rng.shuffle(docs)
    prompts = []
    for i in range(n):
        if docs and i % 7 == 6:
            prompts.append(rng.choice(DOC_TASKS).format(doc=docs[(i // 7) % len(docs)]))
            continue
        src, names = funcs[i % len(funcs)]
        task = rng.choice(CODE_TASKS if names else [t for t in CODE_TASKS if "{var}" not in t])
        var = rng.choice(names) if names else ""
        new = next((x for x in rng.sample(NEW_NAMES, len(NEW_NAMES)) if x not in names), "renamed")
        prompts.append(f"{task.format(var=var, new=new)}\n\n```python\n{src}```")
    return prompts


def batched_greedy(
    target, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, batch_size: int
) -> list[list[int]]:
    """The target's greedy answer to each token prompt (EOS excluded, at most
    ``max_new_tokens``), decoded ``batch_size`` rows at a time.

    mlx-lm's continuous batching: prompts are left-padded and masked, a row
    leaves the batch at its own EOS or budget and the next prompt takes its
    place. Prompts enter shortest first, so rows prefilled together have
    similar lengths and little padding. Each row's tokens are the argmax of its own logits; they equal
    single-sequence greedy decoding up to the floating-point reduction order
    of batched matmuls (a near-tie, top-2 logits within ~1e-4, can flip).
    """
    from mlx_lm.generate import BatchGenerator

    if not prompts:
        return []
    stop = [[t] for t in sorted(target.eos_token_ids)]
    gen = BatchGenerator(
        target.model,
        stop_tokens=stop or None,
        completion_batch_size=batch_size,
        prefill_batch_size=batch_size,
    )
    try:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        uids = gen.insert([list(prompts[i]) for i in order], [max_new_tokens] * len(prompts))
        answers: dict[int, list[int]] = {u: [] for u in uids}
        while responses := gen.next_generated():
            for r in responses:
                if r.finish_reason != "stop":
                    answers[r.uid].append(int(r.token))
    finally:
        gen.close()
    out: list[list[int]] = [[] for _ in prompts]
    for i, u in zip(order, uids):
        out[i] = answers[u]
    return out


def self_distill(
    target,
    prompts: Sequence[str],
    path: Path,
    *,
    max_new_tokens: int,
    batch_size: int = 8,
    log: Callable[[str], None] = lambda s: None,
) -> list[dict]:
    """The target's greedy answer to each prompt, appended to the JSONL file
    ``path`` as {"prompt_tokens": n, "tokens": [...]} (prompt + answer), in
    prompt order. Answers are decoded ``batch_size`` at a time
    (``batched_greedy``) and written after each group of ``4 * batch_size``
    prompts; ``batch_size`` 1 decodes one prompt at a time. Prompts already
    answered in ``path`` are not generated again."""
    from ..generation import encode_prompt

    rows: list[dict] = []
    if path.exists():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    t0, start = time.perf_counter(), len(rows)
    group = 1 if batch_size == 1 else 4 * batch_size
    with path.open("a") as f:
        for lo in range(start, len(prompts), group):
            ids = [encode_prompt(target, p, True) for p in prompts[lo : lo + group]]
            answers = batched_greedy(target, ids, max_new_tokens=max_new_tokens, batch_size=batch_size)
            for p, a in zip(ids, answers):
                row = {"prompt_tokens": len(p), "tokens": p + a}
                f.write(json.dumps(row) + "\n")
                rows.append(row)
            f.flush()
            done = lo + len(ids)
            rate = (time.perf_counter() - t0) / (done - start)
            log(f"data {done}/{len(prompts)}: {sum(len(a) for a in answers)} tokens ({rate:.1f} s/answer)")
    return rows[: len(prompts)]
