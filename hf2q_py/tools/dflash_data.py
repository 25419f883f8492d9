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
    "argparse", "base64", "bisect", "calendar", "colorsys", "configparser", "csv", "difflib", "dis",
    "email.utils", "fnmatch", "fractions", "ftplib", "functools", "genericpath", "getopt", "gettext",
    "glob", "gzip", "html", "imaplib", "inspect", "ipaddress", "locale", "mimetypes", "ntpath",
    "numbers", "operator", "optparse", "pathlib", "pickle", "pkgutil", "platform", "posixpath",
    "pprint", "quopri", "random", "reprlib", "sched", "secrets", "shutil", "smtplib", "string",
    "tarfile", "tempfile", "tokenize", "trace", "traceback", "types", "urllib.parse", "uu", "uuid",
    "warnings", "wave", "weakref", "webbrowser", "zipfile",
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
                names = sorted({t.id for t in ast.walk(node) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)})
                yield src, names


def default_prompts(n: int, seed: int = 0, min_lines: int = 6, max_lines: int = 40) -> list[str]:
    """``n`` prompts: about 85% code edits of standard-library functions, the
    rest document tasks on module docstrings (benchmark modules excluded)."""
    rng = random.Random(seed)
    funcs = [f for m in SOURCE_MODULES if m.split(".")[0] not in BENCHMARK_MODULES for f in _functions(m, min_lines, max_lines)]
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


def self_distill(
    target,
    prompts: Sequence[str],
    path: Path,
    *,
    max_new_tokens: int,
    log: Callable[[str], None] = lambda s: None,
) -> list[dict]:
    """The target's greedy answer to each prompt, appended to the JSONL file
    ``path`` as {"prompt_tokens": n, "tokens": [...]} (prompt + answer).
    Prompts already answered in ``path`` are not generated again."""
    from ..generation import encode_prompt, generate

    rows: list[dict] = []
    if path.exists():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    t0, start = time.perf_counter(), len(rows)
    with path.open("a") as f:
        for i in range(start, len(prompts)):
            ids = encode_prompt(target, prompts[i], True)
            r = generate(target, ids, max_tokens=max_new_tokens, method="ngram")
            row = {"prompt_tokens": len(ids), "tokens": ids + r.tokens}
            f.write(json.dumps(row) + "\n")
            f.flush()
            rows.append(row)
            rate = (time.perf_counter() - t0) / (i + 1 - start)
            log(f"data {i + 1}/{len(prompts)}: {len(r.tokens)} tokens ({rate:.1f} s/answer)")
    return rows[: len(prompts)]
