"""llama.cpp as the oracle for what a GGUF file means.

Tiny random models of every architecture hf2q-py maps from GGUF are written
in llama.cpp's own layout (``tests/gguf_export.py``, the converter's
conventions) as F32, Q8_0 and Q4_K files, then loaded by llama.cpp (whose
strict tensor name and shape checks are part of the check) and by hf2q-py.
Both get the same token ids. Compared: the logits of the first step (every
prompt position) and the greedy tokens of plain decoding and of each
speculative method (n-gram, a draft model, layer skip, DFlash), prompt and
output past every sliding window.

Tolerances. llama.cpp's CPU kernels compute F32 weights in float32 (its KV
cache is set to F32 here too), except the GELU of Gemma models, which goes
through a float16 lookup table (about 1e-3 of each activation). For quantized
weights they also round each activation row to 8 bits (Q8_0 / Q8_K blocks)
before the dot products, which moves llama.cpp's own logits by a few percent
on these random models. So each quantized file is also written as F32 holding
the same values: hf2q-py's logits (the file loaded as float32, and kept
quantized) must equal llama.cpp's on that file within 1e-5 of the logits'
range (5e-3 for Gemma, several GELUs deep), and every method's greedy tokens must equal its
greedy tokens. Against llama.cpp's run of the quantized file itself, plain
greedy tokens must be equal or first differ at a near tie (llama.cpp's own
top two logits closer than twice the logit difference).

Needs llama-cpp-python 0.3.36 built from source (about 8 minutes on 2 cores; not in CI):

    CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \\
        pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36
    python benchmarks/check_llama_cpp.py --results benchmarks/results/llama_cpp_check.json
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

import hf2q_py  # first: loads OpenBLAS before mlx.core

import mlx.core as mx
import numpy as np

from hf2q_py.errors import Hf2qError, run_script
from hf2q_py.tools import results
from hf2q_py.tools.files import check_writable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gguf_export import EXPORTS, VOCAB, Q, export  # noqa: E402
from gguf_export_gemma4 import GEMMA4_EXPORTS  # noqa: E402

#: Architectures checked (EXPORTS names) and config changes making rows of 256
#: values, so that Q4_K blocks fit (other rows take llama.cpp's fallback type).
ARCHS = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma2",
    "gemma3",
    "qwen3moe",
    "mixtral",
    *GEMMA4_EXPORTS,
)
WIDE = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256}
QTYPES = ("F32", "Q8_0", "Q4_K")
METHODS = ("plain", "ngram", "draft", "layerskip", "dflash")
PROMPT = [(37 * i + 11) % VOCAB for i in range(12)] * 2  # 24 tokens, repeated: n-gram drafts
NEW_TOKENS = 24


def llama_cpp_run(path: Path, prompt: list[int], n: int) -> tuple[np.ndarray, list[int], list[float]]:
    """llama.cpp's logits at every prompt position, its greedy continuation and
    the gap between its top two logits at each generated position."""
    from llama_cpp import Llama

    llm = Llama(
        str(path), n_ctx=256, n_batch=256, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0
    )
    llm.eval(prompt)
    logits = np.array(llm.scores[: len(prompt)], dtype=np.float32)
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    margins = [_margin(llm.scores[len(prompt) - 1 + i]) for i in range(n)]
    llm.close()
    return logits, out, margins


def _margin(row: np.ndarray) -> float:
    top = np.sort(np.asarray(row, dtype=np.float64))[-2:]
    return float(top[1] - top[0])


def method_options(method: str, target, draft_path: Path, dtype: str) -> dict:
    from helpers import UNGATED

    from hf2q_py.tools.dflash_make import drafter_for

    if method == "draft":
        return {"draft": hf2q_py.load(draft_path, dtype=dtype), **UNGATED}
    if method == "layerskip":
        return {"skip_layers": [1]}
    if method == "dflash":
        return {"drafter": drafter_for(target, layers=1, target_layer_ids=[0, 1], block_size=9)}
    return {}


def verdict(ours: list[int], theirs: list[int], margins: list[float], tolerance: float) -> str:
    """'equal', 'near tie at i' (llama.cpp's own top two within the tolerance), or 'DIFFERENT at i'."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return f"near tie at {i}" if margins[i] <= tolerance else f"DIFFERENT at {i}"
    return "equal" if len(ours) == len(theirs) else "DIFFERENT length"


def check_case(root: Path, name: str, qtype: str) -> dict:
    cfg = GEMMA4_EXPORTS[name] if name in GEMMA4_EXPORTS else EXPORTS[name][1]
    overrides = {k: v for k, v in WIDE.items() if k in cfg or k == "hidden_size"} if qtype == "Q4_K" else {}
    path, draft_path = root / f"{name}-{qtype}.gguf", root / f"{name}-{qtype}-draft.gguf"
    export(path, name, Q[qtype], seed=0, **overrides)
    export(draft_path, name, Q[qtype], seed=1, **overrides)
    theirs_logits, theirs, margins = llama_cpp_run(path, PROMPT, NEW_TOKENS)
    exact_logits, exact, exact_margins = theirs_logits, theirs, margins
    if qtype != "F32":  # the same values as F32, which llama.cpp computes without rounding activations
        floats_path = root / f"{name}-{qtype}-as-f32.gguf"
        export(floats_path, name, Q[qtype], seed=0, as_floats=True, **overrides)
        exact_logits, exact, exact_margins = llama_cpp_run(floats_path, PROMPT, NEW_TOKENS)
    scale = float(np.abs(exact_logits).max())
    row = {"arch": name, "file type": qtype, "logit scale": scale}
    row["llama.cpp activation rounding"] = float(np.abs(theirs_logits - exact_logits).max())
    for dtype in ("float32", "keep") if qtype != "F32" else ("float32",):
        target = hf2q_py.load(path, dtype=dtype)
        target.eos_token_ids = set()
        ours_logits = np.array(target.model(mx.array([PROMPT]))[0].astype(mx.float32))
        gap = float(np.abs(ours_logits - exact_logits).max())
        row[f"{dtype} logit gap"] = gap
        for method in METHODS:
            opts = {} if method == "plain" else method_options(method, target, draft_path, dtype)
            kw = (
                {"method": "baseline"} if method == "plain" else {"method": method, "k": 8, "adaptive": False}
            )
            got = hf2q_py.generate(target, PROMPT, max_tokens=NEW_TOKENS, **kw, **opts).tokens
            row[f"{dtype} {method}"] = verdict(got, exact, exact_margins, 2 * gap)
            if method == "plain" and qtype != "F32":
                rounding = 2 * float(np.abs(ours_logits - theirs_logits).max())
                row[f"{dtype} plain vs quantized run"] = verdict(got, theirs, margins, rounding)
    return row


#: Vocabulary kinds and a file of each: SentencePiece-style with and without
#: a space prefix, Gemma 4's BPE, byte-level BPE.
VOCABS = {
    "llama (space prefix)": "llama",
    "llama (Gemma, none)": "gemma3",
    "gemma4": "gemma4-dense",
    "gpt2": "qwen2",
}
EXTRA_TEXT = [
    "a\n\n\nb  c\n",
    " leading space",
    "trailing \n",
    "x😀y",
    "<start_of_turn>user\nHi<end_of_turn>\n",
]


def vocab_rows(root: Path) -> list[dict]:
    """Token ids of the SentencePiece corpus (and more) from both, per vocabulary kind."""
    from gguf_vocab import CORPUS, bpe_metadata
    from llama_cpp import Llama

    rows = []
    for kind, name in VOCABS.items():
        path = root / f"vocab-{name}.gguf"
        export(path, name, Q.F32, vocab=bpe_metadata() if kind == "gpt2" else None)
        ours = hf2q_py.load(path, dtype="float32").tokenizer
        llm = Llama(str(path), vocab_only=True, verbose=False)
        texts = [*CORPUS, *EXTRA_TEXT]
        same = [ours.encode(t) == llm.tokenize(t.encode(), add_bos=True, special=True) for t in texts]
        rows.append({"kind": kind, "texts": len(texts), "equal ids": sum(same)})
        llm.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", nargs="*", default=list(ARCHS), choices=list(ARCHS))
    ap.add_argument("--qtypes", nargs="*", default=list(QTYPES), choices=list(QTYPES))
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    if args.results:
        check_writable(args.results, "--results file")
    try:
        import llama_cpp
    except ImportError:
        raise Hf2qError("llama-cpp-python is not installed (see this script's docstring)") from None
    rows, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        vocabs = vocab_rows(Path(tmp))
        for name in args.archs:
            for qtype in args.qtypes:
                rows.append(check_case(Path(tmp), name, qtype))
                print(_line(rows[-1]), flush=True)
    publish(rows, vocabs, args, llama_cpp.__version__, time.perf_counter() - t0)


def _line(row: dict) -> str:
    return " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values())


def publish(rows: list[dict], vocabs: list[dict], args, version: str, seconds: float) -> None:
    columns = ["arch", "file", "logit scale", "llama.cpp's rounding", "gap float32", "gap keep", *METHODS,
               "plain vs llama.cpp's rounded run"]  # fmt: skip
    table_rows = []
    for r in rows:
        cells = [_both(r, m) for m in (*METHODS, "plain vs quantized run")]
        gaps = [f"{r[k]:.2g}" if k in r else "-" for k in ("float32 logit gap", "keep logit gap")]
        table_rows.append(
            [r["arch"], r["file type"], f"{r['logit scale']:.2g}", f"{r['llama.cpp activation rounding']:.2g}",
             *gaps, *cells]
        )  # fmt: skip
    different = sum("DIFFERENT" in str(v) for r in rows for v in r.values())
    worst = max(max(r["float32 logit gap"], r.get("keep logit gap", 0.0)) / r["logit scale"] for r in rows)
    over = [r["arch"] for r in rows if max(r["float32 logit gap"], r.get("keep logit gap", 0.0)) > bound(r)]
    notes = (
        f"llama-cpp-python {version} (CPU, 2 threads, F32 KV cache) against hf2q-py on the same ids: "
        f"{len(PROMPT)}-token prompt, {NEW_TOKENS} greedy tokens, k=8. Every file loaded in llama.cpp. "
        "'gap': the largest difference between hf2q-py's logits (the file loaded as float32, or kept "
        "quantized) and llama.cpp's on the same values stored as F32 (largest here "
        f"{worst:.2g} of the logits' scale); 'llama.cpp's rounding': what llama.cpp's 8-bit activation rounding moves its own "
        "logits on the quantized file. Method columns: hf2q-py's greedy tokens (float32 / keep loads) "
        "against llama.cpp's on the same values as F32; last column: against llama.cpp's run of the "
        "quantized file itself, where 'near tie at i' means the first difference is where llama.cpp's "
        "own top two logits are within twice the logit difference. "
        f"{different} token sequences differ beyond a near tie. {seconds:.0f} s."
    )
    vocab_table = results.table(
        ["vocabulary kind", "texts", "same ids as llama.cpp"],
        [[v["kind"], str(v["texts"]), str(v["equal ids"])] for v in vocabs],
        "lrr",
        title="Tokenizers",
    )
    rec = results.record(
        shlex.join(["python", *sys.argv]),
        [
            results.table(columns, table_rows, "llrrrr" + "l" * (len(METHODS) + 1), title="Models"),
            vocab_table,
        ],
        notes=notes,
        data={"rows": rows, "vocabularies": vocabs, "prompt": PROMPT, "new_tokens": NEW_TOKENS},
    )
    results.publish(rec, args.results)
    bad_vocabs = [v["kind"] for v in vocabs if v["equal ids"] != v["texts"]]
    if different or over or bad_vocabs:
        raise Hf2qError(
            f"hf2q-py differs from llama.cpp: {different} token sequences; logits of {over}; ids of {bad_vocabs}"
        )


def _both(row: dict, column: str) -> str:
    """The float32 and keep loads' verdicts, once when they agree."""
    return (
        " / ".join(dict.fromkeys(row[f"{d} {column}"] for d in ("float32", "keep") if f"{d} {column}" in row))
        or "-"
    )


def bound(row: dict) -> float:
    """The logit gap allowed: float32 rounding, or for Gemma (GELU) llama.cpp's
    CPU GELU, a float16 lookup table (about 1e-3 of each activation)."""
    return row["logit scale"] * (5e-3 if row["arch"].startswith("gemma") else 1e-5)


if __name__ == "__main__":
    run_script(main)
