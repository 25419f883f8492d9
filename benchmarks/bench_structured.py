"""What structured output costs per token, with and without speculation: the
built-in model (float32) answering the same requests plainly and under a
JSON schema, by plain decoding and by n-gram speculation, alternating in one
process. Every schema-bound answer is validated with ``jsonschema`` (or ended
by the budget as a valid prefix), and each method's tokens are checked
against plain decoding's under the same constraint.

    python benchmarks/bench_structured.py [--repeats 3] [--max-tokens 96] [--results benchmarks/results/structured.json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys

import hf2q_py  # first: loads OpenBLAS before mlx.core

import jsonschema

from hf2q_py.constraints import ConstraintSpec
from hf2q_py.errors import run_script
from hf2q_py.tools import results
from hf2q_py.tools.files import check_writable

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
#: (label, prompt): one whose answer can copy JSON from the prompt, one that cannot.
REQUESTS = (
    ("copyable", 'Reply with JSON like {"name": "Bo", "age": 7, "languages": ["C"]}.\n'
                 "Describe Ada Lovelace, 36, who wrote about the Analytical Engine's language."),
    ("fresh", "Describe a programmer you admire, as a JSON object with name, age and languages."),
)  # fmt: skip
METHODS = ("baseline", "ngram")


def run_one(target, prompt: str, method: str, schema: dict | None, max_tokens: int):
    options = {"json_schema": schema} if schema is not None else {}
    if method == "ngram":
        options["memory"] = False  # each run drafts from its own context only
    return hf2q_py.generate(target, prompt, max_tokens=max_tokens, method=method, **options)


def check(target, r, schema: dict) -> str:
    if r.finish_reason == "stop":
        jsonschema.validate(json.loads(r.text), schema)
        return "valid"
    n, _ = ConstraintSpec.json_schema(schema).build(target).plan(r.tokens)
    return "valid prefix (length)" if n == len(r.tokens) else "INVALID"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    if args.results:
        check_writable(args.results, "--results file")
    target = hf2q_py.load(dtype="float32")
    rows, data = [], []
    for label, prompt in REQUESTS:
        for schema in (None, PERSON):
            runs = {m: [] for m in METHODS}
            for m in METHODS:
                run_one(target, prompt, m, schema, 8)  # warm-up (and the schema's compile)
            for _ in range(args.repeats):
                for m in METHODS:
                    runs[m].append(run_one(target, prompt, m, schema, args.max_tokens))
            plain = runs["baseline"][0]
            for m in METHODS:
                last = runs[m][-1]
                per_token = statistics.median(
                    r.stats.decode_seconds / max(r.stats.generated_tokens, 1) for r in runs[m]
                )
                status = check(target, last, schema) if schema is not None else "-"
                same = "yes" if last.tokens == plain.tokens else "NO"
                rows.append([label, "json_schema" if schema else "none", m, str(len(last.tokens)),
                             f"{per_token * 1e3:.1f}", f"{last.stats.drafted}", f"{last.stats.accepted}", status, same])  # fmt: skip
                data.append(dict(request=label, schema=bool(schema), method=m, ms_per_token=per_token * 1e3,
                                 tokens=len(last.tokens), drafted=last.stats.drafted, accepted=last.stats.accepted,
                                 check=status, same_as_plain=same == "yes"))  # fmt: skip
                print(rows[-1], file=sys.stderr, flush=True)
    cols = [
        "request",
        "constraint",
        "method",
        "tokens",
        "ms / token",
        "drafted",
        "accepted",
        "output",
        "= plain",
    ]
    rec = results.record(
        "python " + shlex.join(sys.argv),
        [
            results.table(
                cols, rows, "lllrrrrll", title="Structured output: per-token cost, plain and speculating"
            )
        ],
        notes=f"Built-in SmolLM2-135M-Instruct (float32, OpenBLAS), at most {args.max_tokens} new tokens, greedy, "
        f"medians of {args.repeats} alternating runs; n-gram without the memory of earlier answers; "
        "'= plain': the same tokens as plain decoding under the same constraint.",
        data={"rows": data},
    )
    results.publish(rec, args.results)


if __name__ == "__main__":
    run_script(main)
