"""hf2q-py: speculative decoding on MLX.

    import hf2q_py
    target = hf2q_py.load()                      # built-in SmolLM2-135M-Instruct
    result = hf2q_py.generate(target, "Hello", max_tokens=64, method="ngram")
    print(result.text, result.stats.tokens_per_second)

Importing hf2q_py first loads OpenBLAS on Linux CPUs before ``mlx.core``
(see ``hf2q_py.blas``); the public names are then imported lazily, so
``import hf2q_py`` and ``hf2q-py --help`` stay fast.
"""

from __future__ import annotations

import importlib
from typing import Any

from .blas import preload as _preload_openblas
from .blas import status as openblas_status

_preload_openblas()

__version__ = "0.1.0"

_LAZY = {
    "load": "hf2q_py.loaders",
    "Target": "hf2q_py.target",
    "Runtime": "hf2q_py.target",
    "generate": "hf2q_py.generation",
    "stream_generate": "hf2q_py.generation",
    "batch_generate": "hf2q_py.generation",
    "Scheduler": "hf2q_py.scheduler",
    "SchedulerConfig": "hf2q_py.scheduler",
    "encode_prompt": "hf2q_py.generation",
    "GenerationResult": "hf2q_py.generation",
    "GenerationChunk": "hf2q_py.generation",
    "GenerationConfig": "hf2q_py.config",
    "SpecConfig": "hf2q_py.config",
    "ConstraintSpec": "hf2q_py.constraints",
    "GenerationStats": "hf2q_py.stats",
    "KVConfig": "hf2q_py.kv",
    "MemoryBudget": "hf2q_py.budget",
    "kv_bytes_per_token": "hf2q_py.kv",
    "kv_footprint": "hf2q_py.kv",
    "Proposer": "hf2q_py.proposers.base",
    "Hf2qError": "hf2q_py.errors",
}

__all__ = ["openblas_status", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hf2q_py' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
