"""DFlash block drafting: a small drafter reads the target's hidden states and
drafts a whole block per forward.

    python examples/dflash.py [DRAFTER_FOLDER]

Without an argument it uses drafters/smollm2-135m-dflash, the folder that
`hf2q-py train-dflash --out drafters/smollm2-135m-dflash` writes for the
built-in model (see the README for the exact command). Any folder in the
published DFlash format (config.json + safetensors) made for the loaded
target works the same way.
"""

import sys
from pathlib import Path

import hf2q_py

drafter = (
    sys.argv[1]
    if len(sys.argv) > 1
    else str(Path(__file__).parent.parent / "drafters" / "smollm2-135m-dflash")
)
target = hf2q_py.load()
prompt = (
    "Rename `total` to `acc` throughout this function. Reply with the full function only.\n\n"
    "```python\ndef mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n```"
)

plain = hf2q_py.generate(target, prompt, max_tokens=96, method="baseline")
fast = hf2q_py.generate(target, prompt, max_tokens=96, method="dflash", drafter=drafter)
print(fast.text)
print(f"baseline: {plain.stats.summary()}")
print(f"dflash:   {fast.stats.summary()}")
print(f"identical to plain greedy decoding: {fast.tokens == plain.tokens}")
