"""Other engines' greedy decoding of the same weights and token ids, for ``hf2q-py ab``.

An engine decodes a prompt of token ids greedily and returns its tokens and, where it
exposes them, the logits each token was chosen from (and those at the prompt positions),
so that ``ab`` can measure how far its numbers are from hf2q-py's.

- ``mlx-lm``: mlx-lm's own ``generate_step`` with a greedy sampler, on the loaded model;
- ``llama.cpp``: llama-cpp-python on the same GGUF file (when it is installed).

Both stop at the target's end-of-sequence ids, as hf2q-py does.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx

from ..errors import Hf2qError, one_line
from ..target import Target

MLX_LM = "mlx-lm"
LLAMA_CPP = "llama.cpp"
ENGINES = (MLX_LM, LLAMA_CPP)
#: Prompt positions whose logits an engine returns (the last ones), at most.
PROMPT_ROWS = 128


@dataclass
class EngineOutput:
    """An engine's greedy output. ``ended``: it stopped at an end-of-sequence
    token before ``max_tokens``. ``logits``: one float32 row per decoding step
    (the row each token, or the ending token, was chosen from), or None;
    ``prompt_logits``: rows at the last prompt positions (each predicting the
    next prompt token), or None."""

    tokens: list[int]
    ended: bool
    logits: mx.array | None = None
    prompt_logits: mx.array | None = None


class Engine(Protocol):
    """Greedy decoding by another engine on the target's weights."""

    name: str

    def generate(self, prompt: list[int], max_tokens: int) -> EngineOutput: ...

    def close(self) -> None: ...


def check_engine(name: str, model_source: str | None) -> None:
    """Refuse, before any model loads, an engine that cannot run here: an
    unknown name, llama.cpp without llama-cpp-python or on a non-GGUF model."""
    if name not in ENGINES:
        raise Hf2qError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
    if name == LLAMA_CPP:
        gguf_file(model_source)
        if importlib.util.find_spec("llama_cpp") is None:
            raise Hf2qError(
                "--methods llama.cpp needs the llama-cpp-python package, which is not installed "
                "(pip install llama-cpp-python)"
            )


def gguf_file(model_source: str | None) -> Path:
    """The GGUF file of a model source (the built-in model is one); an error for anything else."""
    from ..loaders.builtin import builtin_model_path

    if model_source is None or str(model_source) == "":
        return builtin_model_path()
    path = Path(model_source).expanduser()
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                return path
    raise Hf2qError(f"--methods llama.cpp runs GGUF files only; --model {model_source} is not one")


def open_engine(name: str, target: Target, context: int) -> Engine:
    """The engine ``name`` on ``target``'s weights, for sequences of up to ``context`` tokens."""
    if target.sharding is not None:
        raise Hf2qError(f"the {name} engine runs on a whole model; run ab without mlx.launch")
    if name == MLX_LM:
        return MlxLmEngine(target)
    if name == LLAMA_CPP:
        return LlamaCppEngine(gguf_file(target.source), target.eos_token_ids, context)
    raise Hf2qError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")


class MlxLmEngine:
    """mlx-lm's ``generate_step`` (greedy sampler) on the target's own model object."""

    name = MLX_LM

    def __init__(self, target: Target):
        self.model = target.model
        self.eos = set(target.eos_token_ids)

    def generate(self, prompt: list[int], max_tokens: int) -> EngineOutput:
        from mlx_lm.generate import generate_step
        from mlx_lm.sample_utils import make_sampler

        tokens: list[int] = []
        rows: list[mx.array] = []
        ended = False
        steps = generate_step(mx.array(prompt), self.model, max_tokens=max_tokens, sampler=make_sampler(0.0))
        for tok, logprobs in steps:
            rows.append(logprobs.astype(mx.float32))
            if int(tok) in self.eos:
                ended = True
                break
            tokens.append(int(tok))
        steps.close()
        return EngineOutput(tokens, ended, mx.stack(rows) if rows else None)

    def close(self) -> None:
        pass


class LlamaCppEngine:
    """llama-cpp-python on a GGUF file: the argmax of its logits at each step,
    with every position's logits kept (``logits_all``)."""

    name = LLAMA_CPP

    def __init__(self, path: Path, eos: set[int], context: int):
        from llama_cpp import Llama

        self.eos = set(eos)
        try:
            self.llm: Any = Llama(
                str(path), n_ctx=context, n_batch=min(context, 512), logits_all=True, verbose=False, seed=0
            )
        except Exception as e:  # llama.cpp refuses files it cannot read (its message says why)
            raise Hf2qError(f"llama.cpp could not load {path}: {one_line(e)}") from None

    def generate(self, prompt: list[int], max_tokens: int) -> EngineOutput:
        import numpy as np

        llm = self.llm
        if len(prompt) + max_tokens > llm.n_ctx():
            raise Hf2qError(f"llama.cpp's context holds {llm.n_ctx()} tokens, fewer than this case needs")
        llm.reset()
        llm.eval(prompt)
        first = max(0, len(prompt) - PROMPT_ROWS)
        prompt_rows = mx.array(np.array(llm.scores[first : len(prompt) - 1], dtype=np.float32))
        tokens: list[int] = []
        rows = []
        ended = False
        for _ in range(max_tokens):
            row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            rows.append(row)
            tok = int(np.argmax(row))
            if tok in self.eos:
                ended = True
                break
            tokens.append(tok)
            if len(tokens) < max_tokens:
                llm.eval([tok])
        return EngineOutput(
            tokens, ended, mx.array(np.stack(rows)), prompt_rows if first < len(prompt) - 1 else None
        )

    def close(self) -> None:
        self.llm.close()
