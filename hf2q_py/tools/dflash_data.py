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
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx

from ..errors import Hf2qError
from ..taps import tapped
from ..target import PREFILL_CHUNK

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


@dataclass
class Answer:
    """One greedy answer; with capture, also what the training pass would
    compute for ``prompt + tokens`` (see ``dflash_train.target_pass``)."""

    tokens: list[int]  # the answer, EOS excluded
    features: mx.array | None = None  # (1, S, n_layers * H) float16: hidden states at the capture layers
    agrees: mx.array | None = None  # (S,) bool: token j is the target's greedy choice after tokens[:j]
    finals: mx.array | None = None  # (1, S, H) float16: the final-norm states


@dataclass(frozen=True)
class CapturedPass:
    """A row's training-pass outputs taken during its generation, for the
    target layers ``layer_ids`` (see ``Answer``)."""

    layer_ids: tuple[int, ...]
    features: mx.array
    agrees: mx.array
    finals: mx.array


@dataclass
class GenerationTimes:
    """Where batched generation spends its time (seconds, accumulated)."""

    prefill: float = 0.0  # prompt forwards (with capture: their greedy choices too)
    decode: float = 0.0  # one-token steps of the whole batch
    other: float = 0.0  # cache merging, filtering and bookkeeping between forwards
    prefill_tokens: int = 0  # prompt positions prefilled (padding included)
    steps: int = 0  # decode steps
    rows: int = 0  # row-steps (decode steps x active rows)


#: Prefill chunks hold at most this many positions over all rows (with
#: capture, every position's logits are materialised: 2048 x vocab floats).
PREFILL_ROWS = 2048


class _Rows:
    """The rows of a batch being decoded: their caches and per-row state."""

    def __init__(self):
        self.cache: list | None = None
        self.ids: list[int] = []  # prompt index of each row
        self.inputs: list[int] = []  # the next token each row feeds
        self.closing: list[bool] = []  # fed its last answer token only to capture its features

    def add(self, cache: list, ids: list[int], inputs: list[int]) -> None:
        if self.cache is None or not self.ids:
            self.cache = cache
        else:
            for mine, theirs in zip(self.cache, cache):
                mine.extend(theirs)
        self.ids += ids
        self.inputs += inputs
        self.closing += [False] * len(ids)

    def keep(self, rows: list[int]) -> None:
        if len(rows) == len(self.ids):
            return
        if rows:
            for c in self.cache:
                c.filter(rows)
        else:
            self.cache = None
        self.ids = [self.ids[r] for r in rows]
        self.inputs = [self.inputs[r] for r in rows]
        self.closing = [self.closing[r] for r in rows]


def batched_answers(
    target,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    batch_size: int,
    capture_layers: Sequence[int] | None = None,
    times: GenerationTimes | None = None,
) -> list[Answer]:
    """The target's greedy answer to each token prompt (EOS excluded, at most
    ``max_new_tokens``), decoded ``batch_size`` rows at a time in the order
    of ``entry_order``; see ``answer_stream``."""
    order = entry_order(prompts, max(1, len(prompts)))
    answers: list[Answer | None] = [None] * len(prompts)
    for i, a in answer_stream(
        target,
        prompts,
        order,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        capture_layers=capture_layers,
        times=times,
    ):
        answers[i] = a
    return answers


