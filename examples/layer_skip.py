"""Layer-skip self-speculation: the target drafts with some layers skipped.

    python examples/layer_skip.py [MODEL]

``skip_layers="auto"`` measures a few skip sets on the real output and keeps the
fastest, or plain decoding when none pays (the usual case for a 135M model on a CPU).
"""

import sys

import hf2q_py

target = hf2q_py.load(sys.argv[1] if len(sys.argv) > 1 else None)
prompt = "Explain what a hash table is, with a short Python example."

plain = hf2q_py.generate(target, prompt, max_tokens=96, method="baseline")
for skip in ("middle:6", "auto"):
    r = hf2q_py.generate(target, prompt, max_tokens=96, method="layerskip", skip_layers=skip, k=3)
    print(f"skip {skip:9s}: {r.stats.summary()}; identical: {r.tokens == plain.tokens}")
print(f"baseline       : {plain.stats.summary()}")
