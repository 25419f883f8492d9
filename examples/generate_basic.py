"""Generation with the Python API: greedy, n-gram speculation (the default method).
The built-in model unless a model is given (a file, a folder or a hub name).

python examples/generate_basic.py [MODEL]
"""

import sys

import hf2q_py  # import before mlx so OpenBLAS speeds up the CPU path

target = hf2q_py.load(sys.argv[1] if len(sys.argv) > 1 else None)

# One call: tokens, text and statistics.
result = hf2q_py.generate(target, "Give me three tips for writing clear code.", max_tokens=80)
print(result.text)
print(result.stats.summary())

# Streaming: text pieces as they are decoded.
for chunk in hf2q_py.stream_generate(target, "Write a haiku about the sea.", max_tokens=40):
    print(chunk.text, end="", flush=True)
print()