def answer_stream(
    target,
    prompts: Sequence[Sequence[int]],
    order: Sequence[int],
    *,
    max_new_tokens: int,
    batch_size: int,
    capture_layers: Sequence[int] | None = None,
    times: GenerationTimes | None = None,
) -> Iterator[tuple[int, Answer]]:
    """(prompt index, answer) of the prompts in ``order``, as each answer
    ends: greedy (EOS excluded, at most ``max_new_tokens``), ``batch_size``
    rows at a time.

    Continuous batching: prompts enter in ``order``, prefilled in groups of
    similar lengths (``length_groups``: little padding) and left-padded in the
    shared cache; a row leaves at its own EOS
    or budget and free rows are refilled with the next prompts. Each row's
    token is the argmax of its own logits; the answers equal one-at-a-time
    greedy decoding up to the floating-point reduction order of batched
    matmuls (a near-tie, top-2 logits within ~1e-4, can flip).

    With ``capture_layers`` each answer also carries the hidden states at
    those layers, the final-norm states and the greedy-agreement flags for
    every position of prompt + answer, taken from the generating forwards
    themselves: the training pass over the finished sequences is not needed.
    """
    if any(len(prompts[i]) == 0 for i in order):
        raise Hf2qError("cannot answer an empty prompt")
    times = times if times is not None else GenerationTimes()
    batch = _Batch(target, prompts, order, max_new_tokens, capture_layers, times)
    pending = list(order)[::-1]  # pop() takes the next
    # free rows worth a prefill (the last prompts enter as soon as any row frees)
    refill = max(1, batch_size // 4)
    while pending or batch.rows.ids:
        free = batch_size - len(batch.rows.ids)
        if pending and (free >= min(refill, len(pending)) or not batch.rows.ids):
            for group in length_groups([pending.pop() for _ in range(min(free, len(pending)))], prompts):
                batch.prefill(group)
        done, t1 = batch.decode_step()
        for i in done:
            a = batch.finish(i)
            times.other += time.perf_counter() - t1
            yield i, a
            t1 = time.perf_counter()
        times.other += time.perf_counter() - t1


class _Batch:
    """The continuous batch of one ``answer_stream``: its rows, their answers
    so far and, with capture, the pieces of their training pass."""

    def __init__(
        self,
        target,
        prompts: Sequence[Sequence[int]],
        order: Sequence[int],
        max_new_tokens: int,
        capture_layers: Sequence[int] | None,
        times: GenerationTimes,
    ):
        self.model, self.eos = target.model, set(target.eos_token_ids)
        self.prompts, self.max_new_tokens, self.times = prompts, max_new_tokens, times
        self.layers = tuple(capture_layers) if capture_layers is not None else None
        self.answers = {i: Answer([]) for i in order}
        # captured pieces per prompt: (features, finals) chunks and greedy choices at prompt positions
        self.pieces: dict[int, list[tuple[mx.array, mx.array]]] = {}
        self.greedy: dict[int, list[mx.array]] = {}
        self.rows = _Rows()

    def forward(self, x: mx.array, cache: list) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """(logits, features, final states) of one forward; without capture
        only the logits."""
        if self.layers is None:
            return self.model(x, cache=cache), None, None
        with tapped(self.model, capture_layers=self.layers, capture_final=True) as rec:
            out = self.model(x, cache=cache)
        feats = mx.concatenate([rec.layers[i] for i in self.layers], axis=-1).astype(mx.float16)
        return out, feats, rec.final.astype(mx.float16)

    def prefill(self, ids: list[int]) -> None:
        """Prefill prompt[:-1] of ``ids`` (right-padded) and add them to the rows."""
        from mlx_lm.models.cache import make_prompt_cache

        t0 = time.perf_counter()
        singles = [make_prompt_cache(self.model) for _ in ids]
        cache = [singles[0][j].merge([s[j] for s in singles]) for j in range(len(singles[0]))]
        heads = [list(self.prompts[i][:-1]) for i in ids]
        if max(len(h) for h in heads):
            self._prefill_heads(ids, heads, cache)
        t1 = time.perf_counter()
        self.times.prefill += t1 - t0
        self.rows.add(cache, ids, [self.prompts[i][-1] for i in ids])
        self.times.other += time.perf_counter() - t1

    def _prefill_heads(self, ids: list[int], heads: list[list[int]], cache: list) -> None:
        """Run the (non-empty) prompt heads through ``cache`` in chunks,
        right-padded to the longest, keeping captured pieces."""
        lengths = [len(h) for h in heads]
        width = max(lengths)
        pad = [width - n for n in lengths]
        if max(pad):
            for c in cache:
                c.prepare(lengths=lengths, right_padding=pad)
        x = mx.array([h + [0] * (width - len(h)) for h in heads], dtype=mx.uint32)
        step = min(PREFILL_CHUNK, max(16, PREFILL_ROWS // len(ids)))
        for lo in range(0, width, step):
            out, feats, finals = self.forward(x[:, lo : lo + step], cache)
            state = [c.state for c in cache]
            if self.layers is None:
                mx.eval(state)
                continue
            choice = mx.argmax(out, axis=-1)
            mx.eval(state, feats, finals, choice)
            for r, i in enumerate(ids):
                n = min(lengths[r], lo + step) - lo
                if n > 0:
                    self.pieces.setdefault(i, []).append((feats[r, :n], finals[r, :n]))
                    self.greedy.setdefault(i, []).append(choice[r, :n])
        if max(pad):
            for c in cache:
                c.finalize()
            mx.eval([c.state for c in cache])
        self.times.prefill_tokens += len(ids) * width

    def decode_step(self) -> tuple[list[int], float]:
        """One token for every row; returns the prompts whose answers ended and
        the time the step's forward finished."""
        rows, times = self.rows, self.times
        t0 = time.perf_counter()
        x = mx.array(rows.inputs, dtype=mx.uint32)[:, None]
        out, feats, finals = self.forward(x, rows.cache)
        nxt = mx.argmax(out[:, -1], axis=-1)
        mx.eval(nxt, feats, finals, [c.state for c in rows.cache])
        toks = nxt.tolist()
        t1 = time.perf_counter()
        times.decode += t1 - t0
        times.steps += 1
        times.rows += len(rows.ids)
        done = self._advance(toks, feats, finals)
        if times.steps % 256 == 0:
            mx.clear_cache()
        return done, t1

    def _advance(self, toks: list[int], feats: mx.array | None, finals: mx.array | None) -> list[int]:
        """Append each row's token (keeping its captured states); rows at EOS
        or their budget leave. Returns the prompts that left."""
        rows, keep, done = self.rows, [], []
        for r, (i, tok) in enumerate(zip(rows.ids, toks)):
            if self.layers is not None:
                self.pieces.setdefault(i, []).append((feats[r], finals[r]))
            if rows.closing[r] or tok in self.eos:
                done.append(i)
                continue
            self.answers[i].tokens.append(tok)
            rows.inputs[r] = tok
            if len(self.answers[i].tokens) >= self.max_new_tokens:
                if self.layers is None:
                    done.append(i)
                    continue
                rows.closing[r] = True  # one more step captures the last token's states
            keep.append(r)
        rows.keep(keep)
        return done

    def finish(self, i: int) -> Answer:
        """The finished answer to prompt ``i``, with its capture joined."""
        a = self.answers.pop(i)
        if self.layers is not None:
            _attach_capture(a, self.prompts[i], self.pieces.pop(i), self.greedy.pop(i, []))
        return a


def entry_order(prompts: Sequence[Sequence[int]], window: int) -> list[int]:
    """The order prompts enter a continuous batch: window by window (``window``
    consecutive prompts), longest first within a window. Prompt and answer
    lengths go together (an edited function is about as long as the
    original), so the long answers start early and short ones fill the last
    rows: the batch drains quickly at the end."""
    return [
        i
        for lo in range(0, len(prompts), window)
        for i in sorted(range(lo, min(lo + window, len(prompts))), key=lambda i: -len(prompts[i]))
    ]


#: Prompts are prefilled together only while padding stays under this share of the positions.
MAX_PADDING = 0.125


def length_groups(ids: Sequence[int], prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """``ids`` split into groups to prefill together: by length, each group's
    padding (to its longest prompt) at most ``MAX_PADDING`` of its positions."""
    groups: list[list[int]] = []
    for i in sorted(ids, key=lambda i: len(prompts[i])):
        g = groups[-1] if groups else None
        if g is not None:
            width = len(prompts[i])  # the longest so far: sorted
            real = sum(len(prompts[j]) for j in g) + width
            if (len(g) + 1) * width - real <= MAX_PADDING * (len(g) + 1) * width:
                g.append(i)
                continue
        groups.append([i])
    return groups


def _attach_capture(a: Answer, prompt: Sequence[int], pieces: list, greedy: list) -> None:
    """Join a finished row's captured pieces into its ``Answer``."""
    a.features = mx.concatenate([f for f, _ in pieces], axis=0)[None]
    a.finals = mx.concatenate([g for _, g in pieces], axis=0)[None]
    agrees = [False] + [True] * (len(prompt) + len(a.tokens) - 1)
    if greedy:  # position j > 0 of the prompt: the greedy choice after tokens[:j]
        ok = (mx.concatenate(greedy) == mx.array(prompt[1:], dtype=mx.uint32)).tolist()
        agrees[1 : len(prompt)] = ok
    a.agrees = mx.array(agrees)
    mx.eval(a.features, a.finals, a.agrees)


def batched_greedy(
    target, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, batch_size: int
) -> list[list[int]]:
    """The answers of ``batched_answers`` (token lists only)."""
    return [
        a.tokens
        for a in batched_answers(target, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    ]


def self_distill(
    target,
    prompts: Sequence[str],
    path: Path,
    *,
    max_new_tokens: int,
    batch_size: int = 8,
    capture_layers: Sequence[int] | None = None,
    times: GenerationTimes | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> list[dict]:
    """The target's greedy answer to each prompt, appended to the JSONL file
    ``path`` as {"prompt_tokens": n, "tokens": [...]} (prompt + answer), in
    prompt order. Answers are decoded ``batch_size`` at a time in one
    continuous batch (``answer_stream``; ``batch_size`` 1 decodes one prompt
    at a time): prompts enter window by window (``entry_order``, windows of
    ``4 * batch_size`` prompts), and each answer is written as soon as
    every earlier prompt's is, so an interrupted run loses only the rows in
    flight. Prompts already answered in ``path`` are not generated again.

    With ``capture_layers``, each newly generated row also holds (in memory,
    never in the file) ``"captured"``: the ``CapturedPass`` that
    ``dflash_train.train`` uses instead of a separate target pass."""
    from ..generation import encode_prompt

    rows = _read_rows(path)
    start = len(rows)
    if start >= len(prompts):
        return rows[: len(prompts)]
    ids = [encode_prompt(target, p, True) for p in prompts[start:]]
    window = 1 if batch_size == 1 else 4 * batch_size
    stream = answer_stream(
        target,
        ids,
        entry_order(ids, window),
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        capture_layers=capture_layers,
        times=times,
    )
    t0, n_tokens = time.perf_counter(), 0
    with path.open("a") as f:
        for written, a in enumerate(_in_prompt_order(stream), 1):
            p = ids[written - 1]
            row = {"prompt_tokens": len(p), "tokens": p + a.tokens}
            f.write(json.dumps(row) + "\n")
            f.flush()
            if capture_layers is not None:
                row["captured"] = CapturedPass(tuple(capture_layers), a.features, a.agrees, a.finals)
            rows.append(row)
            n_tokens += len(a.tokens)
            if written % window == 0 or written == len(ids):
                rate = (time.perf_counter() - t0) / written
                log(f"data {start + written}/{len(prompts)}: {n_tokens} tokens ({rate:.1f} s/answer)")
                n_tokens = 0
    return rows[: len(prompts)]


def _read_rows(path: Path) -> list[dict]:
    """The rows already written to the JSONL file ``path`` (none if it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _in_prompt_order(stream: Iterator[tuple[int, Answer]]) -> Iterator[Answer]:
    """The answers of ``stream`` in prompt order (0, 1, ...), each as soon as
    every earlier prompt's has come."""
    finished: dict[int, Answer] = {}
    written = 0
    for i, a in stream:
        finished[i] = a
        while written in finished:
            yield finished.pop(written)
            written += 1
