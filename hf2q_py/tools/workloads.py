"""Benchmark workloads built from real text present on every machine:
Python standard-library source (code editing, re-emitting a file with one
change, an agent's successive edits of one file), documents shipped in
installed packages (summaries and questions), fresh code and open prose
(little to copy)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Workload:
    """One request, or a session of requests on one Target: ``then`` holds
    the later requests as (label, prompt) pairs, where ``{answer}`` stands for
    the previous request's answer (the file as the agent last wrote it) and a
    prompt of None retries the previous request."""

    name: str
    kind: str  # "code", "agent", "doc", "fresh" or "prose"
    prompt: str
    then: tuple[tuple[str, str | None], ...] = ()

    def requests(self, answers: list[str]) -> list[tuple[str, str]]:
        """(label, prompt) of every request whose prompt is known once
        ``answers`` (the answers so far, in order) are."""
        out = [(self.name, self.prompt)]
        for i, (label, template) in enumerate(self.then):
            if i >= len(answers):
                break
            prompt = out[-1][1] if template is None else template.replace("{answer}", answers[i])
            out.append((f"{self.name} / {label}", prompt))
        return out


def _source(module: str, name: str) -> str:
    mod = __import__(module, fromlist=[name])
    return inspect.getsource(getattr(mod, name))


def _package_doc(package: str, filename: str, max_chars: int = 4000) -> str:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return ""
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    return path.read_text(encoding="utf-8")[:max_chars] if path.is_file() else ""


#: The second edit of the agent session, applied to the answer to the first.
EDIT_AGAIN = "Add type hints to this function. Reply with the full function only.\n\n{answer}"

#: The workloads of ``default_workloads``, their prompts as templates: ``{median}``
#: and the like stand for the texts of ``_quoted_texts``.
WORKLOAD_TEMPLATES = (
    Workload(
        "code: type hints (statistics.median)",
        "code",
        "Add type hints to this function. Reply with the full function only.\n\n```python\n{median}```",
    ),
    Workload(
        "code: rename (textwrap.dedent)",
        "code",
        "Rename the variable `margin` to `common_prefix` throughout this function. "
        "Reply with the full function only.\n\n```python\n{dedent}```",
    ),
    Workload(
        "code: docstring (shlex.split)",
        "code",
        "Rewrite this function with a longer docstring that explains each argument. "
        "Reply with the full function only.\n\n```python\n{split}```",
    ),
    Workload(
        "code: rename (heapq.nsmallest)",
        "code",
        "Rename `result` to `smallest` in this function. Reply with the full function only.\n\n"
        "```python\n{nsmallest}```",
    ),
    Workload(
        "code: comments (statistics.variance)",
        "code",
        "Add a short comment above each line of this function. Reply with the code only.\n\n"
        "```python\n{variance}```",
    ),
    Workload(
        "agent: rename (textwrap.indent)",
        "agent",
        "Rename `predicate` to `should_indent` in this function. Reply with the full function only.\n\n"
        "```python\n{indent}```",
        then=(("type hints", EDIT_AGAIN), ("retry", None)),
    ),
    Workload(
        "code: re-emit with one change (json.dumps)",
        "code",
        "Change the default of `sort_keys` to True in this function and reply with the full "
        "function, unchanged otherwise.\n\n```python\n{dumps}```",
    ),
    Workload(
        "doc: summarise (mlx-lm server guide)",
        "doc",
        "Summarise this document in a few bullet points, quoting its commands exactly.\n\n{readme}",
    ),
    Workload(
        "doc: question (mlx-lm LoRA guide)",
        "doc",
        "{lora}\n\nUsing the document above, list the command-line flags it mentions and what each does.",
    ),
    Workload(
        "doc: question (json module docstring)",
        "doc",
        "{json_doc}\n\nShow how to encode and decode a dictionary, using the examples above.",
    ),
    Workload(
        "fresh: ini parser",
        "fresh",
        "Write a Python function `parse_ini(text: str) -> dict[str, dict[str, str]]` that parses "
        "INI-style text into sections of key-value pairs, skipping comments. Include a docstring.",
    ),
    Workload(
        "fresh: lru cache",
        "fresh",
        "Write a Python class `LRUCache` with `get` and `put` methods and a fixed capacity, "
        "using only the standard library, with type hints.",
    ),
    Workload(
        "prose: story",
        "prose",
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    ),
    Workload("prose: explain", "prose", "Explain to a child why the sky is blue and why sunsets are red."),
)


def _quoted_texts() -> dict[str, str]:
    """The real texts the workload prompts quote, by template field."""
    json_doc = __import__("json").__doc__ or ""
    return {
        "dedent": _source("textwrap", "dedent"),
        "median": _source("statistics", "median"),
        "nsmallest": _source("heapq", "nsmallest"),
        "variance": _source("statistics", "variance"),
        "split": _source("shlex", "split"),
        "readme": _package_doc("mlx_lm", "SERVER.md") or json_doc,
        "lora": _package_doc("mlx_lm", "LORA.md") or (__import__("argparse").__doc__ or ""),
        "json_doc": json_doc,
        "indent": _source("textwrap", "indent"),
        "dumps": _source("json", "dumps"),
    }


def default_workloads() -> list[Workload]:
    """Fourteen prompts: 5 code edits, an agent session (an edit, a second
    edit of the answer, the second one retried), a file re-emitted with one
    change, 3 document tasks, 2 fresh code and 2 open prose."""
    texts = _quoted_texts()
    return [replace(w, prompt=w.prompt.format(**texts)) for w in WORKLOAD_TEMPLATES]
