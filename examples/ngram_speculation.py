"""Prompt-lookup (n-gram) speculative decoding, side by side with plain decoding.

python examples/ngram_speculation.py
"""

from pathlib import Path

import hf2q_py

target = hf2q_py.load()
prompt = (Path(__file__).parent / "prompts" / "type_hints.txt").read_text()

plain = hf2q_py.generate(target, prompt, max_tokens=200, method="baseline")
fast = hf2q_py.generate(target, prompt, max_tokens=200, method="ngram", k=16, ngram_min=1, ngram_max=5)

print(fast.text)
print(f"baseline: {plain.stats.summary()}")
print(f"ngram:    {fast.stats.summary()}")
print(f"identical to plain greedy decoding: {fast.tokens == plain.tokens}")
