"""Draft-model speculative decoding: a small model of the same tokenizer drafts.

    python examples/draft_model.py TARGET DRAFT

e.g. the Qwen2.5-Coder 1.5B target with its 0.5B sibling as the draft (see
benchmarks/bench_draft.py for where to get both GGUF files).
"""

import sys

import hf2q_py

if len(sys.argv) != 3:
    sys.exit(__doc__)
target = hf2q_py.load(sys.argv[1])
draft = hf2q_py.load(sys.argv[2])
prompt = "Rename `total` to `acc` throughout:\n\ndef mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n"

plain = hf2q_py.generate(target, prompt, max_tokens=96, method="baseline")
fast = hf2q_py.generate(target, prompt, max_tokens=96, method="draft", draft=draft, k=4, draft_p_min=0.3)
print(fast.text)
print(f"baseline: {plain.stats.summary()}")
print(f"draft:    {fast.stats.summary()}")
print(f"identical to plain greedy decoding: {fast.tokens == plain.tokens}")
